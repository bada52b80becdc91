"""Where an owner runs the events of an interior or sink transpose.

A Replicated region after the first (``1f1b,transpose,1f1b``, ``transpose,1f1b,transpose``,
``1f1b,transpose``) sits inside the wavefront: microbatch ``m`` leaves a Sharded stage, runs the
region on its owner, and comes back (or, for a sink, meets its loss there). Its events are not part
of any skeleton's program, so each owner must fit them into its program. The rule here: **an owned
event runs as soon as its input has arrived and its owner is free**, before the owner's next program
event if both could start; the programs keep their own order.

The placement is read off a list-scheduling run of the step on *proxy durations* that the algebra
can compute without a cost model (derive gives them): every Sharded stage's forward one unit (the
balanced pipeline its slabs aim at), an owned region's forward its layer count over the mean slab's,
a backward twice its forward; a source transpose's encodes nothing (they fill the warmup idle time),
transfers, losses and reduces nothing. The run is event-driven: the next event to start anywhere is
the one with the earliest possible start (an owned event first on a tie). It never deadlocks: the
programs and the dataflow form an acyclic graph (each seam through a Replicated region keeps the
dependency the direct Send had), so the earliest unrun event of that graph is always startable. Each
rank's list is the order its events ran in, which is an execution of the graph, so the order derive
returns stays acyclic with its Sequence edges. The proxy reads the placement only (not the workload's
layer weights), so the same slabs and owner map always give the same order. Where the real durations
differ much from the proxy (a slab much dearer than the others), an owner may wait at an owned event
whose input comes later than the proxy said.

>>> nodes = ((0, 2, 9), (1, 9))      # rank 0 runs 0 then 2; rank 1 runs 1; 9 is the barrier
>>> src, dst = [0, 3, 1], [3, 1, 2]  # 0 -> owned event 3 -> 1, and 1 -> 2
>>> place_owned_events(nodes, 10, src, dst, {3: 1}, [1, 1, 1, 1] + [0] * 6, [False] * 9 + [True], [])
((0, 2, 9), (3, 1, 9))
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

_OWNED, _PROGRAM = 0, 1  # tie-break at equal start: an owned event before the program's next


def place_owned_events(nodes: Sequence[Sequence[int]], num_events: int, src: Sequence[int], dst: Sequence[int],
                       owned: Mapping[int, int], weight: Sequence[float], is_tail: Sequence[bool],
                       tail_extra: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each rank's list with its owned events placed (see the module docstring).

    ``nodes``: per rank, its program's event indices, ending in its tail (reduces and the barrier,
    ``is_tail``); ``src``/``dst``: the dataflow edges; ``owned``: event index -> the rank that runs
    it; ``weight``: proxy duration per event; ``tail_extra``: reduces every rank runs before its
    barrier (the owned regions' ReplicaGroup reduces).
    """
    P = len(nodes)
    cut = [next(k for k, i in enumerate(rank_nodes) if is_tail[i]) for rank_nodes in nodes]
    body = [list(rank_nodes[:k]) for rank_nodes, k in zip(nodes, cut)]
    home = np.full(num_events, -1, dtype=np.int64)  # the rank whose program holds the event
    for r, events in enumerate(body):
        home[events] = r
    src_a, dst_a = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    keep = ~np.asarray(is_tail, dtype=bool)[dst_a]  # edges into the reduces gate nothing here
    src_a, dst_a = src_a[keep], dst_a[keep]
    by_src = np.argsort(src_a, kind="stable")
    ptr = np.zeros(num_events + 1, dtype=np.int64)
    np.cumsum(np.bincount(src_a, minlength=num_events), out=ptr[1:])
    succ, ptr = dst_a[by_src].tolist(), ptr.tolist()
    waiting = np.bincount(dst_a, minlength=num_events).tolist()
    ready_at = [0.0] * num_events
    free_at = [0.0] * P
    head = [0] * P
    pool: list[list[tuple[float, int]]] = [[] for _ in range(P)]  # per rank, its ready owned events
    version = [0] * P
    candidates: list[tuple[float, int, int, int, int]] = []  # (start, tie, event, rank, version)
    placed: list[list[int]] = [[] for _ in range(P)]
    home_l = home.tolist()

    def offer(r: int) -> None:
        version[r] += 1
        best = None
        if pool[r]:
            at, i = pool[r][0]
            best = (max(free_at[r], at), _OWNED, i)
        if head[r] < len(body[r]):
            i = body[r][head[r]]
            if not waiting[i]:
                start = max(free_at[r], ready_at[i])
                if best is None or (start, _PROGRAM) < best[:2]:
                    best = (start, _PROGRAM, i)
        if best is not None:
            heapq.heappush(candidates, (*best, r, version[r]))

    def finish(i: int, time: float) -> None:
        stack = [(i, time)]
        while stack:
            e, t = stack.pop()
            for j in succ[ptr[e]:ptr[e + 1]]:
                ready_at[j] = max(ready_at[j], t)
                waiting[j] -= 1
                if waiting[j]:
                    continue
                if j in owned:
                    heapq.heappush(pool[owned[j]], (ready_at[j], j))
                    offer(owned[j])
                elif home_l[j] >= 0:
                    r = home_l[j]
                    if head[r] < len(body[r]) and body[r][head[r]] == j:
                        offer(r)
                else:  # a transfer: it occupies no rank, so it is done when its input is
                    stack.append((j, ready_at[j]))

    for i in range(num_events):
        if not waiting[i] and i in owned:
            heapq.heappush(pool[owned[i]], (0.0, i))
    for r in range(P):
        offer(r)
    remaining = sum(map(len, body)) + len(owned)
    while candidates:
        start, tie, i, r, ver = heapq.heappop(candidates)
        if ver != version[r]:
            continue
        if tie == _OWNED:
            heapq.heappop(pool[r])
        else:
            head[r] += 1
        placed[r].append(i)
        remaining -= 1
        free_at[r] = start + float(weight[i])
        finish(i, free_at[r])
        offer(r)
    assert remaining == 0, "placing the owned events found no startable event: the programs are cyclic"
    return tuple(tuple(placed[r] + list(nodes[r][cut[r]:-1]) + list(tail_extra) + [nodes[r][-1]])
                 for r in range(P))
