"""Fidelity of the cost model: predicted against measured step time of real-compute plans on this machine.

1. Profile this machine (roofline, gloo links over 2 processes, and the layers of
   the built-in ``small-vit-llm`` (``models/small-vit-llm.yaml``) calibrated at the microbatch sizes planned below), right
   before the runs, since the VM's speed drifts; or reuse a profile with ``--profile``.
2. Make a set of plans at P = 2 with the cost model on that profile: ``1f1b`` with the encoder in
   stage 0 (balanced and Megatron-style slabs), ``transpose,1f1b`` with round-robin, contiguous and
   one-rank owners, ``gpipe``, ``transpose,gpipe``, interleaved ``1f1b,1f1b``, frozen and trainable
   encoders, M = 2, 4, 8. Every plan trains the same global batch (8 samples of 128 text tokens with
   0-2 small images each), packed into M microbatches, so their step times are comparable and the
   plan predicted fastest can be set beside the one measured fastest.
3. Run every plan on the real executor (``--compute real``, fp32, gloo, 2 local ranks) for
   ``--steps`` steps, in ``--rounds`` rounds (plans interleaved, the order reversed every other round);
   the measured step time is the median of all steps but each round's first (warm-up).
4. Report per plan predicted / measured, the mean absolute percentage error (MAPE), Kendall's tau
   between the two rankings, the gap between the plan predicted best and the measured best, and the
   same figures for two simpler layer-time models fitted to the same calibration points (one
   efficiency per layer kind; one per kind and phase), to show what the per-call overhead buys.

    python benchmarks/bench_fidelity.py [--profile PATH] [--rounds 3] [--steps 5] [--json OUT] [--plot PNG]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.cost.layers import CostOptions
from mpipe_tune.cost.predict import predict
from mpipe_tune.cost.profile import dump_profile, load_profile, parse_profile
from mpipe_tune.inputs.workload import Microbatch, Workload
from mpipe_tune.frames import Column, format_markdown, ms, text
from mpipe_tune.profiler.fit import fit_efficiency
from mpipe_tune.report.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.specs import load_model

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE.parent / "models" / "small-vit-llm.yaml"
PROFILE_PATH = HERE / "profiles" / "fidelity-vm.json"
P = 2
"""Two ranks: one per core of this 2-core machine, so real compute is not time-shared between ranks."""
NUM_SAMPLES, SAMPLE_TEXT_TOKENS, SEED = 8, 128, 0
IMAGE_TOKENS = (16, 36, 64)
"""Image sizes in backbone tokens (64, 144 and 256 ViT patches: 112, 168 and 224 px squares)."""
CALIBRATION_TOKENS = (64, 128, 256, 512)
"""Layer sizes the profile is calibrated at: the rows of one layer call in the plans below (128-512
text tokens per microbatch, 64-1024 ViT patches)."""
OPTIONS = CostOptions(dtype="fp32")


# --------------------------------------------------------------------------------------- workload


def samples(seed: int = SEED) -> list[Microbatch]:
    """The global batch: ``NUM_SAMPLES`` sequences of 128 text tokens, each with 0-2 images."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(NUM_SAMPLES):
        count = int(rng.choice(3, p=(0.25, 0.5, 0.25)))
        images = tuple(int(rng.choice(IMAGE_TOKENS)) for _ in range(count))
        out.append(Microbatch(sum(images), SAMPLE_TEXT_TOKENS, images))
    return out


def packed(num_microbatches: int) -> Workload:
    """The global batch packed in order into ``num_microbatches`` microbatches of equal sample counts."""
    per = NUM_SAMPLES // num_microbatches
    batch = samples()
    mbs = []
    for m in range(num_microbatches):
        group = batch[m * per:(m + 1) * per]
        images = tuple(size for s in group for size in s.images)
        mbs.append(Microbatch(sum(images), sum(s.text_tokens for s in group), images))
    return Workload(tuple(mbs), f"fidelity-{NUM_SAMPLES}x{SAMPLE_TEXT_TOKENS}@seed{SEED}/M{num_microbatches}")


# ------------------------------------------------------------------------------------------ plans


def plan_specs(model) -> list[Candidate]:
    enc = model.backbone_start
    llm = model.num_layers - enc
    megatron = ((enc + llm // 2, llm - llm // 2),)  # whole encoder + half the backbone in stage 0
    mid = enc + llm // 2
    frozen = ("encoder",)

    def spec(label, schedule, cut, num_microbatches, **fields):
        return Candidate(schedule, cut, pp=P, tp=1, dp=1, num_microbatches=num_microbatches, label=label,
                         dtype=OPTIONS.dtype, **fields)

    return [
        spec("1f1b M=2", "1f1b", (), 2),
        spec("1f1b M=4", "1f1b", (), 4),
        spec("1f1b M=8", "1f1b", (), 8),
        spec("1f1b megatron-slabs M=4", "1f1b", (), 4, slab_counts=megatron),
        spec("1f1b frozen-enc M=4", "1f1b", (), 4, frozen=frozen),
        spec("gpipe M=4", "gpipe", (), 4),
        spec("transpose,1f1b rr M=2", "transpose,1f1b", (enc,), 2),
        spec("transpose,1f1b rr M=4", "transpose,1f1b", (enc,), 4),
        spec("transpose,1f1b rr M=8", "transpose,1f1b", (enc,), 8),
        spec("transpose,1f1b contiguous M=8", "transpose,1f1b", (enc,), 8, owner_map=(0, 0, 0, 0, 1, 1, 1, 1)),
        spec("transpose,1f1b all-rank1 M=4", "transpose,1f1b", (enc,), 4, owner_map=(1, 1, 1, 1)),
        spec("transpose,1f1b rr frozen-enc M=4", "transpose,1f1b", (enc,), 4, frozen=frozen),
        spec("transpose,gpipe rr M=4", "transpose,gpipe", (enc,), 4),
        spec("1f1b,1f1b enc/llm M=4", "1f1b,1f1b", (enc,), 4),
        spec("1f1b,1f1b vpp M=4", "1f1b,1f1b", (mid,), 4),
    ]


def predict_spec(spec: Candidate, profile, base_model):
    workload = packed(spec.num_microbatches)
    return predict(spec, base_model, workload, profile, OPTIONS), spec.model_of(base_model), workload


def make_plans(folder: Path, profile, profile_spec: str) -> list[tuple[Candidate, str, dict]]:
    base = load_model(str(MODEL_PATH))
    out = []
    for index, spec in enumerate(plan_specs(base)):
        prediction, model, workload = predict_spec(spec, profile, base)
        record = plan_record(prediction, model, workload, profile, PlanInputs(str(MODEL_PATH), spec.frozen, profile_spec))
        path = folder / f"plan{index:02d}.json"
        dump_plan(record, path)
        out.append((spec, str(path), record))
    return out


def as_fixed(record: dict) -> Candidate:
    """The candidate as the plan file stores it, with the slabs and owners it was derived with, to re-predict the same plan."""
    return Candidate.from_dict(record["candidate"])


# ----------------------------------------------------------------------- simpler layer-time models


def variant_profile(profile, kind: str):
    """The profile with its efficiencies refitted to its own calibration points by a simpler model:
    ``"one-eff"`` one efficiency per layer kind over both phases (the profiler's first model);
    ``"per-phase"`` a forward and a backward efficiency per kind, no call overhead."""
    data = profile.to_dict()
    peak, bandwidth = profile.peak(OPTIONS.dtype), profile.memory_bytes_per_s
    for name, entry in data["efficiency"].items():
        for key in ("backward_value", "forward_overhead_s", "backward_overhead_s"):
            entry.pop(key, None)
        points = list(zip(entry["phase"], entry["flops"], entry["bytes"], entry["median_s"]))
        if kind == "one-eff":
            entry["value"] = fit_efficiency(*zip(*[p[1:] for p in points]), peak_flops_per_s=peak,
                                            bytes_per_s=bandwidth).efficiency
        else:
            for phase, key in (("fwd", "value"), ("bwd", "backward_value")):
                chosen = [p[1:] for p in points if p[0] == phase]
                entry[key] = fit_efficiency(*zip(*chosen), peak_flops_per_s=peak, bytes_per_s=bandwidth).efficiency
    return parse_profile(data, where=f"{profile.name} ({kind})")


# ------------------------------------------------------------------------------------- statistics


def kendall_tau(a, b) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def figures(predicted, measured) -> dict[str, float]:
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    errors = (predicted - measured) / measured
    best_predicted = int(np.argmin(predicted))
    return {
        "mape": float(np.mean(np.abs(errors))),
        "max_abs_error": float(np.max(np.abs(errors))),
        "mean_error": float(np.mean(errors)),
        "kendall_tau": kendall_tau(predicted, measured),
        "best_gap": float(measured[best_predicted] / measured.min() - 1),
        "predicted_best": best_predicted,
        "measured_best": int(np.argmin(measured)),
    }


def trace_breakdown(trace: dict, num_ranks: int) -> dict[str, float]:
    """From a run's trace (all steps but the first): per rank, median over steps of measured and
    predicted compute-event seconds, and of the time after the rank's last event (the optimizer update)."""
    per_step: dict[tuple[int, int], dict[str, float]] = {}
    step_ends: dict[tuple[int, int], float] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        rank, step = e["pid"], e["args"]["step"]
        if e["tid"] == 1:
            step_ends[(rank, step)] = e["ts"] + e["dur"]
            continue
        slot = per_step.setdefault((rank, step), {"measured": 0.0, "predicted": 0.0, "last_end": 0.0})
        slot["last_end"] = max(slot["last_end"], e["ts"] + e["dur"])
        if e["cat"] in ("Fwd", "Bwd"):
            slot["measured"] += e["dur"] * 1e-6
            slot["predicted"] += e["args"]["predicted_us"] * 1e-6
    out = {}
    for rank in range(num_ranks):
        steps = sorted(s for r, s in per_step if r == rank and s > 0)
        out[f"rank{rank}_compute_measured_s"] = statistics.median(per_step[(rank, s)]["measured"] for s in steps)
        out[f"rank{rank}_compute_predicted_s"] = statistics.median(per_step[(rank, s)]["predicted"] for s in steps)
        out[f"rank{rank}_after_last_event_s"] = statistics.median(
            (step_ends[(rank, s)] - per_step[(rank, s)]["last_end"]) * 1e-6 for s in steps)
    return out


# ------------------------------------------------------------------------------- other tenants' load


class ForeignLoad:
    """CPU share taken by processes other than this one and its descendants over a window.

    The two cores are shared with other jobs (other sessions' tests and benchmarks, some in containers
    whose processes are not listed here). Foreign time = all busy time in ``/proc/stat`` minus the
    time of this process tree, sampled every ``period_s`` by a thread."""

    def __init__(self, period_s: float = 0.5) -> None:
        import threading

        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ticks = os.sysconf("SC_CLK_TCK")
        self.busy_s = self.own_s = self.total_s = 0.0

    @staticmethod
    def _machine() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields[:8]) - idle, sum(fields[:8])

    @staticmethod
    def _processes() -> dict[int, int]:
        """CPU ticks of this process and its descendants (their own, plus their reaped children's, so
        that a rank that exits between two samples is still counted, through its parent)."""
        parent, ticks = {}, {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(entry.path, "stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                pid = int(entry.name)
                parent[pid], ticks[pid] = int(fields[1]), sum(int(x) for x in fields[11:15])
        mine, me = {}, os.getpid()
        for pid in ticks:
            node = pid
            while node > 1 and node != me:
                node = parent.get(node, 0)
            if node == me:
                mine[pid] = ticks[pid]
        return mine

    def _run(self) -> None:
        busy0, total0 = self._machine()
        seen = self._processes()
        while not self._stop.wait(self.period_s):
            busy, total = self._machine()
            now = self._processes()
            # A process that ended was reaped by its parent (in this tree), whose children's ticks now
            # hold its whole time: take back what was counted of it while it lived.
            own = sum(t - seen.get(pid, 0) for pid, t in now.items()) - sum(t for pid, t in seen.items() if pid not in now)
            self.busy_s += (busy - busy0) / self._ticks
            self.total_s += (total - total0) / self._ticks
            self.own_s += max(0, own) / self._ticks
            busy0, total0, seen = busy, total, now

    def __enter__(self) -> "ForeignLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def share(self) -> float:
        """Foreign CPU time over all CPU time (0.5 = one of two cores taken)."""
        return max(0.0, self.busy_s - self.own_s) / self.total_s if self.total_s else 0.0


def wait_for_quiet(threshold: float, max_wait_s: float, window_s: float = 3.0) -> tuple[float, float]:
    """Wait until other tenants take less than ``threshold`` of the CPU over a window (or give up after
    ``max_wait_s``); returns (the last window's foreign share, seconds waited)."""
    started = time.perf_counter()
    while True:
        with ForeignLoad() as load:
            time.sleep(window_s)
        waited = time.perf_counter() - started
        if load.share < threshold or waited >= max_wait_s:
            return load.share, waited
        print(f"  other tenants take {load.share:.0%} of the CPU; waiting ({waited:.0f} s so far)", file=sys.stderr)


# ----------------------------------------------------------------------------------------- driver


def measure_profile(path: Path) -> dict:
    from mpipe_tune.profiler.build import assemble_profile, profile_device

    started = time.perf_counter()
    with ForeignLoad() as load:
        measurements = profile_device("cpu", P, ("fp32",), quick=False, progress=lambda _: None,
                                      calibration=load_model(str(MODEL_PATH)), calibration_tokens=CALIBRATION_TOKENS)
    dump_profile(assemble_profile(measurements, name=path.stem), path)
    return {"wall_s": time.perf_counter() - started, "foreign_cpu_share": load.share}


def recalibrate(profile, model):
    """The profile with its efficiency table refitted to the model's layers timed now (about 5 s)."""
    from mpipe_tune.profiler.build import efficiency_entries
    from mpipe_tune.profiler.calibrate import time_layers
    from mpipe_tune.profiler.device import device_share, import_torch
    from mpipe_tune.profiler.settings import sweep_settings

    torch = import_torch("cpu")
    settings = replace(sweep_settings("cpu", quick=False), calibration_tokens=CALIBRATION_TOKENS)
    with device_share(torch, "cpu", P):
        points = time_layers(torch, "cpu", model, OPTIONS.dtype, settings, lambda _: None)
    data = profile.to_dict()
    data["efficiency"] = efficiency_entries(
        points, peak_flops_per_s=profile.peak(OPTIONS.dtype), bytes_per_s=profile.memory_bytes_per_s,
        model_name=model.name, dtype=OPTIONS.dtype, device="cpu",
        measured={"source": "measured", "date": datetime.date.today().isoformat()})
    probe = next(p.seconds.median for p in points if p.kind == "dense_block" and p.phase == "fwd" and p.tokens == 256)
    return parse_profile(data, where=f"{profile.name} recalibrated"), probe


def profile_probe(profile) -> float | None:
    """The profile's own median for the speed probe (decoder block forward at 256 tokens), if calibrated there."""
    origin = profile.provenance.get("efficiency.dense_block", {})
    for tokens, phase, seconds in zip(origin.get("tokens", ()), origin.get("phase", ()), origin.get("median_s", ())):
        if tokens == 256 and phase == "fwd":
            return seconds
    return None


def run_plan(path: str, steps: int) -> tuple[dict, float, float]:
    """One launch of 2 ranks running one plan; returns its result, the foreign CPU share during the
    run and its wall time (process start-up included)."""
    from mpipe_tune.runtime.launch import launch_local
    from mpipe_tune.runtime.worker import RunJob, run_jobs

    started = time.perf_counter()
    with ForeignLoad() as load:
        [result] = launch_local(run_jobs, ([RunJob(path, steps=steps, compute="real", dtype="fp32", trace=True)],),
                                P, timeout_s=600.0, deadline_s=1800.0)
    return result, load.share, time.perf_counter() - started


def quiet_run(path: str, steps: int, threshold: float, max_wait_s: float, max_tries: int,
              recalibrate_with=None) -> tuple[dict, list[dict], object]:
    """Run a plan until a run sees other jobs take less than ``threshold`` of the CPU (at most
    ``max_tries`` runs; the last one counts then); returns the kept result, every try's conditions
    and, with ``recalibrate_with=(profile, model)``, the profile recalibrated right before the kept run."""
    tries = []
    fresh = None
    for attempt in range(max_tries):
        before, waited = wait_for_quiet(threshold, max_wait_s)
        with ForeignLoad() as load:
            probe = None
            if recalibrate_with is not None:
                fresh, probe = recalibrate(*recalibrate_with)
            result, share, wall_s = run_plan(path, steps)
        tries.append({"foreign_before": before, "waited_s": waited, "foreign_during": load.share, "wall_s": wall_s,
                      "dense_block_256_fwd_s": probe})
        if load.share < threshold:
            break
        print(f"  {Path(path).name}: other jobs took {load.share:.0%} of the CPU during the run; again", file=sys.stderr)
    return result, tries, fresh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="reuse this profile instead of measuring one first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per plan and round (the first is warm-up)")
    parser.add_argument("--quiet-below", type=float, default=0.05,
                        help="keep a measurement (the profile, each plan's run) only when other jobs took less than "
                             "this share of the CPU during it, and wait for such a spell before each (default 0.05)")
    parser.add_argument("--max-wait", type=float, default=600.0, help="give up waiting for a quiet spell after this")
    parser.add_argument("--max-tries", type=int, default=4, help="runs of one measurement before keeping a noisy one")
    parser.add_argument("--json", default=None, help="write the full record here")
    parser.add_argument("--plot", default=None, help="write the predicted-vs-measured plot here (PNG)")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="measure nothing: print the tables and draw --plot from a record written by --json")
    args = parser.parse_args()
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        if args.plot:
            plot(record["plans"], record, args.plot)
        print_table(record)
        return 0

    from mpipe_tune.runtime.launch import disable_backend_autoload

    disable_backend_autoload()
    import torch

    conditions: dict = {"profile": []}
    if args.profile is None:
        for _ in range(args.max_tries):
            before, waited = wait_for_quiet(args.quiet_below, args.max_wait)
            measured = measure_profile(PROFILE_PATH)
            conditions["profile"].append({"foreign_before": before, "waited_s": waited, **measured})
            if measured["foreign_cpu_share"] < args.quiet_below:
                break
        profile_path = PROFILE_PATH
    else:
        profile_path = Path(args.profile)
    profile = load_profile(profile_path)
    with tempfile.TemporaryDirectory() as folder:
        plans = make_plans(Path(folder), profile, str(profile_path))
        runs: list[list[dict]] = [[] for _ in plans]
        tries: list[list[list[dict]]] = [[] for _ in plans]
        fresh_predicted: list[list[float]] = [[] for _ in plans]
        base = load_model(str(MODEL_PATH))
        started = time.perf_counter()
        for r in range(args.rounds):
            order = range(len(plans)) if r % 2 == 0 else reversed(range(len(plans)))
            for i in order:
                result, attempts, fresh = quiet_run(plans[i][1], args.steps, args.quiet_below, args.max_wait,
                                                    args.max_tries, recalibrate_with=(profile, base))
                runs[i].append(result)
                tries[i].append(attempts)
                fixed = as_fixed(plans[i][2])
                fresh_predicted[i].append(predict_spec(fixed, fresh, base)[0].timeline.makespan_s)
            print(f"round {r} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        conditions["runs_wall_s"] = time.perf_counter() - started

    variants = {kind: variant_profile(profile, kind) for kind in ("one-eff", "per-phase")}
    rows = []
    for (spec, _path, record), results, plan_tries, fresh_s in zip(plans, runs, tries, fresh_predicted):
        steps_s = [t for r in results for t in r["summary"]["step_times_s"][1:]]
        round_medians = [statistics.median(r["summary"]["step_times_s"][1:]) for r in results]
        fixed = as_fixed(record)
        rows.append({
            "label": spec.label,
            "schedule": spec.schedule, "microbatches": spec.num_microbatches, "frozen_encoder": bool(spec.frozen),
            "slabs": record["candidate"]["slabs"], "owners": record["candidate"]["owners"],
            "predicted_s": record["predicted"]["makespan_s"],
            "measured_s": statistics.median(steps_s),
            "round_medians_s": round_medians,
            "steps_s": steps_s,
            "predicted_by_variant_s": {k: predict_spec(fixed, v, base)[0].timeline.makespan_s
                                       for k, v in variants.items()},
            "breakdown": [trace_breakdown(r["trace"], P) for r in results],
            "tries": plan_tries,
            "predicted_recalibrated_s": fresh_s,
            "paired_errors_recalibrated": [f / m - 1 for f, m in zip(fresh_s, round_medians)],
            "max_foreign_share": max(t[-1]["foreign_during"] for t in plan_tries),
        })
    measured = [r["measured_s"] for r in rows]
    # Measurement noise: each round's median against the all-round median, as a MAPE.
    noise = float(np.mean([abs(m / r["measured_s"] - 1) for r in rows for m in r["round_medians_s"]]))
    record = {
        "command": "python benchmarks/bench_fidelity.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "model": str(MODEL_PATH.relative_to(HERE.parent)), "profile": os.path.relpath(profile_path, HERE.parent), "pp": P,
        "steps": args.steps, "rounds": args.rounds, "conditions": conditions,
        "figures": figures([r["predicted_s"] for r in rows], measured),
        "figures_by_variant": {k: figures([r["predicted_by_variant_s"][k] for r in rows], measured)
                               for k in variants},
        "figures_recalibrated": figures([statistics.median(r["predicted_recalibrated_s"]) for r in rows], measured),
        "paired_mape_recalibrated": float(np.mean([abs(e) for r in rows for e in r["paired_errors_recalibrated"]])),
        "noise_round_vs_all_mape": noise,
        "profile_dense_block_256_fwd_s": profile_probe(profile),
        "plans": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        plot(rows, record, args.plot)
    print_table(record)
    return 0


def plans_frame(record: dict) -> pd.DataFrame:
    """One row per plan: predicted and measured step time (s), the error, per-round medians and
    recalibrated predictions (s), and the two simpler layer-time models' predictions (s)."""
    return pd.DataFrame.from_records([{
        "plan": r["label"], "predicted_s": r["predicted_s"], "measured_s": r["measured_s"],
        "error": r["predicted_s"] / r["measured_s"] - 1, "round_medians_s": r["round_medians_s"],
        "predicted_recalibrated_s": r["predicted_recalibrated_s"],
        "one_eff_s": r["predicted_by_variant_s"]["one-eff"], "per_phase_s": r["predicted_by_variant_s"]["per-phase"],
    } for r in record["plans"]])


def figures_frame(record: dict) -> pd.DataFrame:
    """One row per prediction: MAPE, max abs and mean error, Kendall's tau, best gap (plain ratios)."""
    rows = [("overhead + per-phase efficiency, one profile", record["figures"]),
            ("the same, recalibrated before each run (median over rounds)", record["figures_recalibrated"]),
            *[(f"{k}, one profile", f) for k, f in record["figures_by_variant"].items()]]
    return pd.DataFrame.from_records([{"prediction": name, **f} for name, f in rows])


def _ms_list(key: str):
    return lambda r: ", ".join(f"{m * 1e3:.0f}" for m in r[key])


PLAN_COLUMNS = (
    Column("#", lambda r: str(r.name), ">"),
    Column("plan", lambda r: f"`{r['plan']}`"),
    Column("predicted ms", ms("predicted_s", ".1f"), ">"),
    Column("measured ms", ms("measured_s", ".1f"), ">"),
    Column("error", text("error", "+.1%"), ">"),
    Column("measured per round ms", _ms_list("round_medians_s")),
    Column("recalibrated: predicted per round ms", _ms_list("predicted_recalibrated_s")),
    Column("one-eff ms", ms("one_eff_s", ".1f"), ">"),
    Column("per-phase ms", ms("per_phase_s", ".1f"), ">"),
)
FIGURE_COLUMNS = (
    Column("prediction", text("prediction")),
    Column("MAPE", text("mape", ".1%"), ">"),
    Column("max abs error", text("max_abs_error", ".1%"), ">"),
    Column("mean error", text("mean_error", "+.1%"), ">"),
    Column("Kendall tau", text("kendall_tau", ".3f"), ">"),
    Column("best gap", text("best_gap", ".1%"), ">"),
)


def print_table(record: dict) -> None:
    print(format_markdown(plans_frame(record), PLAN_COLUMNS))
    print()
    print(format_markdown(figures_frame(record), FIGURE_COLUMNS))
    measured = np.array([r["measured_s"] for r in record["plans"]])
    for name, key in (("the profile", None), ("one-eff", "one-eff"), ("per-phase", "per-phase")):
        predicted = np.array([r["predicted_s"] if key is None else r["predicted_by_variant_s"][key]
                              for r in record["plans"]])
        scale = float(np.median(measured / predicted))
        errors = np.abs(scale * predicted / measured - 1)
        print(f"diagnostic, {name} times one common factor {scale:.3f} (the level set aside, the shape kept): "
              f"MAPE {errors.mean():.1%}, max {errors.max():.1%}")
    print(f"\nrecalibrated before each run, each run against its own prediction: MAPE "
          f"{record['paired_mape_recalibrated']:.1%}")
    print(f"measurement noise (each round's median against all rounds): {record['noise_round_vs_all_mape']:.1%}")
    probes = [t[-1]["dense_block_256_fwd_s"] for r in record["plans"] for t in r["tries"]]
    at_profile = record.get("profile_dense_block_256_fwd_s")
    print(f"machine speed probe (decoder block forward, 256 tokens) over the runs: {min(probes) * 1e3:.2f}.."
          f"{max(probes) * 1e3:.2f} ms, median {statistics.median(probes) * 1e3:.2f} ms"
          + (f"; in the profile: {at_profile * 1e3:.2f} ms" if at_profile else ""))
    kept = [t[-1]["foreign_during"] for r in record["plans"] for t in r["tries"]]
    retried = sum(len(t) - 1 for r in record["plans"] for t in r["tries"])
    print(f"other jobs' CPU share during the kept runs: median {statistics.median(kept):.1%}, max {max(kept):.1%} "
          f"({retried} runs repeated for noise); profile: {record['conditions']['profile']}; "
          f"runs {record['conditions']['runs_wall_s']:.0f} s")


def plot(rows: list[dict], record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
    measured = np.array([r["measured_s"] for r in rows]) * 1e3
    everything = np.concatenate([measured, *[np.array([r["predicted_s"], *r["predicted_recalibrated_s"],
                                                       r["predicted_by_variant_s"]["one-eff"]]) * 1e3 for r in rows]])
    lo, hi = everything.min() * 0.9, everything.max() * 1.1
    series = [("overhead + per-phase eff., one profile", np.array([r["predicted_s"] for r in rows]) * 1e3, "o", "C0"),
              ("the same, recalibrated before each run",
               np.array([statistics.median(r["predicted_recalibrated_s"]) for r in rows]) * 1e3, "s", "C2"),
              ("one profile, one efficiency per kind",
               np.array([r["predicted_by_variant_s"]["one-eff"] for r in rows]) * 1e3, "x", "C3")]
    ax = axes[0]
    grid = np.array([lo, hi])
    ax.fill_between(grid, grid * 0.95, grid * 1.05, color="0.9", label="±5%")
    ax.plot(grid, grid, color="0.5", lw=1)
    for label, predicted, marker, colour in series:
        f = figures(predicted, measured)
        ax.scatter(measured, predicted, marker=marker, color=colour,
                   label=f"{label}: MAPE {f['mape']:.1%}, tau {f['kendall_tau']:.2f}")
    for i, (m, p) in enumerate(zip(measured, series[0][1])):
        ax.annotate(str(i), (m, p), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"{len(rows)} plans, P={record['pp']}, real compute on CPU/gloo")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    order = np.argsort(measured)
    y = np.arange(len(rows))
    spread = [(min(rows[i]["round_medians_s"]) * 1e3, max(rows[i]["round_medians_s"]) * 1e3) for i in order]
    ax.hlines(y, [s[0] for s in spread], [s[1] for s in spread], color="0.6", lw=3, label="measured, range of round medians")
    ax.scatter(measured[order], y, color="k", s=14, label="measured (median)", zorder=3)
    ax.scatter(series[0][1][order], y, color="C0", marker="o", facecolors="none", label="predicted, one profile", zorder=3)
    ax.scatter(series[1][1][order], y, color="C2", marker="s", facecolors="none", label="predicted, recalibrated", zorder=3)
    ax.set_yticks(y)
    ax.set_yticklabels([f"{i}: {rows[i]['label']}" for i in order], fontsize=7)
    ax.set_xlabel("step time (ms)")
    ax.set_title("plans by measured step time")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
