"""Trainable-encoder ``<transpose,1f1b>`` with each encoder backward placement, against the baselines.

For each configuration (model, profile, workload mix, P = devices with tp = dp = 1, M = 2P, with and
without full recomputation) the cost model predicts, averaged over 4 sampled steps (seeds 0-3):

- ``megatron``: ``<1f1b>`` with the encoder in the first stage; ``disttrain``: the encoder on its own
  stage (:mod:`mpipe_tune.search._baselines`);
- ``<transpose,1f1b>`` with round-robin owners (the ``mpipe-rr`` baseline) under each encoder
  backward placement: ``cooldown`` (the order before the choice existed), ``earliest`` (unit-time
  steps) and ``optimised`` (slots chosen with the cost model on each sampled step; under full
  recomputation it also moves encoder backwards to other ranks);
- under full recomputation, ``optimised owners-only``: the same search with every encoder backward
  kept on its owner (``optimise(..., other_ranks=False)`` on the evaluator's own compiled plan and
  layer table of each step), so the two ``optimised`` rows differ only in the moves; ``moved`` is the
  mean number of encoder backwards per step that ``optimised`` ran off their owners.

Every figure is the cost model's prediction through the search's evaluator, the same numbers
``mpipe-tune plan`` ranks by; nothing is tuned toward a target.

    python benchmarks/bench_encoder_backward.py           # the markdown tables
    python benchmarks/bench_encoder_backward.py --json    # the same rows as JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace

import numpy as np

from mpipe_tune.algebra import OPTIMISED, PLACEMENTS, moved_count
from mpipe_tune.cost import optimise
from mpipe_tune.search import baseline, Evaluator, Problem
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

CONFIGS = [("qwen2vl-vit-llama3-8b", "h100-sxm", "balanced", P) for P in (4, 8, 16)] + [
    ("qwen2vl-vit-llama3-8b", "h100-sxm", "image-heavy", P) for P in (4, 8, 16)] + [
    ("qwen2vl-vit-qwen2-7b", "h100-sxm", "balanced", 8), ("qwen2vl-vit-llama3-8b", "ideal", "balanced", 8)]
SAMPLES = 4


def rows_of(model_name: str, profile: str, mix: str, P: int, recompute: bool) -> list[dict]:
    M = 2 * P
    problem = Problem(load_model(model_name), load_profile(profile), P, M, mix=mix, num_samples=SAMPLES, seed=0)
    evaluator = Evaluator(problem)
    plans = {name: baseline(name, problem.model, P, 1, 1, M) for name in ("megatron", "disttrain")}
    rr = baseline("mpipe-rr", problem.model, P, 1, 1, M)
    plans.update({f"transpose {p}": replace(rr, encoder_backward=p) for p in PLACEMENTS})
    out = []
    for name, c in plans.items():
        c = replace(c, recompute=recompute)
        start = time.perf_counter()
        e = evaluator.evaluate(c)
        moved = [_moved(evaluator, c, k) for k in range(SAMPLES)] if c.encoder_backward == OPTIMISED else [0]
        out.append({"model": model_name, "profile": profile, "mix": mix, "P": P, "M": M,
                    "recompute": "full" if recompute else "off", "plan": name, "mean_s": e.mean_s,
                    "steps_s": list(e.makespans_s), "peak_gib": e.peak_bytes / 2**30, "fits": e.fits,
                    "evaluate_s": time.perf_counter() - start, "moved": float(np.mean(moved))})
        if recompute and c.encoder_backward == OPTIMISED:
            out.append(_owners_only(evaluator, c, out[-1]))
    ref = {r["plan"]: r["mean_s"] for r in out}
    for r in out:
        r["vs_megatron"] = ref["megatron"] / r["mean_s"]
        r["vs_disttrain"] = ref["disttrain"] / r["mean_s"]
        r["vs_cooldown"] = ref["transpose cooldown"] / r["mean_s"]
        r["vs_owners_only"] = ref.get("transpose optimised owners-only", ref["transpose optimised"]) / r["mean_s"]
    return out


def _moved(evaluator: Evaluator, c, sample: int) -> int:
    """How many encoder backwards ``c``'s optimised placement ran off their owners on step ``sample``."""
    choice = evaluator.encoder_backward_choice(c, sample)
    owners = evaluator.owners(c, sample)
    return 0 if choice is None else moved_count(choice.ranks, owners)


def _owners_only(evaluator: Evaluator, c, moved_row: dict) -> dict:
    """The row of ``c``'s optimised placement with every encoder backward on its owner, step by step on
    the evaluator's compiled plan and layer tables (round-robin owners: derive's own map)."""
    start = time.perf_counter()
    compiled = evaluator.compiled(c, evaluator.slab_counts(c))
    steps, peaks = [], []
    for sample in range(SAMPLES):
        _, table = evaluator.table(sample, c)
        placed = compiled.with_encoder_backward(optimise(compiled, table, other_ranks=False).slots)
        timeline = placed.timeline(table)
        steps.append(timeline.makespan_s)
        peaks.append(max(placed.memory(table, timeline).peak_bytes))
    capacity = evaluator.problem.profile.memory_capacity_bytes
    return dict(moved_row, plan="transpose optimised owners-only", mean_s=float(np.mean(steps)), steps_s=steps,
                peak_gib=max(peaks) / 2**30, fits=max(peaks) <= capacity, evaluate_s=time.perf_counter() - start,
                moved=0.0)


def table(rows: list[dict]) -> str:
    lines = ["| model / profile / mix | P | M | recompute | plan | step ms | vs megatron | vs disttrain | vs cooldown "
             "| vs owners-only optimised | moved per step | peak GiB | evaluate s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} / {r['profile']} / {r['mix']} | {r['P']} | {r['M']} | {r['recompute']} | "
                     f"{r['plan']} | {r['mean_s'] * 1e3:,.1f} | {r['vs_megatron']:.3f}x | {r['vs_disttrain']:.3f}x | "
                     f"{r['vs_cooldown']:.3f}x | {r['vs_owners_only']:.3f}x | {r['moved']:.2f} | "
                     f"{r['peak_gib']:.1f}{'' if r['fits'] else ' (over)'} | {r['evaluate_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = [r for model, profile, mix, P in CONFIGS for recompute in (False, True)
            for r in rows_of(model, profile, mix, P, recompute)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"python {platform.python_version()}, numpy {np.__version__}; {SAMPLES} sampled steps (seeds 0-3), bf16, "
          f"tp = dp = 1, round-robin owners\n")
    print(table(rows))


if __name__ == "__main__":
    main()
