"""Fidelity of the cost model: predicted against measured step time, real compute on this machine.

1. Profile this machine right before the runs, once per world size the plans use (2 ranks: pp 2, or
   dp 2 or tp 2 on one stage: a core per rank), with the layers of the built-in ``small-vit-llm`` calibrated by
   all ranks at once (:mod:`mpipe_tune.profiler._together`), at the microbatch sizes planned below;
   or reuse the profiles with ``--profiles DIR``. With ``--reprofile``, again before every later round,
   whose runs are then predicted on that round's profiles (a plan's prediction: its runs' median).
2. Make at least 24 plans with the cost model on those profiles: ``1f1b`` with the encoder in stage 0
   (balanced and Megatron-style slabs), ``transpose,1f1b`` with round-robin, contiguous and one-rank
   owners, ``gpipe``, ``transpose,gpipe``, interleaved ``1f1b,1f1b``, frozen and trainable encoders,
   M = 2, 4, 8, and data- and tensor-parallel plans. Every plan trains the same global batch (8
   samples of 128 text tokens with 0-2 small images each), packed into microbatches, so their step
   times are comparable and the plan predicted fastest can be set beside the one measured fastest.
   The small set (``--set small``, :mod:`fidelity_small`): small models at micro-batch 1. The ZeRO set
   (``--set zero``): the same global batch on 2 data-parallel ranks at ZeRO 0, 1, 2 and 3 (resharding after
   forward, and keeping the weights), a core per rank.
3. Run every plan on the real executor (``--compute real``, fp32, gloo, one process per rank) for
   ``--steps`` steps, in ``--rounds`` rounds (plans interleaved, the order reversed every other round),
   with the speed probe (a fixed short timing of the calibration chain, all ranks at once) right
   before each run and after each of its steps; measured = median of all steps but each run's first (warm-up).
4. Emulated-compute fidelity at P = 8 and 16 for the baseline set (``megatron``, ``disttrain``,
   ``vpp``, ``gpipe``, ``mpipe-rr`` of ``qwen2vl-vit-llama3-8b`` on ``h100-sxm``, as
   ``bench_runtime_emulated.py`` plans them): every compute event waits its predicted time on the
   real executor, so this measures the executor's realisation of the predicted schedule.
5. Report per plan predicted / measured, MAPE raw and probe-corrected (each run's prediction times
   the probe's seconds at run time over its seconds at profile time: the correction comes from the
   probe alone, never from the step times), Kendall's tau, and the gap between the plan predicted
   best and the measured best. ``--replot`` computes all of it again from the record, which keeps
   every run's raw step times and probes.

    python benchmarks/bench_fidelity.py [--reprofile] [--rounds 3] [--steps 5] [--json OUT] [--plot PNG]
    python benchmarks/bench_fidelity.py --quick          # 4 plans, 1 round, quick profiles: an end-to-end check
    python benchmarks/bench_fidelity.py --replot benchmarks/fidelity-results.json [--plot PNG]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost import CostOptions, predict, dump_profile, load_profile
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.outputs import Column, format_markdown, ms, text
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.inputs import load_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the emulated runs plan as bench_runtime_emulated.py does

import fidelity_small  # noqa: E402
from quiet import ForeignLoad, wait_for_quiet  # noqa: E402

MODEL_PATH = HERE.parent / "models" / "small-vit-llm.yaml"
PROFILE_DIR = HERE / "profiles"
P = 2
"""Two pipeline ranks: one per core of this 2-core machine (the dp 2 and tp 2 plans run one stage)."""
NUM_SAMPLES, SAMPLE_TEXT_TOKENS, SEED = 8, 128, 0
IMAGE_TOKENS = (16, 36, 64)
"""Image sizes in backbone tokens (64, 144 and 256 ViT patches: 112, 168 and 224 px squares)."""
CALIBRATION_TOKENS = (64, 128, 256, 512)
"""Layer sizes the profiles are calibrated at: the rows of one layer call in the plans below (128-512
text tokens per microbatch, 64-1024 ViT patches)."""
PROBE_TOKENS = 256
"""The speed probe's size (one of the calibration sizes, so the profile holds its value)."""
OPTIONS = CostOptions(dtype="fp32", optimizer_bytes_per_param=0.0, grad_bytes_per_param=4.0, kernel_mode="eager",
                      overlap_dp_comm=False, flat_buffer_copies=True)
"""What the runtime does: fp32, plain SGD (no optimizer state, fp32 gradients), the data-parallel reduce as
the candidate's ZeRO stage says (the default 1: a reduce-scatter, then the update all-gathers the weights)
and not overlapped with the backward (the executor runs each reduce after its last backward), the gradients
and a distributed optimizer's weights copied through flat buffers around it, eager torch
(every operator its own kernel, each issued at the profile's ``dispatch_s``). The candidate sets the
degrees and ZeRO stage (``predict`` reads only this record's framework part)."""
EMULATED_PPS, EMULATED_MICROBATCHES = (8, 16), 32
EMULATED_BASELINES = ("megatron", "disttrain", "vpp", "gpipe", "mpipe-rr")


def profile_path(world: int, folder: Path = PROFILE_DIR) -> Path:
    return folder / ("fidelity-vm.json" if world == P else f"fidelity-vm-{world}ranks.json")


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


def packed(num_microbatches: int, dp: int = 1) -> Workload:
    """One replica's share of the global batch packed in order into ``num_microbatches`` microbatches
    of equal sample counts. With ``dp`` replicas each trains ``1/dp`` of the samples; the runtime gives
    every replica the stored shapes (those of the first share), with its own synthetic data."""
    batch = samples()[:NUM_SAMPLES // dp]
    per = len(batch) // num_microbatches
    mbs = []
    for m in range(num_microbatches):
        group = batch[m * per:(m + 1) * per]
        images = tuple(size for s in group for size in s.images)
        mbs.append(Microbatch(sum(images), sum(s.text_tokens for s in group), images))
    return Workload(tuple(mbs), f"fidelity-{NUM_SAMPLES // dp}x{SAMPLE_TEXT_TOKENS}@seed{SEED}/M{num_microbatches}")


# ------------------------------------------------------------------------------------------ plans


@dataclass(frozen=True)
class Spec:
    label: str
    schedule: str
    cut: tuple[int, ...]
    num_microbatches: int
    frozen: bool = False
    slab_counts: tuple[tuple[int, ...], ...] | None = None
    owners: tuple[int, ...] | None = None
    tp: int = 1
    dp: int = 1
    pp: int = P
    model: str = str(MODEL_PATH)
    sample_tokens: int | None = None
    """None: the multimodal global batch of ``samples()``; else the small set's text samples of this
    many tokens, one a microbatch (:mod:`fidelity_small`)."""
    zero_stage: int = 1
    reshard_after_forward: bool | None = None
    """ZeRO-3's reshard policy (None: the candidate's default for its pp)."""
    group: str = "main"
    """The set the plan belongs to (:data:`SETS`)."""

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    def workload(self) -> Workload:
        if self.sample_tokens is None:
            return packed(self.num_microbatches, self.dp)
        return fidelity_small.text_workload(self.sample_tokens, self.num_microbatches, self.dp)


QUICK = ("1f1b M=4", "transpose,1f1b rr M=4", "dp2 M=2", "tp2 M=4")


def small_specs() -> list[Spec]:
    """The small-model, short-sequence set (:mod:`fidelity_small`)."""
    return [Spec(label, "1f1b", (), sample_tokens=tokens, model=str(path), group="small", **layout)
            for label, path, tokens, layout in fidelity_small.cases()]


def zero_specs() -> list[Spec]:
    """The ZeRO set: ``small-vit-llm``'s global batch on 2 data-parallel ranks (a core each) at every ZeRO stage,
    stage 3 resharding after forward (pp 1's default) and keeping the weights through the step."""
    return [Spec(f"dp2 zero{z}{' keep' if keep else ''} M=2", "1f1b", (), 2, dp=2, pp=1, zero_stage=z,
                 reshard_after_forward=False if keep else None, group="zero")
            for z, keep in ((0, False), (1, False), (2, False), (3, False), (3, True))]


def plan_specs(model) -> list[Spec]:
    enc = model.backbone_start
    llm = model.num_layers - enc
    megatron = ((enc + llm // 2, llm - llm // 2),)  # whole encoder + half the backbone in stage 0
    mid = enc + llm // 2
    return [
        Spec("1f1b M=2", "1f1b", (), 2),
        Spec("1f1b M=4", "1f1b", (), 4),
        Spec("1f1b M=8", "1f1b", (), 8),
        Spec("1f1b megatron-slabs M=4", "1f1b", (), 4, slab_counts=megatron),
        Spec("1f1b disttrain-slabs M=4", "1f1b", (), 4, slab_counts=((enc, llm),)),  # the encoder alone in stage 0
        Spec("1f1b frozen-enc M=4", "1f1b", (), 4, frozen=True),
        Spec("1f1b frozen-enc M=8", "1f1b", (), 8, frozen=True),
        Spec("gpipe M=4", "gpipe", (), 4),
        Spec("gpipe M=8", "gpipe", (), 8),
        Spec("transpose,1f1b rr M=2", "transpose,1f1b", (enc,), 2),
        Spec("transpose,1f1b rr M=4", "transpose,1f1b", (enc,), 4),
        Spec("transpose,1f1b rr M=8", "transpose,1f1b", (enc,), 8),
        Spec("transpose,1f1b contiguous M=8", "transpose,1f1b", (enc,), 8, owners=(0, 0, 0, 0, 1, 1, 1, 1)),
        Spec("transpose,1f1b all-rank1 M=4", "transpose,1f1b", (enc,), 4, owners=(1, 1, 1, 1)),
        Spec("transpose,1f1b rr frozen-enc M=4", "transpose,1f1b", (enc,), 4, frozen=True),
        Spec("transpose,gpipe rr M=4", "transpose,gpipe", (enc,), 4),
        Spec("transpose,gpipe rr M=8", "transpose,gpipe", (enc,), 8),
        Spec("1f1b,1f1b enc/llm M=4", "1f1b,1f1b", (enc,), 4),
        Spec("1f1b,1f1b vpp M=4", "1f1b,1f1b", (mid,), 4),
        # Data and tensor parallelism on one pipeline stage, so that every rank has a core of its own
        # (as every rank has its own device where the cost model is used): with pp 2 their 4 ranks would
        # time-share the 2 cores, each running faster whenever the other stage idles in a bubble.
        Spec("dp2 M=1", "1f1b", (), 1, dp=2, pp=1),
        Spec("dp2 M=2", "1f1b", (), 2, dp=2, pp=1),
        Spec("dp2 M=4", "1f1b", (), 4, dp=2, pp=1),
        Spec("tp2 M=2", "1f1b", (), 2, tp=2, pp=1),
        Spec("tp2 M=4", "1f1b", (), 4, tp=2, pp=1),
        Spec("tp2 M=8", "1f1b", (), 8, tp=2, pp=1),
    ]


def candidate_of(spec: Spec) -> Candidate:
    """The candidate of ``spec`` (the one place a spec becomes a candidate)."""
    transpose = "transpose" in spec.schedule.split(",")
    return Candidate(spec.schedule, spec.cut, pp=spec.pp, tp=spec.tp, dp=spec.dp,
                     num_microbatches=spec.num_microbatches, slab_counts=spec.slab_counts, owner_map=spec.owners,
                     label=spec.label, dtype=OPTIONS.dtype,
                     owner_policy="round-robin" if transpose and spec.owners is None else None,
                     frozen=("encoder",) if spec.frozen else (), zero_stage=spec.zero_stage,
                     reshard_after_forward=spec.reshard_after_forward)


@functools.lru_cache(maxsize=None)
def spec_model(path: str):
    return load_model(path)


def predict_spec(spec: Spec, profile):
    """``spec``'s candidate predicted on ``profile``: (prediction, the model as run, the workload)."""
    candidate, base_model, workload = candidate_of(spec), spec_model(spec.model), spec.workload()
    return predict(candidate, base_model, workload, profile, OPTIONS), candidate.model_of(base_model), workload


def roofline_s(spec: Spec, profile) -> float:
    """What the roofline alone predicts for ``spec`` (:func:`fidelity_small.roofline_profile`)."""
    return predict_spec(spec, fidelity_small.roofline_profile(profile))[0].timeline.makespan_s


def encoder_share(profile) -> float:
    """The encoder's (and projector's) share of the global batch's compute seconds, forward plus
    backward, from the layer table (one sample per microbatch), as ``bench_sweep.py`` defines it."""
    from mpipe_tune.cost import build_layer_table, layer_weights

    model = load_model(str(MODEL_PATH))
    weights = layer_weights(model, build_layer_table(model, packed(NUM_SAMPLES), profile, OPTIONS))
    enc = model.backbone_start
    return sum(weights[:enc]) / sum(weights)


def make_plans(folder: Path, specs: list[Spec], profiles: dict[int, Path]) -> list[tuple[Spec, str, dict, float]]:
    """Each spec's plan file, its record and what the roofline alone predicts for it."""
    out = []
    for index, spec in enumerate(specs):
        profile = load_profile(profiles[spec.world])
        prediction, model, workload = predict_spec(spec, profile)
        inputs = PlanInputs(spec.model, ("encoder",) if spec.frozen else (), str(profiles[spec.world]))
        record = plan_record(prediction, model, workload, profile, inputs)
        path = folder / f"plan{index:02d}.json"
        dump_plan(record, path)
        out.append((spec, str(path), record, roofline_s(spec, profile)))
    return out


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
        "kendall_tau": kendall_tau(predicted, measured) if len(predicted) > 1 else float("nan"),
        "best_gap": float(measured[best_predicted] / measured.min() - 1),
        "predicted_best": best_predicted,
        "measured_best": int(np.argmin(measured)),
    }


def measured_s(runs: list[dict]) -> float:
    """A plan's measured step: the median over its runs of every step but each run's first."""
    return statistics.median(t for r in runs for t in r["step_times_s"][1:])


def run_predicted_s(plan: dict, run: dict) -> float:
    """A run's prediction: on its round's profile with ``--reprofile``, else the plan's."""
    return run.get("predicted_s", plan["predicted_s"])


def run_probes_s(run: dict) -> list[float]:
    """The probes around a run's measured steps (all but the first): those after every step, from the
    first on; in a record from before the probes between steps, the ones before and after the run."""
    return run["probe_steps_s"] if "probe_steps_s" in run else [run["probe_before_s"], run["probe_after_s"]]


def run_probe_factor(plan: dict, run: dict) -> float:
    """How much slower the machine ran during a run than when its prediction's profile was measured,
    from the speed probe alone: the mean of the probes around its measured steps / that profile's probe."""
    return statistics.mean(run_probes_s(run)) / run.get("profile_probe_s", plan["profile_probe_s"])


def predicted_s(plan: dict) -> float:
    """A plan's prediction: the median of its runs' (one value without ``--reprofile``)."""
    return statistics.median(run_predicted_s(plan, run) for run in plan["runs"])


def corrected_s(plan: dict) -> float:
    """A plan's probe-corrected prediction: the median over its runs of prediction times probe factor."""
    return statistics.median(run_predicted_s(plan, run) * run_probe_factor(plan, run) for run in plan["runs"])


def plan_roofline_s(plan: dict) -> float:
    """What the roofline alone predicts for a plan: the median of its runs' (NaN in a record without it)."""
    values = [run.get("roofline_s", plan.get("roofline_s")) for run in plan["runs"]]
    return float("nan") if None in values else statistics.median(values)


SETS = {"": "main", "small_": "small", "zero_": "zero"}
"""Figure-key prefix -> the plans' set (a record from before the small set has only the main one)."""


def summarize_record(record: dict) -> dict:
    """Every figure, from the record's raw step times and probes (what ``--replot`` prints): per set,
    the profile's prediction (``raw``), probe-corrected, and the roofline alone where the record has it."""
    plans = record["plans"]
    measured = [measured_s(r["runs"]) for r in plans]
    predicted = [predicted_s(r) for r in plans]
    corrected = [corrected_s(r) for r in plans]
    roofline = [plan_roofline_s(r) for r in plans]
    out = {"measured_s": measured, "predicted_s": predicted, "corrected_s": corrected, "roofline_s": roofline}
    for prefix, name in SETS.items():
        chosen = [i for i, r in enumerate(plans) if r.get("set", "main") == name]
        if not chosen:
            continue
        pick = lambda values: [values[i] for i in chosen]  # noqa: E731
        out[f"{prefix}raw"] = figures(pick(predicted), pick(measured))
        out[f"{prefix}probe_corrected"] = figures(pick(corrected), pick(measured))
        if not any(np.isnan(pick(roofline))):
            out[f"{prefix}roofline"] = figures(pick(roofline), pick(measured))
    for pp, rows in record.get("emulated", {}).items():
        out[f"emulated_P{pp}"] = figures([r["predicted_s"] for r in rows], [measured_s(r["runs"]) for r in rows])
    return out


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


# ----------------------------------------------------------------------------------------- driver


def measure_profile(path: Path, world: int, quick: bool) -> dict:
    """Profile this machine for ``world`` local ranks (layers calibrated by all of them at once), with
    the host's dispatch cost and the kernel sweeps."""
    from mpipe_tune.profiler import assemble_profile, profile_device, kernel_sweep_settings

    started = time.perf_counter()
    with ForeignLoad() as load:
        measurements = profile_device("cpu", world, ("fp32",), quick=quick, progress=lambda _: None,
                                      calibration=load_model(str(MODEL_PATH)), calibration_tokens=CALIBRATION_TOKENS,
                                      kernel_settings=kernel_sweep_settings("cpu", quick=quick))
    dump_profile(assemble_profile(measurements, name=path.stem), path)
    return {"world": world, "wall_s": time.perf_counter() - started, "foreign_cpu_share": load.share}


def run_plan(path: str, steps: int, world: int) -> tuple[dict, float, float]:
    """One launch of ``world`` ranks running one plan between speed probes; returns the result
    (its summary, trace and probes), the foreign CPU share during it and its wall time."""
    from mpipe_tune.profiler import probed_run_jobs
    from mpipe_tune.runtime import launch_local, RunJob

    started = time.perf_counter()
    job = RunJob(path, steps=steps, compute="real", dtype="fp32", trace=True)
    with ForeignLoad() as load:
        [result] = launch_local(probed_run_jobs, ([job], load_model(str(MODEL_PATH)), OPTIONS.dtype, PROBE_TOKENS),
                                world, timeout_s=600.0, deadline_s=1800.0)
    return result, load.share, time.perf_counter() - started


def quiet_run(path: str, steps: int, world: int, threshold: float, max_wait_s: float,
              max_tries: int) -> tuple[dict, list[dict]]:
    """Run a plan until a run sees other jobs take less than ``threshold`` of the CPU (at most
    ``max_tries`` runs; the last one counts then); returns the kept result and every try's conditions."""
    tries = []
    for _ in range(max_tries):
        before, waited = wait_for_quiet(threshold, max_wait_s)
        result, share, wall_s = run_plan(path, steps, world)
        tries.append({"foreign_before": before, "waited_s": waited, "foreign_during": share, "wall_s": wall_s})
        if share < threshold:
            break
        print(f"  {Path(path).name}: other jobs took {share:.0%} of the CPU during the run; again", file=sys.stderr)
    return result, tries


def run_record(result: dict, tries: list[dict], world: int) -> dict:
    """What the record keeps of one run: raw step times, probes, the trace's breakdown, conditions."""
    return {"step_times_s": result["summary"]["step_times_s"], "probe_before_s": result["probe_before_s"],
            "probe_after_s": result["probe_after_s"], "probe_steps_s": result["probe_steps_s"],
            "breakdown": trace_breakdown(result["trace"], world),
            "tries": tries}


def emulated_rows(folder: Path, pps: tuple[int, ...], names: tuple[str, ...], steps: int) -> dict[str, list[dict]]:
    """The baseline set at each P with emulated compute: each P's plans in one launch of P ranks."""
    from bench_runtime_emulated import MODEL, PROFILE, baseline_plans

    from mpipe_tune.runtime import launch_local, RunJob, run_jobs

    out = {}
    for pp in pps:
        paths = baseline_plans(folder / f"emulated-p{pp}", pp, EMULATED_MICROBATCHES, names)
        jobs = [RunJob(path, steps=steps, compute="emulated") for path in paths.values()]
        with ForeignLoad() as load:
            results = launch_local(run_jobs, (jobs,), pp, timeout_s=300.0, deadline_s=1800.0)
        out[str(pp)] = [{"label": name, "model": MODEL, "profile": PROFILE, "microbatches": EMULATED_MICROBATCHES,
                         "predicted_s": r["summary"]["predicted_step_s"],
                         "runs": [{"step_times_s": r["summary"]["step_times_s"]}], "foreign_share": load.share}
                        for name, r in zip(paths, results)]
        print(f"emulated P={pp} done", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default=None, metavar="DIR",
                        help="reuse the profiles in DIR (fidelity-vm.json for 2 ranks) instead of "
                             "measuring them first")
    parser.add_argument("--profile-dir", default=None, metavar="DIR",
                        help="where measured profiles go (default benchmarks/profiles; a scratch folder with --quick)")
    parser.add_argument("--only", default=None, metavar="WORDS",
                        help="run only the plans whose label contains one of these comma-separated words, e.g. tp2")
    parser.add_argument("--set", choices=("all", "main", "small", "zero"), default="all",
                        help="the plans of small-vit-llm (main), the small-model short-sequence set (small, "
                             "benchmarks/fidelity_small.py), small-vit-llm on 2 data-parallel ranks at each ZeRO "
                             "stage (zero) or all three (default)")
    parser.add_argument("--no-emulated", action="store_true", help="skip the emulated-compute rows")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every plan (default 3; 1 with --quick)")
    parser.add_argument("--reprofile", action="store_true",
                        help="profile again before every round after the first and predict that round's runs on "
                             "those profiles (the host's speed drifts over an hour)")
    parser.add_argument("--steps", type=int, default=5, help="steps per plan and round (the first is warm-up)")
    parser.add_argument("--emulated-steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help=f"an end-to-end check: the plans {', '.join(QUICK + fidelity_small.QUICK)}, 1 round of 3 steps, quick "
                             f"profiles in a scratch folder, emulated P=8 with megatron and mpipe-rr, no waiting")
    parser.add_argument("--quiet-below", type=float, default=0.05,
                        help="keep a measurement (the profile, each plan's run) only when other jobs took less than "
                             "this share of the CPU during it, and wait for such a spell before each (default 0.05)")
    parser.add_argument("--max-wait", type=float, default=600.0, help="give up waiting for a quiet spell after this")
    parser.add_argument("--max-tries", type=int, default=4, help="runs of one measurement before keeping a noisy one")
    parser.add_argument("--json", default=None, help="write the full record here")
    parser.add_argument("--plot", default=None, help="write the predicted-vs-measured plot here (PNG)")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="measure nothing: compute the figures, print the tables and draw --plot from a record "
                             "written by --json")
    args = parser.parse_args(argv)
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        if any("runs" not in r for r in record.get("plans", [{}])):
            raise SystemExit(f"{args.replot}: a record without every run's raw steps and probes (written before "
                             f"issue 14's probes); measure it again: python benchmarks/bench_fidelity.py --json ...")
        if args.plot:
            plot(record, args.plot)
        print_table(record)
        return 0
    if args.quick:
        args.rounds, args.steps, args.emulated_steps, args.max_wait, args.max_tries = args.rounds or 1, 3, 2, 0.0, 1
    args.rounds = args.rounds or 3

    from mpipe_tune.runtime import disable_backend_autoload

    disable_backend_autoload()
    import torch

    base = load_model(str(MODEL_PATH))
    every = {"main": plan_specs(base), "small": small_specs(), "zero": zero_specs()}
    every["all"] = every["main"] + every["small"] + every["zero"]
    specs = [s for s in every[args.set] if not args.quick or s.label in QUICK + fidelity_small.QUICK]
    if args.only:
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        specs = [s for s in specs if any(w in s.label for w in words)]
        if not specs:
            raise SystemExit(f"--only {args.only!r}: no plan's label contains it; labels: "
                             f"{', '.join(s.label for s in every[args.set])}")
    started_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        profiles_dir = (Path(args.profiles) if args.profiles else Path(args.profile_dir) if args.profile_dir
                        else folder if args.quick else PROFILE_DIR)
        profiles_dir.mkdir(parents=True, exist_ok=True)
        conditions: dict = {"profiles": [], "load_average_before": os.getloadavg()}
        worlds = sorted({s.world for s in specs})

        def measure_profiles(where: Path, label: str) -> dict[int, Path]:
            where.mkdir(parents=True, exist_ok=True)
            for world in worlds:
                for _ in range(args.max_tries):
                    before, waited = wait_for_quiet(args.quiet_below, args.max_wait)
                    measured = measure_profile(profile_path(world, where), world, args.quick)
                    conditions["profiles"].append({"round": label, "foreign_before": before, "waited_s": waited,
                                                   **measured})
                    if measured["foreign_cpu_share"] < args.quiet_below:
                        break
            return {world: profile_path(world, where) for world in worlds}

        if not args.profiles:
            measure_profiles(profiles_dir, "first")
        profiles = {world: profile_path(world, profiles_dir) for world in worlds}
        plans = make_plans(folder, specs, profiles)
        # The emulated runs go first: they are short, and a failure there must not cost the real runs.
        emulated = {} if args.no_emulated else emulated_rows(
            folder, EMULATED_PPS[:1] if args.quick else EMULATED_PPS,
            ("megatron", "mpipe-rr") if args.quick else EMULATED_BASELINES, args.emulated_steps)
        runs: list[list[dict]] = [[] for _ in plans]
        started = time.perf_counter()
        from mpipe_tune.profiler import profile_probe_s

        for r in range(args.rounds):
            if args.reprofile:  # this round's runs are predicted on profiles measured right before it
                paths = profiles if r == 0 else measure_profiles(folder / f"round{r}", str(r))
                loaded = {world: load_profile(path) for world, path in paths.items()}
                loaded_probes = {world: profile_probe_s(p, PROBE_TOKENS) for world, p in loaded.items()}
            order = range(len(plans)) if r % 2 == 0 else reversed(range(len(plans)))
            for i in order:
                spec, path, _, _ = plans[i]
                result, tries = quiet_run(path, args.steps, spec.world, args.quiet_below, args.max_wait, args.max_tries)
                runs[i].append(run_record(result, tries, spec.world))
                if args.reprofile:
                    runs[i][-1]["predicted_s"] = predict_spec(spec, loaded[spec.world])[0].timeline.makespan_s
                    runs[i][-1]["roofline_s"] = roofline_s(spec, loaded[spec.world])
                    runs[i][-1]["profile_probe_s"] = loaded_probes[spec.world]
            print(f"round {r} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        conditions["runs_wall_s"] = time.perf_counter() - started
        conditions["load_average_after"] = os.getloadavg()
        probes = {world: profile_probe_s(load_profile(path), PROBE_TOKENS) for world, path in profiles.items()}
        share = encoder_share(load_profile(profiles[P])) if P in profiles else None
        profile_files = {world: os.path.relpath(path, HERE.parent) if not args.quick else path.name
                         for world, path in profiles.items()}
    rows = [{
        "label": spec.label, "schedule": spec.schedule, "microbatches": spec.num_microbatches, "tp": spec.tp,
        "dp": spec.dp, "world": spec.world, "frozen_encoder": spec.frozen, "slabs": record["candidate"]["slabs"],
        "owners": record["candidate"]["owners"], "profile": str(profile_files[spec.world]),
        "predicted_s": record["predicted"]["makespan_s"], "profile_probe_s": probes[spec.world], "runs": plan_runs,
        "set": spec.group, "model": os.path.relpath(spec.model, HERE.parent), "roofline_s": roofline,
    } for (spec, _path, record, roofline), plan_runs in zip(plans, runs)]
    record = {
        "command": "python benchmarks/bench_fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(), "started": started_at,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "model": str(MODEL_PATH.relative_to(HERE.parent)), "pp": P, "steps": args.steps, "rounds": args.rounds,
        "probe_tokens": PROBE_TOKENS, "conditions": conditions, "plans": rows, "emulated": emulated,
        "encoder_share": share,
    }
    record["figures"] = {k: v for k, v in summarize_record(record).items()
                         if k not in ("measured_s", "predicted_s", "corrected_s", "roofline_s")}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        plot(record, args.plot)
    print_table(record)
    return 0


# ------------------------------------------------------------------------------------------ tables


def plans_frame(record: dict) -> pd.DataFrame:
    """One row per plan: predicted, probe-corrected and measured step time (s), both errors, the
    per-run medians (s) and the probe factors."""
    summary = summarize_record(record)
    return pd.DataFrame.from_records([{
        "plan": r["label"], "world": r["world"], "predicted_s": p, "measured_s": m,
        "error": p / m - 1, "corrected_s": c, "corrected_error": c / m - 1,
        "run_medians_s": [statistics.median(run["step_times_s"][1:]) for run in r["runs"]],
        "probe_factors": [run_probe_factor(r, run) for run in r["runs"]],
        "roofline_s": f, "roofline_error": f / m - 1,
    } for r, p, m, c, f in zip(record["plans"], summary["predicted_s"], summary["measured_s"], summary["corrected_s"],
                               summary["roofline_s"])])


def figures_frame(record: dict) -> pd.DataFrame:
    """One row per prediction: MAPE, max abs and mean error, Kendall's tau, best gap (plain ratios)."""
    summary = summarize_record(record)
    names = {"raw": "real compute, the profile's prediction",
             "probe_corrected": "real compute, probe-corrected",
             "roofline": "real compute, the roofline alone",
             "small_raw": "small set, the profile's prediction",
             "small_probe_corrected": "small set, probe-corrected",
             "small_roofline": "small set, the roofline alone",
             "zero_raw": "ZeRO set, the profile's prediction",
             "zero_probe_corrected": "ZeRO set, probe-corrected",
             "zero_roofline": "ZeRO set, the roofline alone",
             **{f"emulated_P{pp}": f"emulated compute, P={pp} baselines" for pp in record.get("emulated", {})}}
    return pd.DataFrame.from_records([{"prediction": name, "plans": _count(record, key), **summary[key]}
                                      for key, name in names.items() if key in summary])


def _count(record: dict, key: str) -> int:
    if key.startswith("emulated"):
        return len(record["emulated"][key.removeprefix("emulated_P")])
    group = next((name for prefix, name in SETS.items() if prefix and key.startswith(prefix)), "main")
    return sum(r.get("set", "main") == group for r in record["plans"])


def _list(key: str, fmt):
    return lambda r: ", ".join(fmt(v) for v in r[key])


PLAN_COLUMNS = (
    Column("#", lambda r: str(r.name), ">"),
    Column("plan", lambda r: f"`{r['plan']}`"),
    Column("ranks", text("world"), ">"),
    Column("predicted ms", ms("predicted_s", ".1f"), ">"),
    Column("measured ms", ms("measured_s", ".1f"), ">"),
    Column("error", text("error", "+.1%"), ">"),
    Column("probe-corrected ms", ms("corrected_s", ".1f"), ">"),
    Column("corrected error", text("corrected_error", "+.1%"), ">"),
    Column("measured per run ms", _list("run_medians_s", lambda v: f"{v * 1e3:.0f}")),
    Column("probe factor per run", _list("probe_factors", lambda v: f"{v:.3f}")),
    Column("roofline alone ms", ms("roofline_s", ".1f"), ">"),
    Column("roofline error", text("roofline_error", "+.1%"), ">"),
)
FIGURE_COLUMNS = (
    Column("prediction", text("prediction")),
    Column("plans", text("plans"), ">"),
    Column("MAPE", text("mape", ".1%"), ">"),
    Column("max abs error", text("max_abs_error", ".1%"), ">"),
    Column("mean error", text("mean_error", "+.1%"), ">"),
    Column("Kendall tau", text("kendall_tau", ".3f"), ">"),
    Column("best gap", text("best_gap", ".1%"), ">"),
)


def emulated_frame(record: dict) -> pd.DataFrame:
    return pd.DataFrame.from_records([{
        "pp": int(pp), "plan": r["label"], "predicted_s": r["predicted_s"], "measured_s": measured_s(r["runs"]),
        "error": r["predicted_s"] / measured_s(r["runs"]) - 1,
    } for pp, rows in record.get("emulated", {}).items() for r in rows])


EMULATED_COLUMNS = (
    Column("P", text("pp"), ">"),
    Column("plan", text("plan")),
    Column("predicted ms", ms("predicted_s", ".1f"), ">"),
    Column("measured ms", ms("measured_s", ".1f"), ">"),
    Column("error", text("error", "+.1%"), ">"),
)


def print_table(record: dict) -> None:
    print(format_markdown(plans_frame(record), PLAN_COLUMNS))
    print()
    if record.get("emulated"):
        print(format_markdown(emulated_frame(record), EMULATED_COLUMNS))
        print()
    print(format_markdown(figures_frame(record), FIGURE_COLUMNS))
    kept = [t[-1]["foreign_during"] for r in record["plans"] for run in r["runs"] for t in [run["tries"]]]
    retried = sum(len(run["tries"]) - 1 for r in record["plans"] for run in r["runs"])
    conditions = record["conditions"]
    print(f"\nother jobs' CPU share during the kept runs: median {statistics.median(kept):.1%}, max {max(kept):.1%} "
          f"({retried} runs repeated for noise); load average before {conditions['load_average_before']}, after "
          f"{conditions['load_average_after']}; runs {conditions['runs_wall_s']:.0f} s; profiles: {conditions['profiles']}")


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize_record(record)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
    measured_all = np.array(summary["measured_s"]) * 1e3
    sets = np.array([r.get("set", "main") for r in record["plans"]])
    series = [(f"{name}: {label}", sets == name, np.array(summary[values]) * 1e3, marker, colour, summary[key])
              for key, name, label, values, marker, colour in (
                  ("raw", "main", "the profile's prediction", "predicted_s", "o", "C0"),
                  ("probe_corrected", "main", "probe-corrected", "corrected_s", "s", "C2"),
                  ("small_raw", "small", "the profile's prediction", "predicted_s", "^", "C1"),
                  ("small_roofline", "small", "the roofline alone", "roofline_s", "v", "C3"),
                  ("zero_raw", "zero", "the profile's prediction", "predicted_s", "D", "C4"))
              if key in summary]
    ax = axes[0]
    everything = np.concatenate([measured_all, *(predicted[chosen] for _, chosen, predicted, *_ in series)])
    lo, hi = everything.min() * 0.9, everything.max() * 1.1
    grid = np.array([lo, hi])
    ax.fill_between(grid, grid * 0.95, grid * 1.05, color="0.9", label="±5%")
    ax.plot(grid, grid, color="0.5", lw=1)
    for label, chosen, predicted, marker, colour, f in series:
        ax.scatter(measured_all[chosen], predicted[chosen], marker=marker, color=colour,
                   facecolors="none" if marker == "s" else colour,
                   label=f"{label}: MAPE {f['mape']:.1%}, tau {f['kendall_tau']:.2f}, best gap {f['best_gap']:.1%}")
    for i, (m, p) in enumerate(zip(measured_all, np.array(summary["predicted_s"]) * 1e3)):
        ax.annotate(str(i), (m, p), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if len(series) > 2:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    worlds = sorted({r["world"] for r in record["plans"]})
    ranks = f"{worlds[0]} ranks" if len(worlds) == 1 else f"{worlds[0]}-{worlds[-1]} ranks"
    ax.set_title(f"{len(record['plans'])} plans ({ranks}), real compute on CPU/gloo")
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[1]
    emulated = emulated_frame(record)
    if len(emulated):
        values = np.concatenate([emulated["measured_s"], emulated["predicted_s"]]) * 1e3
        grid = np.array([values.min() * 0.9, values.max() * 1.1])
        ax.fill_between(grid, grid * 0.95, grid * 1.05, color="0.9", label="±5%")
        ax.plot(grid, grid, color="0.5", lw=1)
        for k, (pp, group) in enumerate(emulated.groupby("pp")):
            f = summary[f"emulated_P{pp}"]
            ax.scatter(group["measured_s"] * 1e3, group["predicted_s"] * 1e3, color=f"C{k + 3}",
                       label=f"P={pp}: MAPE {f['mape']:.1%}, tau {f['kendall_tau']:.2f}")
            for _, row in group.iterrows():
                ax.annotate(row["plan"], (row["measured_s"] * 1e3, row["predicted_s"] * 1e3), textcoords="offset points",
                            xytext=(4, 3), fontsize=7)
        ax.set_xlim(*grid)
        ax.set_ylim(*grid)
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("baseline set, emulated compute (qwen2vl-vit-llama3-8b, h100-sxm)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
