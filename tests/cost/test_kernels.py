"""The compiled loops on small hand-made inputs."""

import numpy as np

from mpipe_tune.cost import kernels


def _succ(num_events, edges):
    src = np.array([s for s, _ in edges], dtype=np.int64)
    dst = np.array([t for _, t in edges], dtype=np.int64)
    by = np.argsort(src, kind="stable")
    ptr = np.zeros(num_events + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=num_events), out=ptr[1:])
    return ptr, dst[by]


def test_topological_order_respects_every_edge_and_reports_a_cycle_by_its_length():
    edges = [(3, 1), (1, 0), (3, 2), (2, 0), (4, 3)]
    order = kernels.topological_order(5, *_succ(5, edges)).tolist()
    assert sorted(order) == [0, 1, 2, 3, 4]
    assert all(order.index(s) < order.index(t) for s, t in edges)
    assert len(kernels.topological_order(3, *_succ(3, [(0, 1), (1, 2), (2, 1)]))) < 3


def test_finish_times_and_makespan_of_a_diamond():
    # 0 -> {1, 2} -> 3: finish(3) = d0 + max(d1, d2) + d3
    durations = np.array([1.0, 2.0, 5.0, 0.5])
    pred_ptr = np.array([0, 0, 1, 2, 4], dtype=np.int64)
    pred_idx = np.array([0, 0, 1, 2], dtype=np.int64)
    topo = np.array([0, 2, 1, 3], dtype=np.int64)
    out = np.empty(4)
    kernels.finish_times(durations, topo, pred_ptr, pred_idx, out)
    assert out.tolist() == [1.0, 3.0, 6.0, 6.5]
    assert kernels.makespan(durations, topo, pred_ptr, pred_idx, np.empty(4)) == 6.5


def test_running_peaks_per_rank_never_below_zero():
    rank = np.array([0, 1, 0, 0, 1], dtype=np.int64)
    delta = np.array([3.0, -1.0, 2.0, -4.0, 2.0])
    assert kernels.running_peaks(rank, delta, 3).tolist() == [5.0, 1.0, 0.0]
