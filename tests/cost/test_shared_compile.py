"""What the cost model makes once per order object (EventArrays.once) gives what a plan compiled on its own gives.

Two candidates that differ only in their slabs share derive's order object, so the second one's
compile reuses what reads the order alone (the compiled order, the stage and transfer indices, the
live tensors). Compiling the second one's plan with an order object of its own, built from its event
objects (the columns then read off the objects, nothing shared), must give the same arrays and step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.algebra import Cut, Order, Owners, derive, parse_schedule
from mpipe_tune.cost import CompiledPlan, CostOptions, build_layer_table, load_profile

from conftest import make_model, uniform_workload


def _unshared(plan):
    o = plan.order
    return replace(plan, order=Order(o.events, o.edges, o.nodes, o.topo))


@pytest.mark.parametrize("schedule, cut, P, M, slabs", [
    ("transpose,1f1b", (2,), 4, 8, ((3, 1, 1, 1), (1, 1, 1, 3))),
    ("transpose,1f1b,1f1b", (2, 8), 2, 4, ((4, 2, 2, 4), (2, 4, 4, 2))),
    ("transpose,zb1p", (2,), 3, 6, ((2, 2, 2), (1, 2, 3))),
    ("1f1b", (), 2, 4, ((2, 6), (5, 3))),
])
def test_a_compile_that_reuses_the_shared_order_equals_one_on_its_own(schedule, cut, P, M, slabs):
    blocks = ["encoder"] * 2 + ["llm"] * 6 if cut else ["llm"] * 8
    if len(cut) == 2:
        blocks = ["encoder"] * 2 + ["llm"] * 12
    model = make_model(blocks)
    profile, options = load_profile("h100-sxm"), CostOptions()
    table = build_layer_table(model, uniform_workload(M, 3, 5), profile, options)
    region_counts = [slabs[0][i:i + P] for i in range(0, len(slabs[0]), P)], [slabs[1][i:i + P] for i in range(0, len(slabs[1]), P)]
    first, second = (derive(Cut(cut), parse_schedule(schedule), model, P, M, Owners(slab_counts=tuple(map(tuple, c))))
                     for c in region_counts)
    assert first.order is second.order
    CompiledPlan(first, model, profile, options).timeline(table)  # makes the shared parts for the order
    shared, alone = (CompiledPlan(p, model, profile, options) for p in (second, _unshared(second)))
    for name in ("fwd_hi", "fwd_lo", "bwd_hi", "bwd_lo", "coll_flat", "alpha", "beta", "wgrad_bwd"):
        assert np.array_equal(getattr(shared.durations_model, name), getattr(alone.durations_model, name)), name
    for name in ("rank", "alloc_event", "free_event", "hi", "lo"):
        assert np.array_equal(getattr(shared.memory_layout, name), getattr(alone.memory_layout, name)), name
    t, u = shared.timeline(table), alone.timeline(table)
    assert np.array_equal(t.durations_s, u.durations_s) and np.array_equal(t.finish_s, u.finish_s)
    assert shared.memory(table, t).peak_bytes == alone.memory(table, u).peak_bytes
