"""Fidelity of the expert-, context- and sequence-parallel charges: predicted against measured step time.

The tiny MoE model of the runtime tests (``tests/runtime/tiny-mla-moe.yaml``: GQA and MLA attention,
dense and MoE blocks, shared experts) on 4 gloo ranks of this machine, profiled for 4 ranks with its
layers calibrated (``--profile``, or measured first with ``mpipe-tune profile --nproc 4 --calibrate``):

- real compute: pp x dp x tp plans without and with expert parallelism (ep 2 and 4, carved from dp),
  where the executor dispatches and combines tokens by all-to-all and reduces the experts over their
  own data-parallel group; with context parallelism (ring attention passing keys and values round the
  cp ranks by point-to-point); with sequence parallelism (rows all-gathered into and reduce-scattered
  out of each tensor-parallel region); and with the encoder at tp 1 under tp 2 (encoder groups):
  measured beside the prediction that charges those all-to-alls, ring steps, collectives and gathers;
- ZeRO stages 1, 2 and 3 of the same plans (``zero1``/``zero2``/``zero3``; stage 3 at its default reshard
  policy, keeping the weights at pp 2 and resharding at pp 1, and at the other one): the sharded update
  and all-gather, and FSDP2's gathers and reduce-scatters, against the cost model's charges for them,
  whose overlap with compute the profile's measured ``comm_compute_overlap`` sets; and the same stages at
  dp 2 (with and without ep 2) on 2 ranks, a core each on a 2-core host where 4 ranks take turns on the cores,
  predicted on a 2-rank profile (``--profile-2``; ``--only zero`` runs the ZeRO cases alone);
- emulated compute: the same plans: every compute event sleeps its predicted seconds, so this
  measures the executor's realisation of the predicted schedule (transfers, waits, reduces).

Each plan runs ``--steps`` steps in one launch per plan and compute mode; measured = the median step
time over the steps after the first (warm-up), the slowest rank's. The error is measured / predicted - 1.
The record holds each run's CPU seconds (every rank's over its steps, summed: ``steps_cpu_s`` of the
run's summary) and the 1-minute load average before it: wall times taken on a shared host are not the
machine's.

    python benchmarks/bench_fidelity_parallel.py --profile benchmarks/profiles/moe-vm-4.json \
        --profile-2 benchmarks/profiles/moe-vm-2.json [--only zero] [--steps 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost import CostOptions, predict, load_profile
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.inputs import load_model

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE.parent / "tests" / "runtime" / "tiny-mla-moe.yaml"
WORLD = 4
OPTIONS = CostOptions(dtype="fp32", optimizer_bytes_per_param=0.0, grad_bytes_per_param=4.0, shard_optimizer=False,
                      overlap_dp_comm=False, flat_buffer_copies=True)
"""What the runtime does: fp32, plain SGD (no optimizer state), the data-parallel reduce after the last backward
(not overlapped), the gradients and a distributed optimizer's weights copied through flat buffers around it
(:func:`make_plan` sets the case's ZeRO stage)."""
WORKLOAD = Workload(tuple(Microbatch(image, text, (image,) if image else ())
                          for image, text in ((16, 96), (0, 128), (36, 80), (16, 112))), "parallel-fidelity")
"""Per replica, 4 microbatches of 80-128 text tokens, three with one image (16 or 36 backbone tokens)."""


@dataclass(frozen=True)
class Case:
    label: str
    schedule: str
    cut: tuple[int, ...]
    pp: int
    tp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    encoder_tp: int | None = None
    zero_stage: int = 0
    """0: every replica updates all its weights; 1: each its shard, then all-gathers (ZeRO-1); 2: FSDP2 with
    the weights kept through the step, gradients reduce-scattered every backward; 3: FSDP2's full sharding."""
    reshard_after_forward: bool | None = None
    """Stage 3's reshard policy; None: the default for the pipeline degree."""

    @property
    def world(self) -> int:
        """Its ranks: 4, or 2 for the ZeRO cases that give each rank a core of its own."""
        return self.pp * self.tp * self.dp * self.cp

FIRST_LLM = 5
CASES = (
    Case("pp2 dp2", "1f1b", (), 2, dp=2),
    Case("pp2 dp2 ep2", "1f1b", (), 2, dp=2, ep=2),
    Case("dp4", "1f1b", (), 1, dp=4),
    Case("dp4 ep2", "1f1b", (), 1, dp=4, ep=2),
    Case("dp4 ep4", "1f1b", (), 1, dp=4, ep=4),
    Case("tp2 dp2 ep2", "1f1b", (), 1, tp=2, dp=2, ep=2),
    Case("pp2 dp2 ep2 transpose", "transpose,1f1b", (FIRST_LLM,), 2, dp=2, ep=2),
    Case("pp2 cp2", "1f1b", (), 2, cp=2),
    Case("cp2 dp2 ep2", "1f1b", (), 1, dp=2, cp=2, ep=2),
    Case("cp4", "1f1b", (), 1, cp=4),
    Case("pp2 tp2 sp", "1f1b", (), 2, tp=2, sequence_parallel=True),
    Case("tp2 dp2 sp", "1f1b", (), 1, tp=2, dp=2, sequence_parallel=True),
    Case("tp2 cp2 sp", "1f1b", (), 1, tp=2, cp=2, sequence_parallel=True),
    Case("pp2 tp2 encoder tp1", "transpose,1f1b", (FIRST_LLM,), 2, tp=2, encoder_tp=1),
    Case("pp2 dp2 zero1", "1f1b", (), 2, dp=2, zero_stage=1),
    Case("pp2 dp2 zero2", "1f1b", (), 2, dp=2, zero_stage=2),
    Case("pp2 dp2 zero3", "1f1b", (), 2, dp=2, zero_stage=3),
    Case("pp2 dp2 zero3 reshard", "1f1b", (), 2, dp=2, zero_stage=3, reshard_after_forward=True),
    Case("dp4 ep2 zero1", "1f1b", (), 1, dp=4, ep=2, zero_stage=1),
    Case("dp4 ep2 zero2", "1f1b", (), 1, dp=4, ep=2, zero_stage=2),
    Case("dp4 ep2 zero3", "1f1b", (), 1, dp=4, ep=2, zero_stage=3),
    Case("dp4 ep2 zero3 keep", "1f1b", (), 1, dp=4, ep=2, zero_stage=3, reshard_after_forward=False),
    Case("dp2 zero1", "1f1b", (), 1, dp=2, zero_stage=1),
    Case("dp2 zero2", "1f1b", (), 1, dp=2, zero_stage=2),
    Case("dp2 zero3", "1f1b", (), 1, dp=2, zero_stage=3),
    Case("dp2 zero3 keep", "1f1b", (), 1, dp=2, zero_stage=3, reshard_after_forward=False),
    Case("dp2 ep2 zero3", "1f1b", (), 1, dp=2, ep=2, zero_stage=3),
    Case("dp2 ep2 zero3 keep", "1f1b", (), 1, dp=2, ep=2, zero_stage=3, reshard_after_forward=False),
)
ZERO_LABELS = tuple(c.label for c in CASES if c.zero_stage)
"""The ZeRO list (``--only zero``)."""


def make_plan(case: Case, profile_path: Path, folder: Path) -> Path:
    model, profile = load_model(str(MODEL_PATH)), load_profile(str(profile_path))
    candidate = Candidate(case.schedule, case.cut, pp=case.pp, tp=case.tp, dp=case.dp, num_microbatches=len(WORKLOAD),
                          owner_policy="round-robin" if "transpose" in case.schedule else None, dtype="fp32",
                          ep=case.ep, cp=case.cp, sequence_parallel=case.sequence_parallel, encoder_tp=case.encoder_tp,
                          zero_stage=case.zero_stage, reshard_after_forward=case.reshard_after_forward)
    options = replace(OPTIONS, shard_optimizer=case.zero_stage >= 1, shard_gradients=case.zero_stage == 2,
                      shard_parameters=case.zero_stage >= 3, reshard_after_forward=candidate.reshards_after_forward)
    prediction = predict(candidate, model, WORKLOAD, profile, options)
    path = folder / (case.label.replace(" ", "-") + ".json")
    dump_plan(plan_record(prediction, model, WORKLOAD, profile, PlanInputs(str(MODEL_PATH), (), str(profile_path))),
              path)
    return path


def run(path: Path, compute: str, steps: int) -> tuple[dict, float]:
    """One ``mpipe-tune run`` of the plan (its own launch): its ``--json`` summary and the CPU seconds
    its ranks spent over their steps, summed."""
    command = [sys.executable, "-m", "mpipe_tune.cli", "run", str(path), "--compute", compute, "--steps", str(steps),
               "--json", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{path.name} ({compute}) failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout)
    return result, sum(result["steps_cpu_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a profile of this machine for 4 ranks, calibrated on the model")
    parser.add_argument("--profile-2", default=None, metavar="PROFILE",
                        help="the same for 2 ranks (a core each on this 2-core machine), for the 2-rank ZeRO cases")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", default=None,
                        help="comma-separated case labels, or 'zero' for the ZeRO cases")
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    wanted = ZERO_LABELS if args.only == "zero" else None if args.only is None else tuple(args.only.split(","))
    cases = [c for c in CASES if wanted is None or c.label in wanted]
    unknown = sorted(set(wanted or ()) - {c.label for c in CASES})
    if unknown:
        parser.error(f"--only: no case {', '.join(map(repr, unknown))}; labels: {', '.join(c.label for c in CASES)}")
    profiles = {4: args.profile, 2: args.profile_2}
    if any(profiles[c.world] is None for c in cases):
        parser.error("the 2-rank cases need --profile-2 (mpipe-tune profile --device cpu --nproc 2 --calibrate "
                         "tests/runtime/tiny-mla-moe.yaml), or leave them out with --only")
    rows = []
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
              "profile": args.profile, "profile_2": args.profile_2, "steps": args.steps, "rows": rows}
    with tempfile.TemporaryDirectory(prefix="parallel-fidelity-") as folder:
        for case in cases:
            path = make_plan(case, Path(profiles[case.world]), Path(folder))
            for compute in ("real", "emulated"):
                load = os.getloadavg()[0]
                result, cpu_s = run(path, compute, args.steps)
                row = {"plan": case.label, "ranks": case.world, "compute": compute,
                       "predicted_ms": result["predicted_step_s"] * 1e3,
                       "measured_ms": result["measured_step_s"] * 1e3,
                       "step_times_ms": [t * 1e3 for t in result["step_times_s"]], "cpu_s": cpu_s, "load_1min": load}
                row["error"] = row["measured_ms"] / row["predicted_ms"] - 1.0
                rows.append(row)
                print(f"{case.label:24s} {compute:9s} predicted {row['predicted_ms']:8.2f} ms  measured "
                      f"{row['measured_ms']:8.2f} ms  error {row['error']:+7.1%}  (cpu {cpu_s:6.1f} s, load "
                      f"{load:.1f})", flush=True)
                if args.json:  # after every row: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    for compute in ("real", "emulated"):
        errors = [abs(r["error"]) for r in rows if r["compute"] == compute]
        if errors:
            print(f"{compute}: MAPE {statistics.mean(errors):.1%} over {len(errors)} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
