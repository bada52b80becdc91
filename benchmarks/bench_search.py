"""Search benchmarks: the plan against the exhaustive optimum and at scale, the sampler, and wall times of ``plan``.

    python benchmarks/bench_search.py sampler [--seeds 10] [--budget 0.1]
        On enumerable spaces: the exhaustive optimum (every point predicted), then the Optuna
        search with a budget of 10% of the points, over several seeds, in three variants: TPE
        alone, TPE + hill-climbing refinement, and TPE + refinement + lower-bound pruning (the
        default). Reported: the share of seeds within 1% of the optimum, the worst ratio, and the
        plans predicted in full. The studies are kept in memory here, so that storage time does
        not blur the comparison; the exhaustive optimum with pruning is reported as well.

    python benchmarks/bench_search.py quality [--seeds 3] [--problems NAME,...] [--references-only] [--refresh]
        What ``plan`` returns (each baseline's own best first, then the bound search at its defaults)
        against the exhaustive optimum (every point in lower-bound order, exact bounds), on problems where
        that optimum is computable (8-64 devices, every knob searched, dense and MoE, image-heavy and
        text-heavy mixes), per seed of the sampled steps: the gap to the optimum, the plans predicted in
        full (by the search, and in all) as a share of the space, the points settled by bound, why the
        search stopped, wall and CPU time. Each optimum is computed once and cached in
        search-quality-optima.json (see :func:`reference`).

    python benchmarks/bench_search.py scale [--devices 512,16384] [--tpe-trials 2000] [--tpe-cpu-s 300]
        Where the exhaustive optimum is out of reach (qwen2vl-vit-deepseek-v3 on ascend-910c-cm384, every
        knob searched, one sequence per device): ``plan``'s search, its winner, each baseline's own best
        and a long TPE run (up to 2,000 trials or 300 s of CPU time, whichever comes first: a CPU budget,
        so that a shared machine runs the same search, only slower), each against the best plan any of
        them found.

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
import json
import math
import os
import platform
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import optuna

from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

ROOT = Path(__file__).resolve().parent.parent

SPACES = {
    "example-mllm, ideal, 4 devices, batch 16": ("example-mllm", "ideal", 4, 16, SpaceOptions()),
    "example-mllm, ideal, 16 devices, batch 64": ("example-mllm", "ideal", 16, 64, SpaceOptions()),
    "qwen2vl-vit-llama3-8b, h100-sxm, 16 devices, batch 64": (
        "qwen2vl-vit-llama3-8b", "h100-sxm", 16, 64, SpaceOptions()),
}
DEEPSEEK = ["--model", "qwen2vl-vit-deepseek-v3", "--profile", "ascend-910c-cm384"]
EVERY_KNOB_FLAGS = ["--recompute", "search", "--zero", "search", "--sequence-parallel", "search", "--ep", "search",
                    "--cp", "1,2", "--encoder-tp", "search"]
"""Issue 27's every-knob DeepSeek-V3 command (recomputation off/full, as the issue's 16-device problem)."""


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


EVERY_KNOB = dict(recompute="all", zero="all", sequence_parallel="search", encoder_tp="search", cp="1,2")
QUALITY = {
    "llama3-8b-16dev-balanced": ("qwen2vl-vit-llama3-8b", "h100-sxm", 16, 64, "balanced",
                                 dict(recompute="search", zero="search", sequence_parallel="search", cp="1,2",
                                      encoder_tp="search")),  # the problem
    "llama3-8b-8dev-image-heavy": ("qwen2vl-vit-llama3-8b", "h100-sxm", 8, 32, "image-heavy", EVERY_KNOB),
    "llama3-8b-8dev-text-heavy": ("qwen2vl-vit-llama3-8b", "h100-sxm", 8, 32, "text-heavy", EVERY_KNOB),
    "qwen2-7b-32dev-text-heavy": ("qwen2vl-vit-qwen2-7b", "h200", 32, 64, "text-heavy", EVERY_KNOB),
    "mixtral-moe-16dev-image-heavy": ("benchmarks/models/qwen2vl-vit-mixtral-8x7b.yaml", "h100-sxm", 16, 32,
                                      "image-heavy", dict(EVERY_KNOB, ep="search")),
    "llama3-70b-64dev-balanced": ("siglip-llama3-70b", "h100-sxm", 64, 64, "balanced", EVERY_KNOB),
}
TINY = {"tiny": ("tiny-vit-llm", "ideal", 4, 4, "text-heavy", dict(recompute="search", zero="search",
                                                                 sequence_parallel="search", encoder_tp="search"))}
"""A problem small enough for CI (the smoke test of ``quality``)."""
CACHE = Path(__file__).resolve().parent / "search-quality-optima.json"
"""The exhaustive optima, per problem and seed: see :func:`reference`."""


def cpu_s() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def ms(value: float) -> str:
    """Milliseconds as the tables print them: one decimal, or four significant digits below 10 ms."""
    return f"{value:,.1f}" if value >= 10 else f"{value:.4g}"


def plan_text(candidate) -> str:
    return " ".join(str(candidate).split())


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def quality_problem(spec, seed: int):
    """A fresh (problem, request, evaluator, space) for one quality problem and seed: nothing cached."""
    from mpipe_tune.search import SpaceRequest, space_options

    model, profile, devices, batch, mix, knobs = spec
    model = str(ROOT / model) if model.endswith(".yaml") else model
    problem = Problem(load_model(model), load_profile(profile), devices, batch, mix=mix, num_samples=4, seed=seed)
    request = SpaceRequest(**knobs)
    evaluator = Evaluator(problem)
    return problem, request, evaluator, SearchSpace(problem, evaluator.reference_weights(),
                                                    space_options(request, problem.model))


def reference(name: str, spec, seed: int, cache: dict, refresh: bool) -> dict:
    """The exhaustive optimum of problem ``name`` at ``seed``: from ``cache`` when it holds one for the same
    inputs (the digest of everything a prediction depends on but the code: model, profile, mix, devices,
    batch, samples, seed, cost and space options) whose plan the current code still predicts at the recorded
    step time (else the cost model changed, and the optimum is recomputed); else computed, every point in
    increasing lower-bound order with exact bounds (no tolerance), and stored in ``cache``."""
    from mpipe_tune.algebra import Candidate
    from mpipe_tune.search import problem_key

    problem, _, evaluator, space = quality_problem(spec, seed)
    key = f"{name}/seed{seed}"
    inputs = problem_key(evaluator, space)
    entry = cache.get(key)
    if entry is not None and entry["inputs"] == inputs and not refresh:
        again = evaluator.evaluate(Candidate.from_dict(entry["candidate"])).mean_s * 1e3
        if math.isclose(again, entry["optimum_ms"], rel_tol=1e-9):
            return entry
        print(f"{key}: the cached optimum now predicts {again:.3f} ms, not {entry['optimum_ms']:.3f} ms (the cost "
              f"model changed): recomputing it", file=sys.stderr)
    cpu, start = cpu_s(), time.perf_counter()
    full = run_search(space, evaluator, storage=None, n_trials=10**5, exhaustive=True, progress=False)
    entry = {"inputs": inputs, "optimum_ms": full.best.mean_s * 1e3, "candidate": full.best.candidate.to_dict(),
             "plan": plan_text(full.best.candidate), "points": full.space_size, "predicted": full.num_evaluated,
             "settled_by_bound": full.num_bounded, "wall_s": round(time.perf_counter() - start, 1),
             "cpu_s": round(cpu_s() - cpu, 1), "load_average": [round(x, 2) for x in os.getloadavg()],
             "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    cache[key] = entry
    return entry


def load_cache(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_cache(path: Path, cache: dict) -> None:
    """Written whole to a temporary file and renamed: a killed run leaves the previous file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(cache.items())), indent=1) + "\n")
    tmp.replace(path)


def quality(args) -> list[dict]:
    """Prints the table; returns its rows (gap: the plan's step time over the optimum, minus 1)."""
    from mpipe_tune.search import SearchOptions, plan

    problems = {**QUALITY, **TINY}
    names = args.problems.split(",") if args.problems else list(QUALITY)
    unknown = [n for n in names if n not in problems]
    if unknown:
        sys.exit(f"unknown problem(s) {', '.join(unknown)}; of {', '.join(problems)}")
    cache_path = Path(args.cache)
    cache = load_cache(cache_path)
    print(f"{versions()}; commit {commit()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    if not args.references_only:
        print("| problem | seed | points | optimum ms | plan ms | gap | predicted by the search (share) "
              "| predicted in all (share) | settled by bound | stop | plan wall s | plan CPU s "
              "| exhaustive: predicted, wall / CPU s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    for name in names:
        for seed in range(1, args.seeds + 1):
            ref = reference(name, problems[name], seed, cache, args.refresh)
            save_cache(cache_path, cache)
            if args.references_only:
                print(f"{name} seed {seed}: {ms(ref['optimum_ms'])} ms, {ref['plan']} ({ref['points']} points, "
                      f"{ref['wall_s']} s wall, {ref['cpu_s']} s CPU)", flush=True)
                continue
            problem, request, _, _ = quality_problem(problems[name], seed)  # fresh: nothing cached
            cpu, start = cpu_s(), time.perf_counter()
            outcome = plan(problem, request, SearchOptions(progress=False, seed=seed))
            wall, cpu = time.perf_counter() - start, cpu_s() - cpu
            r = outcome.result
            predicted = outcome.evaluator.num_evaluated  # distinct plans: the search's, the families', the rows'
            searched = r.num_evaluated
            gap = outcome.best.mean_s * 1e3 / ref["optimum_ms"] - 1
            rows.append({"problem": name, "seed": seed, "gap": gap, "predicted_share": predicted / ref["points"],
                         "searched_share": searched / ref["points"]})
            stop = r.ending + ("" if r.gap is None else f", {r.gap:.2%} left")
            print(f"| {name} | {seed} | {ref['points']:,} | {ms(ref['optimum_ms'])} | {ms(outcome.best.mean_s * 1e3)} "
                  f"| {gap:+.2%} | {searched:,} ({searched / ref['points']:.1%}) | {predicted:,} ({predicted / ref['points']:.1%}) "
                  f"| {r.num_bounded:,} | {stop} "
                  f"| {wall:.1f} | {cpu:.1f} | {ref['predicted']:,}, {ref['wall_s']:.0f} / {ref['cpu_s']:.0f} |", flush=True)
    if rows:
        print(f"\nworst gap to the optimum: {max(r['gap'] for r in rows):+.2%}; largest share predicted: "
              f"{max(r['searched_share'] for r in rows):.1%} by the search, {max(r['predicted_share'] for r in rows):.1%} "
              f"in all")
    return rows


SCALE_KNOBS = dict(EVERY_KNOB, recompute="search", zero="search", ep="search")
"""The every-knob set of ``deepseek --every-knob`` (:data:`EVERY_KNOB_FLAGS`)."""


def scale(args) -> dict[int, list[tuple[str, float | None]]]:
    """At scales where the exhaustive optimum is out of reach: every method's best against the best plan any
    of them found (``plan``'s own search, a long TPE run, each baseline's own best layout). Prints the table;
    returns per device count each method's step time (None: no plan that fits)."""
    from mpipe_tune.search import SearchOptions, SpaceRequest, plan

    print(f"{versions()}; commit {commit()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| devices | points | method | best plan | step ms | vs best found | predicted | wall s | CPU s |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    found = {}
    for devices in (int(d) for d in args.devices.split(",")):
        spec = (args.model, args.profile, devices, devices, "balanced", SCALE_KNOBS)  # one sequence per device
        rows = []
        problem, request, _, space = quality_problem(spec, args.seed)
        points_text = f"{sum(g.size for g in space.groups()):,}"  # counted by group, no point built
        cpu, start = cpu_s(), time.perf_counter()
        outcome = plan(problem, request, SearchOptions(progress=False, seed=args.seed))
        wall, cpu = time.perf_counter() - start, cpu_s() - cpu
        r = outcome.result
        print(f"{devices} devices: {points_text} points; plan: {ms(outcome.best.mean_s * 1e3) if outcome.best else '-'} ms "
              f"in {wall:.0f} s ({cpu:.0f} s CPU); now TPE, up to {args.tpe_trials:,} trials or {args.tpe_cpu_s:.0f} s "
              f"CPU", file=sys.stderr, flush=True)
        method = f"plan ({r.mode}{'' if r.gap is None else f', {r.gap:.2%} left'}; {r.ending})"
        rows.append((method, r.best, r.num_evaluated, wall, cpu))
        rows.append((f"plan's winner (from {outcome.best_from})", outcome.best, None, wall, cpu))
        rows.extend((f.label, f.best, f.num_evaluated, None, None) for f in outcome.families)
        _, _, evaluator, space = quality_problem(spec, args.seed)  # fresh: nothing cached from plan
        cpu, start = cpu_s(), time.perf_counter()
        tpe = run_search(space, evaluator, storage=None, n_trials=args.tpe_trials, sampler="tpe", seed=args.seed,
                         exhaustive=False, progress=False, timeout_s=args.tpe_cpu_s, clock=time.process_time)
        wall, cpu = time.perf_counter() - start, cpu_s() - cpu
        stop = f"the {args.tpe_cpu_s:.0f} s CPU budget" if tpe.timed_out else f"{tpe.ending}, cap {args.tpe_trials:,}"
        rows.append((f"TPE, {tpe.num_new:,} trials ({stop})", tpe.best, tpe.num_evaluated, wall, cpu))
        best = min((e.mean_s for _, e, *_ in rows if e is not None))
        found[devices] = [(method, None if e is None else e.mean_s) for method, e, *_ in rows]
        for method, e, predicted, wall, cpu in rows:
            step = "-" if e is None else ms(e.mean_s * 1e3)
            versus = "no plan fits" if e is None else f"{e.mean_s / best - 1:+.2%}"
            print(f"| {devices:,} | {points_text} | {method} | {'-' if e is None else f'`{plan_text(e.candidate)}`'} | {step} "
                  f"| {versus} | {'' if predicted is None else f'{predicted:,}'} "
                  f"| {'' if wall is None else f'{wall:.1f}'} | {'' if cpu is None else f'{cpu:.1f}'} |", flush=True)
    return found


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
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N of the sampled steps (default 3)")
    p.add_argument("--problems", default=None, help=f"comma-separated, of {', '.join([*QUALITY, *TINY])} "
                                                   f"(default: all but tiny)")
    p.add_argument("--references-only", action="store_true", help="compute (or check) the exhaustive optima only")
    p.add_argument("--refresh", action="store_true", help="recompute the exhaustive optima even when cached")
    p.add_argument("--cache", default=str(CACHE), help="the optima's JSON file (default: %(default)s)")
    p = sub.add_parser("scale")
    p.add_argument("--devices", default="512,16384", help="device counts, comma-separated (default 512,16384)")
    p.add_argument("--model", default="qwen2vl-vit-deepseek-v3")
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--tpe-trials", type=int, default=2000, help="the long TPE run's most trials (default 2000)")
    p.add_argument("--tpe-cpu-s", type=float, default=300.0,
                   help="the long TPE run's CPU time budget, seconds of this process (default 300)")
    p.add_argument("--seed", type=int, default=1)
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
    {"sampler": sampler, "quality": quality, "scale": scale, "default-plan": default_plan, "deepseek": deepseek}[args.what](args)


if __name__ == "__main__":
    main()
