"""The algebra's one hot loop (:func:`mpipe_tune.jit.kernel`: Python, then numba): Kahn's topological sort.

The ready events are a stack, initially every source with the lowest index on top, and an event's
successors are released in the order of their edges: the plain Python loop of
``tests/algebra/test_derive_reference.py`` step for step, so both give the same order. derive sorts
every order with it (a Python loop was a third of derive's time at P=32, M=256, and half of it at
P=8, M=16 once the rest was columns); the cost model sorts re-timed orders with it too.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.jit import kernel


@kernel
def topological_order(num_events, src, dst):
    """Kahn's algorithm over edge columns (edge ``k`` is ``src[k] -> dst[k]``); fewer than ``num_events``
    entries means a cycle."""
    # Successor lists: the edges counting-sorted by source, each list in edge order.
    succ_ptr = np.zeros(num_events + 1, dtype=np.int64)
    for k in range(src.shape[0]):
        succ_ptr[src[k] + 1] += 1
    for i in range(num_events):
        succ_ptr[i + 1] += succ_ptr[i]
    fill = succ_ptr[:-1].copy()
    succ_idx = np.empty(src.shape[0], dtype=np.int64)
    indegree = np.zeros(num_events, dtype=np.int64)
    for k in range(src.shape[0]):
        succ_idx[fill[src[k]]] = dst[k]
        fill[src[k]] += 1
        indegree[dst[k]] += 1
    ready = np.empty(num_events, dtype=np.int64)
    top = 0
    for i in range(num_events - 1, -1, -1):
        if indegree[i] == 0:
            ready[top] = i
            top += 1
    order = np.empty(num_events, dtype=np.int64)
    count = 0
    while top > 0:
        top -= 1
        i = ready[top]
        order[count] = i
        count += 1
        for j in range(succ_ptr[i], succ_ptr[i + 1]):
            t = succ_idx[j]
            indegree[t] -= 1
            if indegree[t] == 0:
                ready[top] = t
                top += 1
    return order[:count]
