"""The event graph's topological helpers: Kahn's order over edge columns and each rank's Sequence
edges (split out of :mod:`mpipe_tune.algebra._derive`; :mod:`mpipe_tune.algebra._encoder_backward` reads
them too, so neither imports the other)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mpipe_tune.algebra import _kernels as kernels
from mpipe_tune.algebra._events import EdgeKind


def sequence_edges(nodes: Sequence[Sequence[int]], src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's Sequence edges (consecutive events, rank after rank) that no earlier edge joins already."""
    flat = np.concatenate([np.asarray(n, dtype=np.int64) for n in nodes])
    last = np.cumsum([len(n) for n in nodes]) - 1
    joined = np.ones(len(flat), dtype=bool)
    joined[last] = False  # a rank's last event starts no Sequence edge
    a = flat[joined]
    c = flat[np.flatnonzero(joined) + 1]
    # Keep a pair where it is the first of its key among the earlier edges' keys and the pairs before it.
    keys = np.concatenate((src << 32 | dst, a << 32 | c))
    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    first = np.zeros(len(keys), dtype=bool)
    first[by_key[np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1]))]] = True
    keep = first[len(src):]
    return a[keep], c[keep]


def topological_order(num_events: int, edges: Sequence[tuple[int, int, EdgeKind]]) -> list[int] | None:
    """Kahn's algorithm, lowest index first among ready events; None when the graph has a cycle."""
    src = np.fromiter((e[0] for e in edges), dtype=np.int64, count=len(edges))
    dst = np.fromiter((e[1] for e in edges), dtype=np.int64, count=len(edges))
    return kahn_order(num_events, src, dst)


def kahn_order(num_events: int, src: np.ndarray, dst: np.ndarray) -> list[int] | None:
    """:func:`topological_order` over edge columns."""
    topo = sort_topologically(num_events, src, dst)
    return None if topo is None else topo.tolist()


def sort_topologically(num_events: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
    """:func:`topological_order` over edge columns, as an array: the ready events are a stack, initially
    every source with the lowest index on top; an event's successors are released in the order of its
    edges. The loop is a kernel (:mod:`mpipe_tune.algebra._kernels`)."""
    topo = kernels.topological_order(num_events, np.ascontiguousarray(src, dtype=np.int64), np.ascontiguousarray(dst, dtype=np.int64))
    return topo if len(topo) == num_events else None
