"""Zero-bubble skeletons (zb1p, zbv) against 1F1B and interleaved 1F1B, predicted by the cost model.

Two parts:

- ``ideal``: a model of explicit-cost layers whose forward, input gradient and weight gradient each
  take 1 s per layer (tf = tb = tw), on the ``ideal`` profile (free communication), four layers per
  rank (after a costless first layer: the model's first layer computes no input gradient). Reported per schedule: the step in units of a rank's whole forward work of one microbatch
  (``t``, four layer-seconds), the bubble share (``1 - mean busy / step``) beside its closed form, and
  the peak of live activations in microbatches of a rank's whole slab (every layer saving one unit).
- ``h100``: ``qwen2vl-vit-llama3-8b`` (trainable ViT and backbone) on ``h100-sxm``, tp 4, the
  ``balanced`` mix, one sequence per microbatch, mean over 3 sampled steps: Megatron-LM's even layout
  (encoder in stage 0) under 1f1b, then with the planner's slabs balanced by expected cost 1f1b and
  zb1p, the VPP cut (mid-backbone) under 1f1b,1f1b / zb1p,zb1p / zbv,zbv, and the transpose under
  transpose,1f1b / transpose,zb1p / transpose,zbv,zbv. Step time, its ratio to balanced 1f1b's, the
  bubble share and the largest per-rank peak memory (with its fit in the profile's 80 GB).

    PYTHONPATH=. python benchmarks/bench_zero_bubble.py [ideal|h100|all]
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import replace

import numpy as np

from mpipe_tune.algebra import ExplicitCost, Layer, Model, Candidate
from mpipe_tune.cost import CompiledPlan, CostOptions, predict
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.search import Evaluator, Problem, baseline
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

LAYERS_PER_RANK = 4


def closed_form_bubble(schedule: str, P: int, M: int) -> str:
    """The bubble share theory gives on equal parts (tf = tb = tw = t for a rank's whole slab), each
    rank idling ``I`` of a step of ``3M t + I``: 1F1B ``I = 3(P-1)t``; interleaving in two chunks halves
    it; ZB-H1 (Qi et al. 2024, ZB1P) ``(P-1)(tf + tb - tw) = (P-1)t``, the authors' bubble rate
    ``(P-1)/3M``; with two chunks, and for ZB-V, the last rank's unavoidable wait for the ``P-1``
    chunk forwards before its first, ``(P-1)t/2`` (the authors count ZB-V's rate as 0). The step
    cannot be shorter than ``3M t`` plus that wait, so a zero-bubble schedule is this lower bound."""
    idle = {"1f1b": 3 * (P - 1), "1f1b,1f1b": 1.5 * (P - 1), "zb1p": P - 1, "zb1p,zb1p": (P - 1) / 2,
            "zbv,zbv": (P - 1) / 2}[schedule]
    return f"{idle / (3 * M + idle):.3f}"


def equal_parts(P: int, M: int, schedule: str) -> Candidate:
    """``LAYERS_PER_RANK`` unit layers per rank after a costless input layer (so that the first stage
    computes its input gradient too: the model's first layer has none), split evenly over the chunks."""
    v = len(schedule.split(","))
    per_chunk = LAYERS_PER_RANK // v
    cut = tuple(1 + per_chunk * P * j for j in range(1, v))
    slabs = ((per_chunk + 1,) + (per_chunk,) * (P - 1),) + ((per_chunk,) * P,) * (v - 1)
    return Candidate(schedule, cut, P, 1, 1, M, slab_counts=slabs)


def ideal_part() -> None:
    profile = load_profile("ideal")
    print("| P | M | schedule | step / (3M t) | bubble share | closed form | peak activations (microbatches) |")
    print("|---|---|---|---|---|---|---|")
    for P in (4, 8):
        model = Model("equal-parts", (Layer("input", "llm", True, ExplicitCost(0.0, 0.0)),) + tuple(
            Layer(f"layer{i}", "llm", True, ExplicitCost(1.0, 2.0)) for i in range(LAYERS_PER_RANK * P)))
        for M in (P, 2 * P, 4 * P, 8 * P):
            workload = Workload(tuple(Microbatch(0, 1) for _ in range(M)), "uniform")
            for schedule in ("1f1b", "1f1b,1f1b", "zb1p", "zb1p,zb1p", "zbv,zbv"):
                prediction = predict(equal_parts(P, M, schedule), model, workload, profile, CostOptions())
                t = prediction.timeline
                step = t.makespan_s / (3 * M * LAYERS_PER_RANK)
                bubble = 1 - float(np.mean(t.busy_s)) / t.makespan_s
                unit = np.ones_like(prediction.table.fwd_s)
                unit[0] = 0.0  # the costless input layer keeps nothing
                table = replace(prediction.table, saved_bytes=unit, wgrad_kept_bytes=np.zeros_like(unit))
                compiled = CompiledPlan(prediction.plan, model, profile, prediction.options)
                peak = max(compiled.memory(table, t).activation_peak_bytes) / LAYERS_PER_RANK
                print(f"| {P} | {M} | {schedule} | {step:.3f} | {bubble:.3f} | {closed_form_bubble(schedule, P, M)} "
                      f"| {peak:.2f} |")


def h100_part() -> None:
    model, profile = load_model("qwen2vl-vit-llama3-8b"), load_profile("h100-sxm")
    pre, tp = model.backbone_start, 4
    print("| P x tp | M | schedule | slabs | step (ms) | vs 1f1b | bubble share | peak GiB (max rank) | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for P, M in ((4, 16), (4, 32), (8, 32), (8, 64)):
        evaluator = Evaluator(Problem(model, profile, P * tp, M, mix="balanced", num_samples=3, seed=7))
        mid = baseline("vpp", model, P, tp, 1, M, vpp_microbatches=(M,)).cut[0]
        candidates = [("even, encoder in stage 0", baseline("megatron", model, P, tp, 1, M))]
        for schedule, cut in (("1f1b", ()), ("zb1p", ()), ("1f1b,1f1b", (mid,)), ("zb1p,zb1p", (mid,)),
                              ("zbv,zbv", (mid,)), ("transpose,1f1b", (pre,)), ("transpose,zb1p", (pre,)),
                              ("transpose,zbv,zbv", (pre, mid))):
            owners = "round-robin" if schedule.startswith("transpose") else None
            candidates.append(("balanced", Candidate(schedule, cut, P, tp, 1, M, owners)))
        reference = None
        for slabs, c in candidates:
            e = evaluator.evaluate(c)
            if c.schedule == "1f1b" and slabs == "balanced":
                reference = e.mean_s
            ratio = f"{reference / e.mean_s:.3f}" if reference else "-"
            print(f"| {P} x {tp} | {M} | {c.schedule} | {slabs} | {e.mean_s * 1e3:.1f} | {ratio} "
                  f"| {e.bubble_share:.3f} | {e.peak_bytes / 2**30:.1f} | {'yes' if e.fits else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="all", choices=("ideal", "h100", "all"))
    args = parser.parse_args()
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}\n")
    start = time.perf_counter()
    if args.part in ("ideal", "all"):
        ideal_part()
        print()
    if args.part in ("h100", "all"):
        h100_part()
    print(f"\ntime: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
