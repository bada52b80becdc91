"""The executor against the cost model: emulated compute, real transfers, P = 8, M = 32.

Two plans of the same model, hardware profile and workload are run by the real executor with
``--compute emulated``: every compute event waits its predicted duration, every transfer is a real
gloo message (one float64 carrying the sender's clock; the receiver also waits the transfer's
predicted link time), the ReplicaGroup reduce is a real all-reduce followed by its predicted time.

- ``<transpose, 1f1b>``: the encoder replicated on every rank, each rank encoding its own microbatches;
- the Megatron-LM-style baseline: one ``1f1b`` region, the whole encoder in pipeline stage 0 together
  with that stage's share of the backbone (backbone layers balanced over the P stages by predicted cost).

It prints the measured step time (median of the steps after the first) beside the predicted one, and
the measured speedup of the first over the second beside the predicted speedup.

    python benchmarks/bench_runtime_emulated.py [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from mpipe_tune.algebra import balanced_counts, Candidate
from mpipe_tune.cost import CostOptions, build_layer_table, layer_weights, predict
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model, load_workload

MODEL, PROFILE, MIX, SEED = "qwen2vl-vit-llama3-8b", "h100-sxm", "balanced", 0


def megatron_slabs(model, weights, P: int) -> tuple[tuple[int, ...], ...]:
    """Stage 0 holds the whole encoder plus its share of the backbone; the backbone is balanced over P."""
    first_llm = model.backbone_start
    counts = list(balanced_counts(weights[first_llm:], P))
    counts[0] += first_llm
    return (tuple(counts),)


def make_plans(folder: Path, P: int, M: int) -> dict[str, str]:
    model, profile = load_model(MODEL), load_profile(PROFILE)
    workload = load_workload(MIX, num_microbatches=M, seed=SEED)
    options = CostOptions()
    first_llm = model.backbone_start
    weights = layer_weights(model, build_layer_table(model, workload, profile, options))
    candidates = {
        "transpose,1f1b": Candidate("transpose,1f1b", (first_llm,), pp=P, tp=1, dp=1, num_microbatches=M),
        "megatron 1f1b": Candidate("1f1b", (), pp=P, tp=1, dp=1, num_microbatches=M,
                                   slab_counts=megatron_slabs(model, weights, P)),
    }
    return write_plans(folder, candidates, model, workload, profile, options)


def baseline_plans(folder: Path, P: int, M: int, names) -> dict[str, str]:
    """Plan files of the named baselines (:mod:`mpipe_tune.search._baselines`: ``megatron``,
    ``disttrain``, ``vpp``, ``gpipe``, ``mpipe-rr``) at pp ``P``, M microbatches, tp = dp = 1, on the
    same model, profile and workload; a baseline that does not exist at ``P`` is left out."""
    from mpipe_tune.search import baseline

    model, profile = load_model(MODEL), load_profile(PROFILE)
    workload = load_workload(MIX, num_microbatches=M, seed=SEED)
    options = CostOptions()
    folder.mkdir(parents=True, exist_ok=True)
    candidates = {}
    for name in names:
        c = baseline(name, model, P, 1, 1, M, vpp_microbatches=(M,))
        if c is not None:
            candidates[name] = c
    return write_plans(folder, candidates, model, workload, profile, options)


def write_plans(folder: Path, candidates: dict[str, Candidate], model, workload, profile,
                options: CostOptions) -> dict[str, str]:
    """Predict each named candidate and write its plan file into ``folder``; name -> path."""
    paths = {}
    for name, c in candidates.items():
        prediction = predict(c, model, workload, profile, options)
        path = folder / f"{name.replace(' ', '-').replace(',', '_')}.json"
        dump_plan(plan_record(prediction, model, workload, profile, PlanInputs(MODEL, (), PROFILE)), path)
        paths[name] = str(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mpipe_tune.runtime import disable_backend_autoload, launch_local

    disable_backend_autoload()
    import torch

    from mpipe_tune.runtime import RunJob, run_jobs

    with tempfile.TemporaryDirectory() as folder:
        paths = make_plans(Path(folder), args.pp, args.microbatches)
        jobs = [RunJob(path, steps=args.steps, compute="emulated") for path in paths.values()]
        started = time.perf_counter()
        results = launch_local(run_jobs, (jobs,), args.pp, timeout_s=300.0, deadline_s=1800.0)
        wall_s = time.perf_counter() - started
    rows = {name: r["summary"] for name, r in zip(paths, results)}
    mpipe, base = rows["transpose,1f1b"], rows["megatron 1f1b"]
    record = {
        "command": "python benchmarks/bench_runtime_emulated.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "model": MODEL, "profile": PROFILE, "workload": f"{MIX}@seed{SEED}", "pp": args.pp, "microbatches": args.microbatches,
        "wall_s": wall_s,
        "runs": {name: {k: s[k] for k in ("predicted_step_s", "measured_step_s", "ratio", "step_times_s")}
                 for name, s in rows.items()},
        "predicted_speedup": base["predicted_step_s"] / mpipe["predicted_step_s"],
        "measured_speedup": base["measured_step_s"] / mpipe["measured_step_s"],
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return
    print(f"{MODEL} on {PROFILE}, {MIX}@seed{SEED}, P={args.pp} M={args.microbatches}, emulated compute, "
          f"{args.steps} steps (measured = median of steps 2..{args.steps})\n")
    print("| schedule | predicted ms | measured ms | measured / predicted |")
    print("|---|---:|---:|---:|")
    for name, s in rows.items():
        print(f"| {name} | {s['predicted_step_s'] * 1e3:.1f} | {s['measured_step_s'] * 1e3:.1f} | {s['ratio']:.3f} |")
    print(f"\nspeedup of transpose,1f1b over the baseline: predicted {record['predicted_speedup']:.3f}, "
          f"measured {record['measured_speedup']:.3f}")
    print(f"{record['machine']}; python {record['versions']['python']}, torch {record['versions']['torch']}; {record['date']}")


if __name__ == "__main__":
    main()
