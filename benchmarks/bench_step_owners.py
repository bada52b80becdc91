"""Owner maps chosen per step at run time against the plan's fixed map, on the executor.

Two parts:

- ``policy``: the wall time of choosing one step's owner map, for P up to 64 and M up to 512, on
  synthetic instances (log-normal encodes, a fifth text-only; slack ``w_r = r * u``): ``greedy``,
  and ``optimal`` as the runtime runs it (exact within its node budget, else the greedy map; the
  share of instances that fell back is reported). Also the time of reading the policy's inputs off
  the cost model (the step's round-robin slack and encodes, :meth:`~mpipe_tune.cost._predictor.Predictor.owners`)
  for one real plan.
- ``run``: for every built-in workload mix, a greedy ``<transpose,1f1b>`` plan of
  ``qwen2vl-vit-llama3-8b`` on ``h100-sxm``, P = 8, planned on the mix's sampled step 0, run by the
  real executor with emulated compute (each compute event waits its predicted duration, each
  transfer is a real gloo message, as ``bench_runtime_emulated.py`` does) for 21 sampled steps: once
  with per-step owners, once with the stored (fixed) map on the same steps. Steps 1..20 are
  reported (step 0 is the stored step, where both maps are the same, and pays the warm-up): the cost
  model's prediction and the measured step time of each.

    python benchmarks/bench_step_owners.py [policy|run|all] [--microbatches 16] [--steps 21] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from mpipe_tune.algebra import Candidate, round_robin
from mpipe_tune.cost import choose_owners, greedy_owners
from mpipe_tune.inputs import MIXES
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.search import Evaluator, Problem
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL, PROFILE, P, SEED = "qwen2vl-vit-llama3-8b", "h100-sxm", 8, 0
SIZES = ((8, 32), (8, 128), (64, 128), (64, 512))


def synthetic(rng: np.random.Generator, num_ranks: int, num_microbatches: int):
    encode = rng.lognormal(0.0, 0.8, size=num_microbatches) * (rng.random(num_microbatches) > 0.2)
    u = rng.uniform(0.1, 1.5) * encode.mean() * num_microbatches / num_ranks / max(1, num_ranks - 1)
    return encode.tolist(), [r * u for r in range(num_ranks)]


def _us(seconds) -> str:
    p = np.percentile(np.asarray(seconds) * 1e6, [50, 99])
    return f"{p[0]:.0f} / {p[1]:.0f} / {max(seconds) * 1e6:.0f}"


def policy_times(instances: int) -> list[dict]:
    rng = np.random.default_rng(0)
    choose_owners("optimal", [1.0, 2.0], [0.0, 1.0], fallback=True)  # the compiled loops' first call loads them
    rows = []
    for num_ranks, num_microbatches in SIZES:
        greedy_s, optimal_s, fell_back = [], [], 0
        for _ in range(instances):
            encode, slack = synthetic(rng, num_ranks, num_microbatches)
            start = time.perf_counter()
            greedy_owners(encode, slack)
            greedy_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            choice = choose_owners("optimal", encode, slack, fallback=True)
            optimal_s.append(time.perf_counter() - start)
            fell_back += choice.policy != "optimal"
        rows.append({"P": num_ranks, "M": num_microbatches, "instances": instances, "greedy_s": greedy_s,
                     "optimal_s": optimal_s, "fell_back": fell_back})
    return rows


def inputs_times(num_microbatches: int, repeats: int) -> dict:
    """The time of Predictor.owners (slack off the round-robin re-timing, encodes, policy) on one real plan."""
    from mpipe_tune.cost import CompiledPlan, build_layer_table

    model, profile = load_model(MODEL), load_profile(PROFILE)
    problem = Problem(model, profile, P, num_microbatches, mix="balanced", num_samples=1, seed=SEED)
    evaluator = Evaluator(problem)
    c = Candidate("transpose,1f1b", (model.backbone_start,), P, 1, 1, num_microbatches, "greedy")
    prediction, workload = evaluator.prediction(c)
    # As the runtime holds it: the plan re-timed for the round-robin map once, its timeline per step.
    compiled = CompiledPlan(prediction.plan, model, profile, prediction.options).with_owners(
        round_robin(num_microbatches, P))
    table = build_layer_table(model, workload, profile, prediction.options)
    times = {}
    for policy in ("greedy", "optimal"):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            evaluator.predictor.owners(replace(c, owner_policy=policy), table, compiled=compiled, fallback=True)
            samples.append(time.perf_counter() - start)
        times[policy] = samples
    return times


def make_plans(folder: Path, num_microbatches: int) -> dict[str, str]:
    model, profile = load_model(MODEL), load_profile(PROFILE)
    paths = {}
    for mix in MIXES:
        problem = Problem(model, profile, P, num_microbatches, mix=mix, num_samples=1, seed=SEED)
        c = Candidate("transpose,1f1b", (model.backbone_start,), P, 1, 1, num_microbatches, "greedy")
        prediction, workload = Evaluator(problem).prediction(c)
        path = folder / f"{mix}.json"
        dump_plan(plan_record(prediction, model, workload, profile, PlanInputs(MODEL, (), PROFILE)), path)
        paths[mix] = str(path)
    return paths


def run_mixes(num_microbatches: int, steps: int) -> tuple[dict, float]:
    from mpipe_tune.runtime import disable_backend_autoload, launch_local

    disable_backend_autoload()
    from mpipe_tune.runtime import RunJob, run_jobs

    with tempfile.TemporaryDirectory() as folder:
        paths = make_plans(Path(folder), num_microbatches)
        jobs = [(mix, owners, RunJob(path, steps=steps, compute="emulated", owners=owners, data="sampled"))
                for mix, path in paths.items() for owners in ("per-step", "fixed")]
        started = time.perf_counter()
        results = launch_local(run_jobs, ([job for *_, job in jobs],), P, timeout_s=300.0, deadline_s=3600.0)
        wall_s = time.perf_counter() - started
    out: dict = {}
    for (mix, owners, _job), result in zip(jobs, results):
        s = result["summary"]
        out.setdefault(mix, {})[owners] = {
            "measured_s": s["step_times_s"][1:], "predicted_s": s["predicted_step_times_s"][1:],
            "owners": [step["owners"] for step in s["per_step"]][1:],
            "owners_s": [step["owners_s"] for step in s["per_step"]][1:],
            "prepare_s": [step["prepare_s"] for step in s["per_step"]][1:],
        }
    return out, wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="all", choices=("policy", "run", "all"))
    parser.add_argument("--instances", type=int, default=200, help="synthetic instances per size (default 200)")
    parser.add_argument("--microbatches", type=int, default=16, help="M of the runs (default 16)")
    parser.add_argument("--steps", type=int, default=21, help="steps per run, the first left out (default 21)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    record: dict = {
        "command": "python benchmarks/bench_step_owners.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "versions": {"python": platform.python_version(), "numpy": np.__version__},
    }
    if args.part in ("policy", "all"):
        record["policy"] = policy_times(args.instances)
        record["inputs"] = inputs_times(args.microbatches, 50)
        record["inputs_microbatches"] = args.microbatches
    if args.part in ("run", "all"):
        import torch

        record["versions"]["torch"] = torch.__version__
        record["runs"], record["wall_s"] = run_mixes(args.microbatches, args.steps)
        record["model"], record["profile"], record["pp"], record["microbatches"] = MODEL, PROFILE, P, args.microbatches
    if args.json:
        print(json.dumps(record, indent=1))
        return
    print_record(record)


def print_record(record: dict) -> None:
    """The tables of a record (as ``--json`` prints it)."""
    print(f"{record['machine']}; " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()) + f"; {record['date']}\n")
    if "policy" in record:
        print("| P | M | greedy us p50 / p99 / max | optimal (runtime) us p50 / p99 / max | optimal fell back to greedy |")
        print("|---:|---:|---|---|---:|")
        for row in record["policy"]:
            print(f"| {row['P']} | {row['M']} | {_us(row['greedy_s'])} | {_us(row['optimal_s'])} | "
                  f"{row['fell_back']}/{row['instances']} |")
        print(f"\nPredictor.owners on {MODEL} ({PROFILE}), P={P} M={record['inputs_microbatches']} (round-robin slack off the "
              f"re-timed plan, encodes, policy): " + ", ".join(f"{p} {_us(s)} us" for p, s in record["inputs"].items()))
    if "runs" in record:
        steps = len(next(iter(record["runs"].values()))["per-step"]["measured_s"])
        print(f"\n{MODEL} on {PROFILE}, greedy <transpose,1f1b>, P={P} M={record['microbatches']}, emulated compute, "
              f"steps 1..{steps} of each mix (mean over steps; wall {record['wall_s']:.0f} s)\n")
        print("| mix | maps differ | per-step predicted ms | per-step measured ms | fixed predicted ms | "
              "fixed measured ms | predicted gain | measured gain | step plan ms (owners ms) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for mix, both in record["runs"].items():
            a, b = both["per-step"], both["fixed"]
            differ = sum(x != y for x, y in zip(a["owners"], b["owners"]))
            pa, ma, pb, mb = (statistics.mean(v) for v in (a["predicted_s"], a["measured_s"], b["predicted_s"],
                                                            b["measured_s"]))
            print(f"| {mix} | {differ}/{len(a['owners'])} | {pa * 1e3:.1f} | {ma * 1e3:.1f} | {pb * 1e3:.1f} | "
                  f"{mb * 1e3:.1f} | {(pb / pa - 1) * 100:+.2f}% | {(mb / ma - 1) * 100:+.2f}% | "
                  f"{statistics.mean(a['prepare_s']) * 1e3:.1f} ({statistics.mean(a['owners_s']) * 1e3:.2f}) |")


if __name__ == "__main__":
    main()
