"""Predicted speedup of <transpose, 1f1b> over the encoder-in-first-stage 1F1B baseline, at the
paper's two scales, printed beside the paper's measured speedups.

The numbers are what the cost model predicts for the configuration printed; nothing is tuned toward
the paper. The paper's own setups differ (a Qwen3.5 MLLM on 8 Ascend devices against Megatron-LM;
a production dataset on 512 Ascend 910C devices against a DistTrain-like baseline), so the
comparison is of trends, not a reproduction.

    python benchmarks/bench_paper_configs.py
        The fixed configurations below (the paper's degrees, M and batch), the baselines side by side.

    python benchmarks/bench_paper_configs.py fixed --profile h100-sxm
        The same, every configuration on another profile (the calibrated h100-sxm, issue 16).

    python benchmarks/bench_paper_configs.py own-best
        ``mpipe-tune plan --exhaustive --recompute search --json`` at the same two scales (and the 8
        devices with the image-heavy mix), with the fixed configuration as ``--current``: per baseline,
        the best plan's speedup over it at the best plan's degrees and at the baseline's own best layout.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from mpipe_tune.search.baselines import baseline
from mpipe_tune.search.evaluate import Evaluator
from mpipe_tune.search.problem import Problem
from mpipe_tune.inputs.specs import load_model, load_profile

CONFIGS = [
    dict(name="8 devices", model="qwen2vl-vit-llama3-8b", profile="ascend-910c-cm384", devices=8,
         pp=8, tp=1, dp=1, microbatches=16, global_batch=16, paper="2.70x (Qwen3.5 MLLM, 8 devices, vs Megatron-LM)"),
    dict(name="512 devices", model="qwen2vl-vit-deepseek-v3", profile="ascend-910c-cm384", devices=512,
         pp=16, tp=8, dp=4, microbatches=32, global_batch=128,
         paper="1.21x (Qwen2-VL ViT + DeepSeek-V3, 512 x 910C, vs DistTrain-like)"),
]
MIX = "balanced"


def run(config: dict) -> list[str]:
    problem = Problem(load_model(config["model"]), load_profile(config["profile"]), config["devices"],
                      config["global_batch"], mix=MIX, num_samples=4, seed=0)
    evaluator = Evaluator(problem)
    lines = []
    results = {}
    for recompute in (False, True):
        for name in ("megatron", "disttrain", "mpipe-rr"):
            c = baseline(name, problem.model, config["pp"], config["tp"], config["dp"], config["microbatches"])
            e = evaluator.evaluate(replace(c, recompute=recompute))
            results[(name, recompute)] = e
    for recompute in (False, True):
        ref = results[("megatron", recompute)]
        dist = results[("disttrain", recompute)]
        for name in ("megatron", "disttrain", "mpipe-rr"):
            e = results[(name, recompute)]
            peak = e.peak_bytes / 2**30 if e.peak_bytes is not None else float("nan")
            lines.append(
                f"| {config['name']} | {'on' if recompute else 'off'} | {name} | {e.mean_s * 1e3:,.0f} | "
                f"{e.p90_s * 1e3:,.0f} | {ref.mean_s / e.mean_s:.2f}x | {dist.mean_s / e.mean_s:.2f}x | {peak:.1f}{'' if e.fits else ' (over)'} |"
            )
    return lines


def fixed(profile: str | None = None) -> None:
    configs = CONFIGS if profile is None else [{**c, "profile": profile} for c in CONFIGS]
    print(f"python {platform.python_version()}; workload mix '{MIX}', 4 sampled steps (seeds 0-3), bf16\n")
    for config in configs:
        print(f"- {config['name']}: {config['model']} on {config['profile']}, pp={config['pp']} tp={config['tp']} "
              f"dp={config['dp']}, M={config['microbatches']}, global batch {config['global_batch']} sequences; "
              f"paper measured {config['paper']}")
    print("\n| scale | recompute | schedule | step ms (mean) | p90 ms | speedup vs megatron | vs disttrain | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        for line in run(config):
            print(line)


# ------------------------------------------------------------------ own-best: both speedups per baseline

def plan_command(config: dict, mix: str) -> list[str]:
    current = (f"pp={config['pp']},tp={config['tp']},dp={config['dp']},schedule=1f1b,M={config['microbatches']},"
               f"recompute=on")
    return ["plan", "--model", config["model"], "--profile", config["profile"], "--devices", str(config["devices"]),
            "--global-batch", str(config["global_batch"]), "--workload", mix, "--recompute", "search", "--exhaustive",
            "--current", current]


def _layout(r: dict) -> str:
    cut = ",".join(map(str, r["cut"]))
    return (f"`<{r['schedule']}>`{' cut ' + cut if cut else ''} pp{r['pp']} tp{r['tp']} dp{r['dp']} "
            f"M={r['microbatches']}{' rc' if r['recompute'] else ''}")


def _cell(r: dict | None) -> str:
    if r is None:
        return "- | - | -"
    over = "" if r["fits_memory"] else " (over memory)"
    return f"{_layout(r)}{over} | {r['step_s'] * 1e3:,.0f} | {r['best_speedup']:.2f}x"


def own_best() -> None:
    import optuna

    print(f"python {platform.python_version()}, optuna {optuna.__version__}, {platform.machine()}; 4 sampled steps "
          f"(seeds 0-3), bf16; exhaustive search, recomputation searched; rc = recomputation on\n")
    runs = [(CONFIGS[0], MIX), (CONFIGS[0], "image-heavy"), (CONFIGS[1], MIX)]
    for config, mix in runs:
        argv = plan_command(config, mix)
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", *argv, "--json", "--no-progress",
                                   "--storage", f"sqlite:///{folder}/study.db", "--out", f"{folder}/plan.json"],
                                  capture_output=True, text=True)
            wall = time.perf_counter() - start
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        best = out["comparison"][0]
        at_best = {r["plan"]: r for r in out["comparison"][1:]}
        own = {r["plan"]: r for r in out["own_best"]}
        print(f"**{config['name']}, {mix}**: `mpipe-tune {' '.join(argv)}` ({out['space_size']} points, "
              f"{wall:.0f} s wall). Best: {_layout(best)}, {best['step_s'] * 1e3:,.0f} ms, peak "
              f"{best['peak_bytes'] / 2**30:.1f} GiB.\n")
        print("| baseline | at the best plan's degrees | step ms | best's speedup | at its own best | step ms "
              "| best's speedup |")
        print("|---|---|---|---|---|---|---|")
        for name in out["families"]:
            print(f"| {name} | {_cell(at_best.get(name))} | {_cell(own.get(name + '@own'))} |")
        current = out["current"]
        print(f"\nCurrent layout (the fixed configuration above): {_layout(current)}, {current['step_s'] * 1e3:,.0f} ms"
              f"{'' if current['fits_memory'] else ' (over memory)'}; the best plan is "
              f"{current['best_speedup']:.2f}x faster.\n")
        sys.stdout.flush()


def main() -> None:
    args = sys.argv[1:]
    what = args[0] if args and not args[0].startswith("--") else "fixed"
    profile = args[args.index("--profile") + 1] if "--profile" in args[:-1] else None
    if what not in ("fixed", "own-best") or (profile and what != "fixed"):
        sys.exit(f"usage: {sys.argv[0]} [fixed [--profile NAME] | own-best]")
    fixed(profile) if what == "fixed" else own_best()


if __name__ == "__main__":
    main()
