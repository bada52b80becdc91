"""derive's compiled topological sort: Kahn's order exactly as the plain Python loop gives it."""

import numpy as np
import pytest

from mpipe_tune.algebra import Cut, Owners, derive, parse_schedule, topological_order

from conftest import make_model
from test_derive_reference import reference_kahn


def _columns(edges):
    return np.array([s for s, _ in edges], dtype=np.int64), np.array([t for _, t in edges], dtype=np.int64)


def test_topological_order_respects_every_edge_and_reports_a_cycle_by_its_length():
    edges = [(3, 1), (1, 0), (3, 2), (2, 0), (4, 3)]
    order = topological_order(5, *_columns(edges)).tolist()
    assert sorted(order) == [0, 1, 2, 3, 4]
    assert all(order.index(s) < order.index(t) for s, t in edges)
    assert len(topological_order(3, *_columns([(0, 1), (1, 2), (2, 1)]))) < 3


@pytest.mark.parametrize("schedule, cut, P, M", [
    ("transpose,1f1b", (4,), 4, 8), ("1f1b,1f1b", (6,), 2, 4), ("transpose,gpipe", (4,), 3, 5), ("1f1b", (), 4, 16),
    ("transpose,1f1b", (4,), 8, 96),  # 5,000 events: beyond the random candidates of test_derive_reference
])
def test_derive_sorts_into_the_order_of_the_python_loop(schedule, cut, P, M):
    model = make_model(["encoder"] * 4 + ["llm"] * 8, trainable=[False] * 2 + [True] * 10)
    plan = derive(Cut(cut), parse_schedule(schedule), model, P, M, Owners())
    assert plan.order.topo == tuple(reference_kahn(len(plan.order.events), plan.order.edges))
