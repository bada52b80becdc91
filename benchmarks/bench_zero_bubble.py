"""Zero-bubble skeletons (zb1p, zbv) against 1F1B and interleaved 1F1B, predicted by the cost model.

Two parts:

- ``ideal``: a model of explicit-cost layers whose forward, input gradient and weight gradient each
  take 1 s per layer (tf = tb = tw), on the ``ideal`` profile (free communication), four layers per
  rank. Reported per schedule: the step in units of a rank's whole forward work of one microbatch
  (``t``, four layer-seconds), the bubble share (``1 - mean busy / step``) beside its closed form, and
  the peak of live activations in microbatches of a rank's whole slab (every layer saving one unit).
- ``h100``: ``qwen2vl-vit-llama3-8b`` (trainable ViT and backbone) on ``h100-sxm``, the ``balanced``
  mix, two sequences per microbatch, mean over sampled steps: Megatron-LM's layout (encoder in stage 0)
  under 1f1b and zb1p, the VPP cut under 1f1b,1f1b / zb1p,zb1p / zbv,zbv, and the transpose under
  transpose,1f1b / transpose,zb1p / transpose,zbv,zbv. Step time, its ratio to 1f1b's, the bubble
  share and the largest per-rank peak memory.

    python benchmarks/bench_zero_bubble.py [ideal|h100|all]
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import replace

import numpy as np

from mpipe_tune.algebra import Cut, ExplicitCost, Layer, Model, parse_schedule
from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.cost.compiled import CompiledPlan
from mpipe_tune.cost.layers import CostOptions
from mpipe_tune.cost.predict import predict
from mpipe_tune.inputs.workload import Microbatch, Workload
from mpipe_tune.search import Evaluator, Problem
from mpipe_tune.search.baselines import baseline
from mpipe_tune.specs import load_model, load_profile

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


def ideal_part() -> None:
    profile = load_profile("ideal")
    print("| P | M | schedule | step / (3M t) | bubble share | closed form | peak activations (microbatches) |")
    print("|---|---|---|---|---|---|---|")
    for P in (4, 8):
        model = Model("equal-parts", tuple(Layer(f"layer{i}", "llm", True, ExplicitCost(1.0, 2.0))
                                           for i in range(LAYERS_PER_RANK * P)))
        half = Cut((LAYERS_PER_RANK * P // 2,))
        for M in (P, 2 * P, 4 * P, 8 * P):
            workload = Workload(tuple(Microbatch(0, 1) for _ in range(M)), "uniform")
            for schedule, cut in (("1f1b", Cut(())), ("1f1b,1f1b", half), ("zb1p", Cut(())), ("zb1p,zb1p", half),
                                  ("zbv,zbv", half)):
                c = Candidate(schedule, cut.boundaries, P, 1, 1, M)
                prediction = predict(c, model, workload, profile, CostOptions())
                t = prediction.timeline
                step = t.makespan_s / (3 * M * LAYERS_PER_RANK)
                bubble = 1 - float(np.mean(t.busy_s)) / t.makespan_s
                table = replace(prediction.table, saved_bytes=np.ones_like(prediction.table.fwd_s),
                                wgrad_kept_bytes=np.zeros_like(prediction.table.fwd_s))
                compiled = CompiledPlan(prediction.plan, model, profile, prediction.options)
                peak = max(compiled.memory(table, t).activation_peak_bytes) / LAYERS_PER_RANK
                print(f"| {P} | {M} | {schedule} | {step:.3f} | {bubble:.3f} | {closed_form_bubble(schedule, P, M)} "
                      f"| {peak:.2f} |")


def h100_part() -> None:
    model, profile = load_model("qwen2vl-vit-llama3-8b"), load_profile("h100-sxm")
    pre = model.backbone_start
    print("| P | M | schedule | layout | step (ms) | vs 1f1b | bubble share | peak GiB (max rank) | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for P, M in ((4, 16), (8, 32), (8, 64)):
        evaluator = Evaluator(Problem(model, profile, P, 2 * M, mix="balanced", num_samples=3, seed=7))
        megatron = baseline("megatron", model, P, 1, 1, M)
        vpp = baseline("vpp", model, P, 1, 1, M, vpp_microbatches=(M,))
        mid = vpp.cut[0]
        candidates = [
            ("megatron", megatron), ("megatron", replace(megatron, schedule="zb1p")),
            ("vpp", vpp), ("vpp", replace(vpp, schedule="zb1p,zb1p")), ("vpp", replace(vpp, schedule="zbv,zbv")),
        ]
        for schedule in ("transpose,1f1b", "transpose,zb1p", "transpose,zbv,zbv"):
            cut = (pre,) if schedule.count(",") == 1 else (pre, mid)
            candidates.append(("transpose", Candidate(schedule, cut, P, 1, 1, M, "round-robin")))
        reference = None
        for layout, c in candidates:
            e = evaluator.evaluate(c)
            reference = reference or e.mean_s
            print(f"| {P} | {M} | {c.schedule} | {layout} | {e.mean_s * 1e3:.1f} | {reference / e.mean_s:.3f} "
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
