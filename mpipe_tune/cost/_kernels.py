"""The cost model's hot loops (:func:`mpipe_tune.jit.kernel`: plain Python until compiling them pays, then numba).

Each kernel is a plain loop over flat arrays that a :class:`~mpipe_tune.cost._compiled.CompiledPlan`
holds; they do the same floating-point operations in the same order as the readable numpy and
networkx code they replace, so their results are bit-for-bit those of the references
(:func:`mpipe_tune.cost._timing.longest_path_reference`, the tests check it).

Why numba: the longest path is a dependent chain through a deep, narrow graph (a 1F1B order at
P=16, M=128 has 8,594 events on 582 levels), so a level-synchronous numpy pass pays several numpy
calls per level and barely beats a plain Python loop; the compiled loop is 20-40 times faster than
either (``benchmarks/bench_evaluator.py --choices``; benchmarks/README.md records the measurements).
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.jit import kernel


@kernel
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


@kernel
def finish_times(durations, topo, pred_ptr, pred_idx, out):
    """``finish(e) = duration(e) + max(0, finish(p) for p in preds(e))`` in topological order, into
    ``out``; returns the largest (the makespan, 0 for an empty order)."""
    best = 0.0
    for k in range(topo.shape[0]):
        e = topo[k]
        start = 0.0
        for j in range(pred_ptr[e], pred_ptr[e + 1]):
            f = out[pred_idx[j]]
            if f > start:
                start = f
        out[e] = start + durations[e]
        if out[e] > best:
            best = out[e]
    return best


@kernel
def step_makespan(fwd_prefix, bwd_prefix, boundary_bytes, ints, rates, topo, pred_ptr, pred_idx, durations, finish):
    """:func:`event_durations`, the optimizer update added to its events, then :func:`finish_times`, in one
    call over a plan's duration pass packed into two flat arrays
    (:meth:`~mpipe_tune.cost._durations.DurationModel.packed`): one dispatch and no temporaries in the search's
    hot loop, the same operations in the same order. ``ints``: the section sizes (forwards, backwards,
    transfers, reduces, updates), then the forwards' event, slab-end and slab-start indices, the backwards'
    alike, the transfers' events and boundary indices, the reduces' and the updates' events; ``rates``: the
    transfers' alphas and betas, the reduces' and the updates' seconds; the order as :func:`finish_times`
    reads it. Returns the makespan; ``durations`` and ``finish`` hold the events' seconds and finish times. Its
    last loop is :func:`finish_times`' own, written out: a kernel cannot call another (each is a
    :class:`~mpipe_tune.jit.Kernel` that picks its tier per call), and a second dispatch is what this one saves."""
    nf, nb, nc, nr, nu = ints[0], ints[1], ints[2], ints[3], ints[4]
    durations[:] = 0.0
    p = 5
    for k in range(nf):
        durations[ints[p + k]] = fwd_prefix[ints[p + nf + k]] - fwd_prefix[ints[p + 2 * nf + k]]
    p += 3 * nf
    for k in range(nb):
        durations[ints[p + k]] = bwd_prefix[ints[p + nb + k]] - bwd_prefix[ints[p + 2 * nb + k]]
    p += 3 * nb
    for k in range(nc):
        durations[ints[p + k]] = rates[k] + rates[nc + k] * boundary_bytes[ints[p + nc + k]]
    p += 2 * nc
    for k in range(nr):
        durations[ints[p + k]] = rates[2 * nc + k]
    p += nr
    for k in range(nu):
        e = ints[p + k]
        durations[e] = durations[e] + rates[2 * nc + nr + k]
    best = 0.0
    for k in range(topo.shape[0]):
        e = topo[k]
        start = 0.0
        for j in range(pred_ptr[e], pred_ptr[e + 1]):
            f = finish[pred_idx[j]]
            if f > start:
                start = f
        finish[e] = start + durations[e]
        if finish[e] > best:
            best = finish[e]
    return best


@kernel
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


@kernel
def greedy_owners(encode_s, slack_s, order, out):
    """The greedy owner map (:func:`mpipe_tune.cost._owners.greedy_owners`) into ``out``: microbatches
    in ``order`` (heaviest encode first), each to the rank with the most slack left, ties to the lowest."""
    remaining = slack_s.copy()
    for k in range(order.shape[0]):
        m = order[k]
        best = 0
        for r in range(1, remaining.shape[0]):
            if remaining[r] > remaining[best]:
                best = r
        out[m] = best
        remaining[best] -= encode_s[m]


@kernel
def owners_branch_and_bound(encode_s, slack_s, order, incumbent, max_nodes, out):
    """The exact min-max owner search of :func:`mpipe_tune.cost._owners.optimal_owners` into ``out``,
    as an explicit depth-first walk over the microbatches in ``order`` (heaviest encode first), from
    the ``incumbent`` map: at each depth the ranks are tried by increasing load (a stable sort), a
    load already tried at that depth is skipped, and a branch is cut when its maximum, or the level
    that spreads the remaining work evenly, reaches the incumbent's ``max_r (E_r - w_r)`` (less a
    relative 1e-12). Returns True when it gave up after ``max_nodes`` nodes (``out`` unset)."""
    M, P = encode_s.shape[0], slack_s.shape[0]
    excess = -slack_s
    for m in range(M):
        excess[incumbent[m]] += encode_s[m]
    best_value = excess.max()
    tolerance = 1e-12 * max(1.0, abs(best_value))
    work = encode_s[order]
    best = incumbent[order]
    suffix = np.zeros(M + 1)
    for i in range(M - 1, -1, -1):
        suffix[i] = suffix[i + 1] + work[i]
    load = -slack_s
    assign = np.zeros(M, dtype=np.int64)
    ranks = np.empty((M, P), dtype=np.int64)
    position = np.zeros(M, dtype=np.int64)
    tried = np.empty((M, P))
    num_tried = np.zeros(M, dtype=np.int64)
    current = np.empty(M + 1)
    current[0] = -np.inf
    nodes = 0
    i = 0
    entering = True
    while True:
        if entering:
            nodes += 1
            if nodes > max_nodes:
                return True
            leaf_or_cut = i == M
            if leaf_or_cut:
                if current[M] < best_value - tolerance:
                    best_value = current[M]
                    best[:] = assign
            else:
                total = 0.0
                for r in range(P):
                    total += load[r]
                level = (total + suffix[i]) / P
                leaf_or_cut = max(current[i], level) >= best_value - tolerance
            if leaf_or_cut:
                if i == 0:
                    break
                i -= 1
                entering = False
                continue
            ranks[i] = np.argsort(load, kind="mergesort")
            position[i] = 0
            num_tried[i] = 0
        else:  # back from depth i + 1: undo this depth's choice
            load[assign[i]] -= work[i]
        descended = False
        while position[i] < P:
            r = ranks[i, position[i]]
            position[i] += 1
            value = load[r]
            seen = False
            for k in range(num_tried[i]):
                if tried[i, k] == value:
                    seen = True
                    break
            if seen:
                continue
            tried[i, num_tried[i]] = value
            num_tried[i] += 1
            new_load = value + work[i]
            if max(current[i], new_load) >= best_value - tolerance:
                break  # ranks are tried by load: every later one is at least as bad
            load[r] = new_load
            assign[i] = r
            current[i + 1] = max(current[i], new_load)
            descended = True
            break
        if descended:
            i += 1
            entering = True
        elif i == 0:
            break
        else:
            i -= 1
            entering = False
    for k in range(M):
        out[order[k]] = best[k]
    return False
