"""The cost model's kernels on small hand-made inputs, as Python and compiled."""

import numpy as np
import pytest

from mpipe_tune import jit
from mpipe_tune.cost import _kernels as kernels


@pytest.fixture(params=["python", "compiled"], autouse=True)
def each_tier(request):
    with jit.tier(request.param):
        yield


def test_finish_times_of_a_diamond_and_their_largest():
    # 0 -> {1, 2} -> 3: finish(3) = d0 + max(d1, d2) + d3
    durations = np.array([1.0, 2.0, 5.0, 0.5])
    pred_ptr = np.array([0, 0, 1, 2, 4], dtype=np.int64)
    pred_idx = np.array([0, 0, 1, 2], dtype=np.int64)
    topo = np.array([0, 2, 1, 3], dtype=np.int64)
    out = np.empty(4)
    assert kernels.finish_times(durations, topo, pred_ptr, pred_idx, out) == 6.5  # the makespan
    assert out.tolist() == [1.0, 3.0, 6.0, 6.5]


def test_running_peaks_per_rank_never_below_zero():
    rank = np.array([0, 1, 0, 0, 1], dtype=np.int64)
    delta = np.array([3.0, -1.0, 2.0, -4.0, 2.0])
    assert kernels.running_peaks(rank, delta, 3).tolist() == [5.0, 1.0, 0.0]
