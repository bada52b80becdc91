"""Predicted speedup of <transpose, 1f1b> over the encoder-in-first-stage 1F1B baseline, at the
paper's two scales, printed beside the paper's measured speedups.

The numbers are what the cost model predicts for the configuration printed; nothing is tuned toward
the paper. The paper's own setups differ (a Qwen3.5 MLLM on 8 Ascend devices against Megatron-LM;
a production dataset on 512 Ascend 910C devices against a DistTrain-like baseline), so the
comparison is of trends, not a reproduction.

    python benchmarks/bench_paper_configs.py
"""

from __future__ import annotations

import platform
from dataclasses import replace

from mpipe_tune.search.baselines import baseline
from mpipe_tune.search.evaluate import Evaluator
from mpipe_tune.search.problem import Problem
from mpipe_tune.specs import load_model, load_profile

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


def main() -> None:
    print(f"python {platform.python_version()}; workload mix '{MIX}', 4 sampled steps (seeds 0-3), bf16\n")
    for config in CONFIGS:
        print(f"- {config['name']}: {config['model']} on {config['profile']}, pp={config['pp']} tp={config['tp']} "
              f"dp={config['dp']}, M={config['microbatches']}, global batch {config['global_batch']} sequences; "
              f"paper measured {config['paper']}")
    print("\n| scale | recompute | schedule | step ms (mean) | p90 ms | speedup vs megatron | vs disttrain | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for config in CONFIGS:
        for line in run(config):
            print(line)


if __name__ == "__main__":
    main()
