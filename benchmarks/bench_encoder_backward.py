"""Trainable-encoder ``<transpose,1f1b>`` with each encoder backward placement, against the baselines.

For each configuration (model, profile, workload mix, P = devices with tp = dp = 1, M = 2P, with and
without full recomputation) the cost model predicts, averaged over 4 sampled steps (seeds 0-3):

- ``megatron``: ``<1f1b>`` with the encoder in the first stage; ``disttrain``: the encoder on its own
  stage (:mod:`mpipe_tune.search.baselines`);
- ``<transpose,1f1b>`` with round-robin owners (the ``mpipe-rr`` baseline) under each encoder
  backward placement: ``cooldown`` (the order before the choice existed), ``earliest`` (unit-time
  steps) and ``optimised`` (slots chosen with the cost model on each sampled step).

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

from mpipe_tune.algebra.encoder_backward import PLACEMENTS
from mpipe_tune.search.baselines import baseline
from mpipe_tune.search.evaluate import Evaluator
from mpipe_tune.search.problem import Problem
from mpipe_tune.specs import load_model, load_profile

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
        out.append({"model": model_name, "profile": profile, "mix": mix, "P": P, "M": M,
                    "recompute": "full" if recompute else "off", "plan": name, "mean_s": e.mean_s,
                    "steps_s": list(e.makespans_s), "peak_gib": e.peak_bytes / 2**30, "fits": e.fits,
                    "evaluate_s": time.perf_counter() - start})
    ref = {r["plan"]: r["mean_s"] for r in out}
    for r in out:
        r["vs_megatron"] = ref["megatron"] / r["mean_s"]
        r["vs_disttrain"] = ref["disttrain"] / r["mean_s"]
        r["vs_cooldown"] = ref["transpose cooldown"] / r["mean_s"]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model / profile / mix | P | M | recompute | plan | step ms | vs megatron | vs disttrain | vs cooldown "
             "| peak GiB | evaluate s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} / {r['profile']} / {r['mix']} | {r['P']} | {r['M']} | {r['recompute']} | "
                     f"{r['plan']} | {r['mean_s'] * 1e3:,.1f} | {r['vs_megatron']:.3f}x | {r['vs_disttrain']:.3f}x | "
                     f"{r['vs_cooldown']:.3f}x | {r['peak_gib']:.1f}{'' if r['fits'] else ' (over)'} | "
                     f"{r['evaluate_s']:.2f} |")
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
