"""The algebra's one hot loop, compiled with numba (``cache=True``): Kahn's topological sort.

It is :func:`mpipe_tune.algebra.derive.topological_order`'s Python loop step for step (the ready events
a stack, initially every source with the lowest index on top; an event's successors released in the
order of their edges), so both give the same order. derive uses it for large graphs only, where the
Python loop is a third of derive's time (about 50 ms of 130 at P=32, M=256) and a first compile on a
fresh install (one to two seconds) pays for itself; small plans, the quick start's among them, never
compile it. The cost model sorts orders built by hand with it too.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def topological_order(num_events, succ_ptr, succ_idx):
    """Kahn's algorithm over a successor list (event ``i``'s successors are
    ``succ_idx[succ_ptr[i]:succ_ptr[i + 1]]``); fewer than ``num_events`` entries means a cycle."""
    indegree = np.zeros(num_events, dtype=np.int64)
    for j in range(succ_idx.shape[0]):
        indegree[succ_idx[j]] += 1
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
