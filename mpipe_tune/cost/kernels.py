"""The cost model's hot loops, compiled with numba (``cache=True``: compiled once per install).

Each kernel is a plain loop over flat arrays that a :class:`~mpipe_tune.cost.compiled.CompiledPlan`
holds; they do the same floating-point operations in the same order as the readable numpy and
networkx code they replace, so their results are bit-for-bit those of the references
(:func:`mpipe_tune.cost.timing.longest_path_reference`, the tests check it).

Why numba: the longest path is a dependent chain through a deep, narrow graph (a 1F1B order at
P=16, M=128 has 8,594 events on 582 levels), so a level-synchronous numpy pass pays several numpy
calls per level and barely beats a plain Python loop; the compiled loop is 20-40 times faster than
either (``benchmarks/bench_evaluator.py --choices``; benchmarks/README.md records the measurements).
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


@_jit
def event_durations(fwd_prefix, bwd_prefix, boundary_bytes, fwd_idx, fwd_hi, fwd_lo, bwd_idx, bwd_hi, bwd_lo,
                    coll_idx, coll_flat, alpha_s, beta_s_per_byte, reduce_idx, reduce_s, out):
    """Seconds per event into ``out`` (zeroed first): a compute event's slab is a difference of the
    layer table's per-microbatch prefix sums, a transfer ``alpha + beta * n``, a reduce its fixed cost."""
    out[:] = 0.0
    for k in range(fwd_idx.shape[0]):
        out[fwd_idx[k]] = fwd_prefix[fwd_hi[k]] - fwd_prefix[fwd_lo[k]]
    for k in range(bwd_idx.shape[0]):
        out[bwd_idx[k]] = bwd_prefix[bwd_hi[k]] - bwd_prefix[bwd_lo[k]]
    for k in range(coll_idx.shape[0]):
        out[coll_idx[k]] = alpha_s[k] + beta_s_per_byte[k] * boundary_bytes[coll_flat[k]]
    for k in range(reduce_idx.shape[0]):
        out[reduce_idx[k]] = reduce_s[k]


@_jit
def finish_times(durations, topo, pred_ptr, pred_idx, out):
    """``finish(e) = duration(e) + max(0, finish(p) for p in preds(e))`` in topological order."""
    for k in range(topo.shape[0]):
        e = topo[k]
        start = 0.0
        for j in range(pred_ptr[e], pred_ptr[e + 1]):
            f = out[pred_idx[j]]
            if f > start:
                start = f
        out[e] = start + durations[e]


@_jit
def makespan(durations, topo, pred_ptr, pred_idx, scratch):
    """The largest finish time (0 for an empty order); ``scratch`` holds the finish times after."""
    finish_times(durations, topo, pred_ptr, pred_idx, scratch)
    best = 0.0
    for k in range(scratch.shape[0]):
        if scratch[k] > best:
            best = scratch[k]
    return best


@_jit
def running_peaks(rank, delta, num_ranks):
    """Per rank, the largest running sum (at least 0) of ``delta`` in the given order."""
    running = np.zeros(num_ranks)
    peak = np.zeros(num_ranks)
    for k in range(delta.shape[0]):
        r = rank[k]
        running[r] += delta[k]
        if running[r] > peak[r]:
            peak[r] = running[r]
    return peak
