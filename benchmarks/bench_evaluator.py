"""Evaluations per second of the step-time evaluator, beside the networkx reference.

An *evaluation* is what the search does per candidate once the order is compiled: durations for a
layer table (one sampled workload) and the longest path through the order. Also timed: the longest
path alone (the compiled DAG pass), and the networkx reference on the same durations.

    python benchmarks/bench_evaluator.py            # prints a Markdown table
"""

from __future__ import annotations

import platform
import sys
import time

import numpy as np

from mpipe_tune.algebra import parse_schedule
from mpipe_tune.cli import default_cut
from mpipe_tune.cost.durations import DurationModel
from mpipe_tune.cost.layers import CostOptions, build_layer_table
from mpipe_tune.cost.predict import predict
from mpipe_tune.cost.timing import CompiledOrder, longest_path_reference
from mpipe_tune.specs import load_model, load_profile, load_workload


def rate(fn, min_seconds=2.0) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        calls += 1
    return calls / elapsed


def bench(P: int, M: int, model_name="qwen2vl-vit-llama3-8b", profile_name="h100-sxm"):
    model = load_model(model_name)
    profile = load_profile(profile_name)
    options = CostOptions()
    schedule = parse_schedule("transpose,1f1b")
    cut = default_cut(model, 2)
    workloads = [load_workload("balanced", num_microbatches=M, seed=s) for s in range(8)]
    tables = [build_layer_table(model, w, profile, options) for w in workloads]
    result = predict(cut, schedule, model, workloads[0], profile, P, options=options)
    plan = result.plan
    compiled = CompiledOrder(plan)
    durations_model = DurationModel(plan, model, profile, options)
    state = {"k": 0}

    def evaluate():
        state["k"] = (state["k"] + 1) % len(tables)
        return compiled.makespan(durations_model.durations(tables[state["k"]]))

    durations = result.timeline.durations_s
    assert evaluate() > 0
    assert np.array_equal(compiled.finish_times(durations), longest_path_reference(plan, durations))
    return {
        "P": P, "M": M, "events": len(plan.order.events), "edges": len(plan.order.edges),
        "evaluate": rate(evaluate),
        "longest_path": rate(lambda: compiled.finish_times(durations)),
        "networkx": rate(lambda: longest_path_reference(plan, durations), min_seconds=2.0),
    }


def main() -> None:
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
          f"{platform.processor() or 'cpu'}; model qwen2vl-vit-llama3-8b, h100-sxm, <transpose,1f1b>, balanced mix\n")
    print("| P | M | events | edges | evaluations/s (durations + longest path) | longest path only /s | networkx reference /s |")
    print("|---|---|---|---|---|---|---|")
    for P, M in ((8, 16), (16, 128)):
        r = bench(P, M)
        print(f"| {r['P']} | {r['M']} | {r['events']} | {r['edges']} | {r['evaluate']:,.0f} | "
              f"{r['longest_path']:,.0f} | {r['networkx']:,.1f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
