"""Evaluations per second of the compiled plan, beside the networkx reference.

An *evaluation* is what the search does per candidate and sampled step once the plan is compiled:
event durations for a layer table (its prefix sums prepared once per table, as the search's
evaluator caches them with the table) and the longest path through the order, giving the step time
(:meth:`CompiledPlan.makespan`). A *cold* evaluation is a new candidate from scratch: derive,
compile, evaluate (the layer table excluded: the search builds one per sampled step and setting,
shared by every cut and slab choice). An *owner change* re-times a compiled plan for a new owner map
of the transposed region (:meth:`CompiledPlan.with_owners`) and evaluates it.

    python benchmarks/bench_evaluator.py            # a Markdown table
    python benchmarks/bench_evaluator.py --json     # a JSON list, one object per (P, M)
    python benchmarks/bench_evaluator.py --choices  # the longest-path implementations compared
    python benchmarks/bench_evaluator.py --tier python  # the kernels as Python (a short search's tier)
    python benchmarks/bench_evaluator.py --clock cpu    # rates per CPU second (a shared, loaded machine)

The kernels run compiled (``--tier compiled``, the default: what a search runs once a kernel has spent
a second as Python, :mod:`mpipe_tune.jit`; the first, untimed call of each loop compiles or loads them).

Every run asserts that the compiled finish times equal the networkx reference exactly, for the
derived plan and for a re-timed owner map (checked against a fresh derive too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from mpipe_tune import jit
from mpipe_tune.algebra import Cut, Owners, derive, parse_schedule
from mpipe_tune.cost import (
    CompiledPlan, table_sums, CostOptions, build_layer_table, layer_weights, longest_path_reference, load_profile,
)
from mpipe_tune.inputs import load_model, load_workload

SIZES = ((8, 16), (16, 128), (32, 256))
MODEL, PROFILE = "qwen2vl-vit-llama3-8b", "h100-sxm"


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
"""What a rate is per: a second of wall time (default), or of this process's CPU time (``--clock cpu``:
comparable across runs on a shared, loaded machine, where wall rates swing with the other jobs)."""
clock = CLOCK["wall"]


def rate(fn, min_seconds=2.0, max_calls=None) -> float:
    fn()
    calls, start = 0, clock()
    while ((elapsed := clock() - start) < min_seconds and calls != max_calls) or calls < 3:
        fn()
        calls += 1
    return calls / elapsed


def slab_choices(counts: tuple[int, ...], n: int, rng) -> list[tuple[int, ...]]:
    """Up to ``n`` distinct slab count vectors other than ``counts`` (same layers, every slab at least one),
    each a few random one-layer moves between slabs away from it, in the order they were found."""
    seen, out = {tuple(counts)}, []
    for _ in range(50 * n):
        c = list(counts)
        for _ in range(int(rng.integers(1, 7))):
            i, j = rng.integers(0, len(c), 2)
            if i != j and c[i] > 1:
                c[i], c[j] = c[i] - 1, c[j] + 1
        if tuple(c) not in seen:
            seen.add(tuple(c))
            out.append(tuple(c))
            if len(out) == n:
                break
    return out


def setup(P: int, M: int):
    model, profile, options = load_model(MODEL), load_profile(PROFILE), CostOptions()
    schedule = parse_schedule("transpose,1f1b")
    cut = Cut((next(i for i, u in enumerate(model.layers) if u.block == "llm"),))
    tables = [build_layer_table(model, load_workload("balanced", num_microbatches=M, seed=s), profile, options)
              for s in range(8)]
    owners = Owners(layer_weights=layer_weights(model, tables[0]))
    plan = derive(cut, schedule, model, P, M, owners)
    slabs = Owners(slab_counts=(plan.placement[1].owner.counts(),))
    return model, profile, options, schedule, cut, tables, plan, slabs


def bench(P: int, M: int) -> dict:
    model, profile, options, schedule, cut, tables, plan, slabs = setup(P, M)
    sums = [table_sums(t, model) for t in tables]
    compiled = CompiledPlan(plan, model, profile, options)
    k = {"i": 0}

    def evaluate():
        k["i"] = (k["i"] + 1) % len(sums)
        return compiled.makespan(sums[k["i"]])

    rng = np.random.default_rng(0)
    choices = slab_choices(slabs.slab_counts[0], 20_000, rng)
    new_maps = [tuple(int(r) for r in rng.integers(0, P, M)) for _ in range(len(choices))]
    c = {"slabs": 0, "both": 0}

    def cold():  # a new candidate: slabs no call used before
        k["i"] = (k["i"] + 1) % len(sums)
        counts, c["slabs"] = choices[c["slabs"]], c["slabs"] + 1
        fresh = CompiledPlan(derive(cut, schedule, model, P, M, Owners(slab_counts=(counts,))), model, profile, options)
        return fresh.makespan(sums[k["i"]])

    def cold_new_order():  # a new candidate whose order no call built before: new slabs and a new owner map
        k["i"] = (k["i"] + 1) % len(sums)
        counts, owners, c["both"] = choices[c["both"]], new_maps[c["both"]], c["both"] + 1
        plan = derive(cut, schedule, model, P, M, Owners(slab_counts=(counts,), microbatch=owners))
        return CompiledPlan(plan, model, profile, options).makespan(sums[k["i"]])

    maps = [tuple(int(r) for r in rng.integers(0, P, M)) for _ in range(16)]

    def owner_change():
        k["i"] = (k["i"] + 1) % len(maps)
        return compiled.with_owners(maps[k["i"]]).makespan(sums[k["i"] % len(sums)])

    check_reference(compiled, tables[0], maps[0], cut, schedule, model, P, M, slabs)
    check_cold(choices[-1], tables[0], cut, schedule, model, profile, options, P, M)
    # derive and compile alone, each call a new order (a new owner map): nothing kept serves it.
    fresh_maps = iter(tuple(int(r) for r in rng.integers(0, P, M)) for _ in range(100_000))
    derive_s = 1.0 / rate(lambda: derive(cut, schedule, model, P, M, Owners(slab_counts=slabs.slab_counts,
                                                                            microbatch=next(fresh_maps))), 1.0)
    plans = [derive(cut, schedule, model, P, M, Owners(slab_counts=slabs.slab_counts, microbatch=next(fresh_maps)))
             for _ in range(min(2000, max(8, int(2.0 / derive_s))))]
    compile_s = 1.0 / rate(lambda: CompiledPlan(plans.pop(), model, profile, options), 1.0, max_calls=len(plans) - 2)
    return {
        "P": P, "M": M, "events": compiled.num_events, "edges": len(plan.order.edges),
        "evals_per_s": rate(evaluate), "cold_per_s": rate(cold, max_calls=len(choices) - 2),
        "cold_new_order_per_s": rate(cold_new_order, max_calls=len(choices) - 2),
        "owner_change_per_s": rate(owner_change),
        "derive_ms": derive_s * 1e3, "compile_ms": compile_s * 1e3,
    }


def check_reference(compiled, table, owners, cut, schedule, model, P, M, slabs) -> None:
    """The compiled finish times equal networkx's, for the plan and for a re-timed owner map."""
    durations = compiled.durations(table)
    assert np.array_equal(compiled.order.finish_times(durations), longest_path_reference(compiled.plan, durations))
    retimed = compiled.with_owners(owners)
    fresh = derive(cut, schedule, model, P, M, Owners(slab_counts=slabs.slab_counts, microbatch=owners))
    assert retimed.events() == fresh.order.events
    durations = retimed.durations(table)
    assert np.array_equal(retimed.order.finish_times(durations), longest_path_reference(fresh, durations))


def check_cold(counts, table, cut, schedule, model, profile, options, P, M) -> None:
    """A cold candidate whose derive reused a kept order (the slabs differ, the order is the same) has the
    networkx reference's finish times too."""
    plan = derive(cut, schedule, model, P, M, Owners(slab_counts=(counts,)))
    compiled = CompiledPlan(plan, model, profile, options)
    durations = compiled.durations(table)
    assert np.array_equal(compiled.order.finish_times(durations), longest_path_reference(plan, durations))


def choices(P: int, M: int) -> dict:
    """Finish times per second by three implementations of the same longest path over one order."""
    model, profile, options, _, _, tables, plan, _ = setup(P, M)
    compiled = CompiledPlan(plan, model, profile, options)
    order = compiled.order
    durations = compiled.durations(tables[0])
    python_preds = [order.pred_idx[order.pred_ptr[e]:order.pred_ptr[e + 1]].tolist() for e in range(order.num_events)]
    topo = order.topo.tolist()
    position = np.empty(order.num_events, dtype=np.int64)
    position[order.topo] = np.arange(order.num_events)
    by_position = [tuple(position[python_preds[e]].tolist()) for e in topo]

    def python_loop():  # the previous CompiledOrder: plain lists in topological positions
        d = durations[order.topo].tolist()
        finish = [0.0] * order.num_events
        for k, preds in enumerate(by_position):
            start = 0.0
            for q in preds:
                f = finish[q]
                if f > start:
                    start = f
            finish[k] = start + d[k]
        out = np.empty(order.num_events)
        out[order.topo] = finish
        return out

    # Level-synchronous numpy: events grouped by depth, one vectorised max-reduce per level.
    depth = np.zeros(order.num_events, dtype=np.int64)
    for e in topo:
        preds = python_preds[e]
        depth[e] = 1 + max(depth[p] for p in preds) if preds else 0
    levels = []
    for level in range(int(depth.max()) + 1):
        members = np.flatnonzero(depth == level)
        counts = order.pred_ptr[members + 1] - order.pred_ptr[members]
        has = counts > 0
        flat = np.concatenate([order.pred_idx[order.pred_ptr[e]:order.pred_ptr[e + 1]] for e in members[has]]
                              or [np.zeros(0, dtype=np.int64)])
        starts = np.concatenate(([0], np.cumsum(counts[has])[:-1])) if has.any() else np.zeros(0, dtype=np.int64)
        levels.append((members, has, flat, starts))

    def level_numpy():
        finish = np.zeros(order.num_events)
        for members, has, flat, starts in levels:
            start = np.zeros(len(members))
            if len(flat):
                start[has] = np.maximum.reduceat(finish[flat], starts)
            finish[members] = start + durations[members]
        return finish

    reference = order.finish_times(durations)
    assert np.array_equal(python_loop(), reference) and np.array_equal(level_numpy(), reference)
    return {"P": P, "M": M, "events": order.num_events, "levels": len(levels),
            "python_per_s": rate(python_loop, 1.0), "level_numpy_per_s": rate(level_numpy, 1.0),
            "numba_per_s": rate(lambda: order.finish_times(durations), 1.0)}


def header() -> str:
    import numba

    load = os.getloadavg()
    return (f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}, "
            f"{platform.machine()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; model {MODEL}, "
            f"{PROFILE}, <transpose,1f1b>, balanced mix; rates per {'CPU' if clock is CLOCK['cpu'] else 'wall'} second")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--choices", action="store_true", help="compare longest-path implementations")
    parser.add_argument("--tier", choices=jit.TIERS, default="compiled",
                        help="run the kernels compiled (default), as Python, or by the search's rule (auto)")
    parser.add_argument("--clock", choices=CLOCK, default="wall",
                        help="rates per wall second (default) or per CPU second of this process (a shared machine)")
    args = parser.parse_args()
    global clock
    clock = CLOCK[args.clock]
    with jit.tier(args.tier):
        run(args)


def run(args) -> None:
    if args.choices:
        rows = [choices(P, M) for P, M in SIZES]
        if args.json:
            print(json.dumps(rows, indent=2))
            return
        print(header() + "\n")
        print("| P | M | events | levels | python loop /s | level-synchronous numpy /s | numba /s |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['P']} | {r['M']} | {r['events']} | {r['levels']} | {r['python_per_s']:,.0f} | "
                  f"{r['level_numpy_per_s']:,.0f} | {r['numba_per_s']:,.0f} |")
        return
    if args.json:
        print(json.dumps([bench(P, M) for P, M in SIZES], indent=2))
        return
    print(header() + "\n")
    print("| P | M | events | edges | evaluations/s | cold (derive + compile + evaluate) /s "
          "| cold, new order /s | owner change /s | derive ms (new order) | compile ms (new order) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for P, M in SIZES:
        r = bench(P, M)
        print(f"| {r['P']} | {r['M']} | {r['events']} | {r['edges']} | {r['evals_per_s']:,.0f} | "
              f"{r['cold_per_s']:,.1f} | {r['cold_new_order_per_s']:,.1f} | {r['owner_change_per_s']:,.0f} | "
              f"{r['derive_ms']:.2f} | "
              f"{r['compile_ms']:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
