"""How far the greedy owner map is from the optimal one, on many random small instances.

Two families of instances, each an encode-seconds vector (one per microbatch) and a warmup-slack
vector (one per rank):

- ``synthetic``: P in 2..8, M in P..12; encodes log-normal (a fifth of them text-only, zero);
  slack ``w_r = r * u`` with ``u`` drawn so that spill is common;
- ``cost model``: real ``<transpose,1f1b>`` pipelines of ``example-mllm`` (ideal profile) and
  ``qwen2vl-vit-llama3-8b`` (h100-sxm), P in {2, 4, 8}, M in {P, .., 12}, every built-in mix, several
  seeds: encodes and ``w_r`` read off the round-robin prediction, and the step time of each owner
  map predicted by the cost model.

Reported: the ratio of the largest spill, greedy / optimal (on instances where the optimum spills),
the share of instances where greedy is optimal, and for the cost-model family the predicted step
time ratio greedy / optimal and round-robin / optimal.

    python benchmarks/bench_owners.py [--instances 2000]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from mpipe_tune.algebra import round_robin
from mpipe_tune.inputs import MIXES
from mpipe_tune.search import Candidate, Evaluator, Problem, greedy_owners, max_spill, optimal_owners
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model


def synthetic(count: int, rng: np.random.Generator):
    for _ in range(count):
        P = int(rng.integers(2, 9))
        M = int(rng.integers(P, 13))
        encode = rng.lognormal(0.0, 0.8, size=M) * (rng.random(M) > 0.2)
        u = rng.uniform(0.1, 1.5) * encode.mean()
        yield encode.tolist(), [r * u for r in range(P)]


def cost_model(seeds: int):
    for model_name, profile_name in (("example-mllm", "ideal"), ("qwen2vl-vit-llama3-8b", "h100-sxm")):
        model, profile = load_model(model_name), load_profile(profile_name)
        cut = model.backbone_start
        for mix in MIXES:
            for P in (2, 4, 8):
                for M in range(P, 13, max(1, P // 2)):
                    evaluator = Evaluator(Problem(model, profile, P, M, mix=mix, num_samples=seeds, seed=11))
                    base = Candidate("transpose,1f1b", (cut,), P, 1, 1, M, "round-robin")
                    for k in range(seeds):
                        yield evaluator, base, k


def percentiles(values) -> str:
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return "| - | - | - | - | - |"
    p = np.percentile(v, [50, 90, 99])
    return f"| {p[0]:.4f} | {p[1]:.4f} | {p[2]:.4f} | {v.max():.4f} | {v.size} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=2000, help="synthetic instances (default 2000)")
    parser.add_argument("--seeds", type=int, default=3, help="sampled steps per cost-model pipeline (default 3)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    start = time.perf_counter()

    spill_ratio, greedy_opt, rr_ratio = [], 0, []
    n = 0
    for encode, slack in synthetic(args.instances, rng):
        n += 1
        opt = max_spill(optimal_owners(encode, slack), encode, slack)
        g = max_spill(greedy_owners(encode, slack), encode, slack)
        rr = max_spill(round_robin(len(encode), len(slack)), encode, slack)
        greedy_opt += g <= opt + 1e-12
        if opt > 1e-12:
            spill_ratio.append(g / opt)
            rr_ratio.append(rr / opt)
    synthetic_s = time.perf_counter() - start

    cm_spill, cm_equal, cm_step_g, cm_step_rr, m = [], 0, [], [], 0
    start = time.perf_counter()
    for evaluator, base, k in cost_model(args.seeds):
        m += 1
        encode, slack = evaluator.encode_s(base, k), evaluator.slack_s(base, k)
        owners = {p: evaluator.owners(Candidate(**{**base.__dict__, "owner_policy": p}), k)
                  for p in ("round-robin", "greedy", "optimal")}
        spills = {p: max_spill(o, encode, slack) for p, o in owners.items()}
        cm_equal += spills["greedy"] <= spills["optimal"] + 1e-12
        if spills["optimal"] > 1e-12:
            cm_spill.append(spills["greedy"] / spills["optimal"])
        steps = {p: evaluator.evaluate(Candidate(**{**base.__dict__, "owner_policy": p})).makespans_s[k]
                 for p in owners}
        cm_step_g.append(steps["greedy"] / steps["optimal"])
        cm_step_rr.append(steps["round-robin"] / steps["optimal"])
    cm_s = time.perf_counter() - start

    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}\n")
    print("| family | quantity | p50 | p90 | p99 | max | instances |")
    print("|---|---|---|---|---|---|---|")
    print(f"| synthetic | max spill greedy / optimal {percentiles(spill_ratio)}")
    print(f"| synthetic | max spill round-robin / optimal {percentiles(rr_ratio)}")
    print(f"| cost model | max spill greedy / optimal {percentiles(cm_spill)}")
    print(f"| cost model | step time greedy / optimal {percentiles(cm_step_g)}")
    print(f"| cost model | step time round-robin / optimal {percentiles(cm_step_rr)}")
    print(f"\ngreedy optimal (equal max spill): synthetic {greedy_opt}/{n} ({greedy_opt / n:.1%}), "
          f"cost model {cm_equal}/{m} ({cm_equal / m:.1%}); "
          f"greedy step time > optimal's on {sum(r > 1 + 1e-12 for r in cm_step_g)}/{m}, "
          f"< optimal's on {sum(r < 1 - 1e-12 for r in cm_step_g)}/{m}")
    print(f"time: synthetic {synthetic_s:.1f} s, cost model {cm_s:.1f} s")


if __name__ == "__main__":
    main()
