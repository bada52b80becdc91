"""What interior and sink transposes predict: the output head transposed as a sink region.

``qwen2vl-vit-llama3-8b-head`` (benchmarks/models: the built-in qwen2vl-vit-llama3-8b with its
128k-vocabulary output head in a block of its own) on the h100-sxm profile, bf16, the balanced mix,
one pipeline (pp devices, tp = dp = 1), M microbatches, 4 sampled steps per plan. Schedules:

- ``1f1b``: the encoder inside the first stage and the head inside the last (Megatron-LM style);
- ``transpose,1f1b``: the encoder transposed (Mpipe);
- ``1f1b,transpose``: the head transposed as a sink, each microbatch's head, loss and head backward on its owner;
- ``transpose,1f1b,transpose``: both, one owner map for the two;
- ``gpipe``, ``gpipe,transpose``, ``transpose,gpipe``, ``transpose,gpipe,transpose``: the same under GPipe, whose last stage
  runs every forward before any backward (so a head's round trip to its owner is off its path).

Slabs are the balanced partition of each Sharded region by expected seconds per layer; transposes run
with round-robin and greedy owners. Printed per plan: the mean predicted step time, its ratio to
``1f1b``, the bubble share, and the largest per-rank peak memory against the device's capacity.

    PYTHONPATH=. python benchmarks/bench_transpose_regions.py [--pp 4,8,16] [--microbatches 32] [--recompute]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from mpipe_tune.search import Candidate, Evaluator, Problem
from mpipe_tune.specs import load_model, load_profile

MODEL = Path(__file__).with_name("models") / "qwen2vl-vit-llama3-8b-head.yaml"
SCHEDULES = ("1f1b", "transpose,1f1b", "1f1b,transpose", "transpose,1f1b,transpose", "gpipe", "gpipe,transpose",
             "transpose,gpipe", "transpose,gpipe,transpose")


def cut_of(schedule: str, vision: int, head: int) -> tuple[int, ...]:
    skeletons = schedule.split(",")
    return (((vision,) if skeletons[0] == "transpose" else ())
            + ((head,) if len(skeletons) > 1 and skeletons[-1] == "transpose" else ()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="4,8,16", help="pipeline degrees (default 4,8,16)")
    parser.add_argument("--microbatches", type=int, default=32, help="microbatches per step (default 32)")
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation")
    args = parser.parse_args()
    model, profile = load_model(MODEL), load_profile("h100-sxm")
    M = args.microbatches
    print(f"model {model.name}, profile {profile.name}, bf16, mix balanced, M={M}, 4 sampled steps, "
          f"recompute {'full' if args.recompute else 'off'}; "
          f"python {platform.python_version()}")
    print("| pp | schedule | owners | step ms | vs 1f1b | bubble | peak GiB (capacity "
          f"{profile.memory_capacity_bytes / 2**30:.0f}) |")
    print("|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for pp in (int(p) for p in args.pp.split(",")):
        evaluator = Evaluator(Problem(model, profile, pp, M, mix="balanced", num_samples=4, seed=0))
        reference = None
        for schedule in SCHEDULES:
            cut = cut_of(schedule, model.backbone_start, model.head_start)
            for policy in (("round-robin", "greedy") if "transpose" in schedule else (None,)):
                c = Candidate(schedule, cut, pp, 1, 1, M, policy, recompute=args.recompute)
                e = evaluator.evaluate(c)
                reference = reference or e.mean_s
                print(f"| {pp} | `{schedule}` | {policy or '-'} | {e.mean_s * 1e3:.1f} | {e.mean_s / reference:.3f} "
                      f"| {e.bubble_share:.3f} | {e.peak_bytes / 2**30:.1f}{'' if e.fits else ' (over)'} |")
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
