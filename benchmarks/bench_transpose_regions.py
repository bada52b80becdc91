"""What interior and sink transposes predict: the output head transposed as a sink region, and the
projector transposed as an interior region (``--interior``).

``qwen2vl-vit-llama3-8b-head`` (benchmarks/models: the built-in qwen2vl-vit-llama3-8b with its
128k-vocabulary output head in a block of its own) on the h100-sxm profile, bf16, the balanced mix,
one pipeline (pp devices, tp = dp = 1), M microbatches, 4 sampled steps per plan. Schedules:

- ``1f1b``: the encoder inside the first stage and the head inside the last (Megatron-LM style);
- ``transpose,1f1b``: the encoder transposed (Mpipe);
- ``1f1b,transpose``: the head transposed as a sink, each microbatch's head, loss and head backward on its owner;
- ``transpose,1f1b,transpose``: both, one owner map for the two;
- ``gpipe``, ``gpipe,transpose``, ``transpose,gpipe``, ``transpose,gpipe,transpose``: the same under GPipe, whose last stage
  runs every forward before any backward (so a head's round trip to its owner is off its path).

With ``--interior``, the schedules instead: ``1f1b``, ``transpose,1f1b``, ``1f1b,1f1b`` (two woven
regions cut at the first backbone layer: the encoder and projector, then the backbone, interleaved),
``1f1b,transpose,1f1b`` (the same with the projector transposed between the two: each microbatch's
projector on its owner), and the GPipe forms ``gpipe,gpipe``, ``gpipe,transpose,gpipe``; then the
best plan of the search space with and without ``interior_transpose`` at the same degrees (the search's
own cuts, microbatch counts and owners; exhaustive).

Slabs are the balanced partition of each Sharded region by expected seconds per layer; transposes run
with round-robin and greedy owners. Printed per plan: the mean predicted step time, its ratio to
``1f1b``, the bubble share, and the largest per-rank peak memory against the device's capacity.

    PYTHONPATH=. python benchmarks/bench_transpose_regions.py [--pp 4,8,16] [--microbatches 32] [--recompute] [--interior]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from mpipe_tune.search import Candidate, Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL = Path(__file__).with_name("models") / "qwen2vl-vit-llama3-8b-head.yaml"
SCHEDULES = ("1f1b", "transpose,1f1b", "1f1b,transpose", "transpose,1f1b,transpose", "gpipe", "gpipe,transpose",
             "transpose,gpipe", "transpose,gpipe,transpose")
INTERIOR = ("1f1b", "transpose,1f1b", "1f1b,1f1b", "1f1b,transpose,1f1b", "gpipe,gpipe", "gpipe,transpose,gpipe")


def cut_of(schedule: str, model) -> tuple[int, ...]:
    """The encoder's transpose before the first backbone layer, the head's at its start; two woven
    regions cut at the first backbone layer, an interior transpose around the projector."""
    skeletons = schedule.split(",")
    if "transpose" in skeletons[1:-1]:
        return model.encoder_end, model.backbone_start
    if skeletons.count("transpose") == 0 and len(skeletons) == 2:
        return (model.backbone_start,)
    return (((model.backbone_start,) if skeletons[0] == "transpose" else ())
            + ((model.head_start,) if len(skeletons) > 1 and skeletons[-1] == "transpose" else ()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="4,8,16", help="pipeline degrees (default 4,8,16)")
    parser.add_argument("--microbatches", type=int, default=32, help="microbatches per step (default 32)")
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation")
    parser.add_argument("--interior", action="store_true",
                        help="the projector transposed as an interior region, on the built-in qwen2vl-vit-llama3-8b, "
                             "and the search with and without interior transposes")
    args = parser.parse_args()
    model, profile = load_model("qwen2vl-vit-llama3-8b" if args.interior else MODEL), load_profile("h100-sxm")
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

        def row(schedule: str, policy: str | None, e, note: str = "") -> None:
            print(f"| {pp} | `{schedule}`{note} | {policy or '-'} | {e.mean_s * 1e3:.1f} | {e.mean_s / reference:.3f} "
                  f"| {e.bubble_share:.3f} | {e.peak_bytes / 2**30:.1f}{'' if e.fits else ' (over)'} |")

        for schedule in INTERIOR if args.interior else SCHEDULES:
            for policy in (("round-robin", "greedy") if "transpose" in schedule else (None,)):
                c = Candidate(schedule, cut_of(schedule, model), pp, 1, 1, M, policy, recompute=args.recompute)
                e = evaluator.evaluate(c)
                reference = reference or e.mean_s
                row(schedule, policy, e)
        if args.interior:
            for interior in (False, True):
                best = searched_best(evaluator, pp, args.recompute, interior)
                c = best.candidate
                row(c.schedule, c.owner_policy, best, f" cut {','.join(map(str, c.cut))} M={c.num_microbatches}, "
                                                      f"best of the search {'with' if interior else 'without'} "
                                                      f"interior transposes")
    print(f"\n{time.perf_counter() - start:.1f} s")


def searched_best(evaluator: Evaluator, pp: int, recompute: bool, interior: bool):
    """The best plan of an exhaustive search over one pipeline of ``pp`` devices (tp = dp = 1)."""
    options = SpaceOptions(pp=(pp,), tp=(1,), dp=(1,), recompute=(recompute,), interior_transpose=interior)
    space = SearchSpace(evaluator.problem, evaluator.reference_weights(), options)
    with tempfile.TemporaryDirectory() as folder:
        result = run_search(space, evaluator, storage=f"sqlite:///{folder}/study.db", exhaustive=True, progress=False)
    return result.best


if __name__ == "__main__":
    main()
