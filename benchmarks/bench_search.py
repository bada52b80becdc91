"""Search benchmarks: the sampler against exhaustive enumeration, and wall times of ``mpipe-tune plan``.

    python benchmarks/bench_search.py sampler [--seeds 10] [--budget 0.1]
        On enumerable spaces: the exhaustive optimum (every point predicted), then the Optuna
        search with a budget of 10% of the points, over several seeds, in three variants: TPE
        alone, TPE + hill-climbing refinement, and TPE + refinement + lower-bound pruning (the
        default). Reported: the share of seeds within 1% of the optimum, the worst ratio, and the
        plans predicted in full. The studies are kept in memory here, so that storage time does
        not blur the comparison; the exhaustive optimum with pruning is reported as well.

    python benchmarks/bench_search.py quality [--seeds 3] [--problems NAME,...]
        What ``plan`` returns (the planner: each baseline's own best first, then the bound search at
        its default 1% tolerance) against the exhaustive optimum (every point, exact bounds), on
        problems where that optimum is computable (8-16 devices, every knob searched, dense and MoE,
        image-heavy and text-heavy mixes), per seed: the gap to the optimum, the share of the space
        predicted in full (the search's and the family searches' predictions over the space's
        points), and the wall times of both.

    python benchmarks/bench_search.py default-plan [--runs 3] [--fresh-cache]
        Wall time of ``mpipe-tune plan`` with no arguments (fresh SQLite study each run).

    python benchmarks/bench_search.py deepseek [--devices 512] [--every-knob] [--trials N] [--timeout S] [--profile]
        Wall time of a qwen2vl-vit-deepseek-v3 plan on ascend-910c-cm384 (global batch one sequence
        per device, the balanced mix), no extra flags (the defaults: ep searched, memory knobs widened
        when nothing fits) or ``--every-knob``; fresh SQLite study; with ``--profile``, the functions
        that dominate (cProfile, cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import optuna

from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.inputs.specs import load_model, load_profile

ROOT = Path(__file__).resolve().parent.parent

SPACES = {
    "example-mllm, ideal, 4 devices, batch 16": ("example-mllm", "ideal", 4, 16, SpaceOptions()),
    "example-mllm, ideal, 16 devices, batch 64": ("example-mllm", "ideal", 16, 64, SpaceOptions()),
    "qwen2vl-vit-llama3-8b, h100-sxm, 16 devices, batch 64": (
        "qwen2vl-vit-llama3-8b", "h100-sxm", 16, 64, SpaceOptions()),
}
DEEPSEEK = ["--model", "qwen2vl-vit-deepseek-v3", "--profile", "ascend-910c-cm384"]
EVERY_KNOB_FLAGS = ["--recompute", "all", "--zero", "search", "--sequence-parallel", "search", "--encoder-tp", "search",
                    "--cp", "1,2"]


def checkout_env() -> dict:
    """The environment for a ``mpipe-tune`` child process that runs this checkout's package."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def versions() -> str:
    return (f"python {platform.python_version()}, optuna {optuna.__version__}, numpy {np.__version__}, "
            f"{platform.machine()}, {os.cpu_count()} CPUs")


def sampler(args) -> None:
    print(versions() + "\n")
    print("| space | points | exhaustive: predicted (s) | with pruning: predicted (s) | budget (trials) | variant "
          "| within 1% | worst ratio | median predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, (model, profile, devices, batch, options) in SPACES.items():
        problem = Problem(load_model(model), load_profile(profile), devices, batch, mix="balanced", num_samples=4)
        space = SearchSpace(problem, Evaluator(problem).reference_weights(), options)
        start = time.perf_counter()
        full = run_search(space, Evaluator(problem), storage=None, n_trials=10**9, exhaustive=True, prune=False,
                          progress=False)
        full_s = time.perf_counter() - start
        start = time.perf_counter()
        pruned = run_search(space, Evaluator(problem), storage=None, n_trials=10**9, exhaustive=True, prune=True,
                            progress=False)
        pruned_s = time.perf_counter() - start
        assert pruned.best.mean_s == full.best.mean_s
        optimum = full.best.mean_s
        budget = max(1, math.ceil(args.budget * full.space_size))
        shared = Evaluator(problem)  # predictions are cached across seeds: only counts matter below
        for variant, refine, prune in (("TPE", False, False), ("TPE + refine", True, False),
                                       ("TPE + refine + bounds", True, True)):
            ratios, predicted = [], []
            for seed in range(args.seeds):
                r = run_search(space, shared, storage=None, n_trials=budget, exhaustive=False, seed=seed,
                               refine=refine, prune=prune, progress=False)
                ratios.append(r.best.mean_s / optimum)
                predicted.append(r.num_evaluated)
            within = sum(x <= 1.01 for x in ratios)
            print(f"| {label} | {full.space_size} | {full.num_evaluated} ({full_s:.0f} s) | {pruned.num_evaluated} "
                  f"({pruned_s:.0f} s) | {budget} | {variant} | {within}/{args.seeds} | {max(ratios):.4f} | "
                  f"{int(np.median(predicted))} |")
            sys.stdout.flush()


EVERY_KNOB = dict(recompute="all", zero="search", sequence_parallel="search", encoder_tp="search", cp="1,2")
QUALITY = {
    "llama3-8b-16dev-balanced": ("qwen2vl-vit-llama3-8b", "h100-sxm", 16, 64, "balanced",
                                 dict(recompute="search", zero="search", sequence_parallel="search", cp="1,2",
                                      encoder_tp="search")),  # the problem
    "llama3-8b-8dev-image-heavy": ("qwen2vl-vit-llama3-8b", "h100-sxm", 8, 32, "image-heavy", EVERY_KNOB),
    "llama3-8b-8dev-text-heavy": ("qwen2vl-vit-llama3-8b", "h100-sxm", 8, 32, "text-heavy", EVERY_KNOB),
    "tiny-moe-16dev-balanced": (str(ROOT / "tests" / "runtime" / "tiny-mllm-mla-moe.yaml"), "h100-sxm", 16, 64,
                                "balanced", dict(EVERY_KNOB, ep="search")),
}


def quality(args) -> None:
    from mpipe_tune.search.planner import SearchOptions, SpaceRequest, plan, space_options

    print(versions() + "\n")
    print("| problem | seed | points | optimum ms (exhaustive s) | plan ms | gap | predicted (share) | plan s |")
    print("|---|---|---|---|---|---|---|---|")
    names = args.problems.split(",") if args.problems else list(QUALITY)
    for name in names:
        model, profile, devices, batch, mix, knobs = QUALITY[name]
        request = SpaceRequest(**knobs)
        for seed in range(1, args.seeds + 1):
            problem = Problem(load_model(model), load_profile(profile), devices, batch, mix=mix, num_samples=4,
                              seed=seed)
            evaluator = Evaluator(problem)
            space = SearchSpace(problem, evaluator.reference_weights(), space_options(request, problem.model))
            start = time.perf_counter()
            full = run_search(space, evaluator, storage=None, n_trials=10**5, exhaustive=True, progress=False)
            full_s = time.perf_counter() - start
            problem = Problem(load_model(model), load_profile(profile), devices, batch, mix=mix, num_samples=4,
                              seed=seed)  # a fresh problem: nothing cached from the exhaustive run
            start = time.perf_counter()
            outcome = plan(problem, request, SearchOptions(progress=False, seed=seed))
            plan_s = time.perf_counter() - start
            predicted = outcome.result.num_evaluated + sum(f.num_evaluated for f in outcome.families)
            size = full.space_size
            gap = outcome.best.mean_s / full.best.mean_s - 1
            print(f"| {name} | {seed} | {size} | {full.best.mean_s * 1e3:.1f} ({full_s:.0f} s) | "
                  f"{outcome.best.mean_s * 1e3:.1f} | {gap:+.2%} | {predicted} ({predicted / size:.1%}) | "
                  f"{plan_s:.1f} |")
            sys.stdout.flush()


def default_plan(args) -> None:
    print(versions())
    walls = []
    # This checkout's package, and with --fresh-cache an empty numba cache per run (a fresh install:
    # the cost model's kernels compile on first use).
    env = checkout_env()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            if args.fresh_cache:
                env["NUMBA_CACHE_DIR"] = os.path.join(folder, "numba-cache")
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "plan", "--no-progress"], cwd=folder,
                                  capture_output=True, text=True, env=env)
            walls.append(time.perf_counter() - start)
            assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    print(f"wall times of `mpipe-tune plan` (s): {', '.join(f'{w:.2f}' for w in walls)}")


def deepseek(args) -> None:
    print(versions())
    with tempfile.TemporaryDirectory() as folder:
        argv = ["plan", *DEEPSEEK, "--devices", str(args.devices), "--global-batch", str(args.devices),
                *(EVERY_KNOB_FLAGS if args.every_knob else []),
                *(["--trials", str(args.trials)] if args.trials else []),
                *(["--timeout", str(args.timeout)] if args.timeout else []), "--no-progress",
                "--storage", f"sqlite:///{folder}/study.db", "--out", f"{folder}/plan.json"]
        print(" ".join(argv))
        start = time.perf_counter()
        if args.profile:
            from mpipe_tune.cli import main

            profiler = cProfile.Profile()
            profiler.runcall(main, argv)
            wall = time.perf_counter() - start
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
            print(out.getvalue())
        else:
            env = checkout_env()
            proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", *argv], capture_output=True, text=True,
                                  env=env)
            wall = time.perf_counter() - start
            assert proc.returncode == 0, proc.stderr
            print(proc.stderr + proc.stdout)
    print(f"wall time: {wall:.1f} s" + (" (under cProfile)" if args.profile else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("sampler")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--budget", type=float, default=0.1, help="trials as a share of the space (default 0.1)")
    p = sub.add_parser("quality")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--problems", default=None, help=f"comma-separated, of {', '.join(QUALITY)}")
    p = sub.add_parser("default-plan")
    p.add_argument("--fresh-cache", action="store_true", help="an empty numba cache per run (a fresh install)")
    p.add_argument("--runs", type=int, default=3)
    p = sub.add_parser("deepseek")
    p.add_argument("--devices", type=int, default=512, help="devices, and the global batch (default 512)")
    p.add_argument("--every-knob", action="store_true", help="search every knob (default: no extra flags)")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    {"sampler": sampler, "quality": quality, "default-plan": default_plan, "deepseek": deepseek}[args.what](args)


if __name__ == "__main__":
    main()
