"""The bound search's order without holding every point: groups first, their points only when opened.

A 512-device space with every knob searched holds half a million points, a 16,384-device one nearly a
million; most of them lose on bounds that their group already gives. A group
(:meth:`~mpipe_tune.search.space.SearchSpace.groups`: one layout, microbatch count and memory setting, every
schedule, cut, owner policy and encoder backward placement in it) shares its static memory floor and its
layer tables, so one bound holds for all its points:

- its static memory floor (:meth:`Evaluator.static_floor_bytes`) over capacity: no point of it can fit
  (infinite bound, read off a one-sequence table; the group is never opened);
- all its work over the ``P`` ranks (:meth:`Evaluator.bound_at` level 0: from the tables of its setting
  without recomputation, plus what full recomputation adds at least): no schedule or cut does better.

:class:`GroupOrder` keeps one heap of groups and points. A group enters unbounded (0) and gets its work
bound when it comes on top; with that bound on top it is opened: its points enter at the group's bound
and are refined by their own levels (:class:`~mpipe_tune.search.bounds.BoundOrder`'s) when they come on
top in turn. Every entry's bound is a lower bound on every point it stands for, and a point is taken only
once its bound is final, so points come out in increasing order of their final bounds (ties: tree order,
:meth:`~mpipe_tune.search.space.SearchSpace.walk`'s keys; a group's key is its first point's): the order
of the whole space's :class:`~mpipe_tune.search.bounds.BoundOrder`, while only the opened groups' points
are ever built.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Container
from typing import Any

from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.search.space import Group, SearchSpace

Point = tuple[dict[str, Any], Candidate]


class GroupOrder:
    """The points of ``space`` in increasing order of their final bound, opening groups on demand (see
    the module docstring). ``floor_bytes(c)``: the static memory floor of the group of ``c`` (its first
    point), which cannot fit over ``capacity_bytes``; ``group_bound(c)``: the bound for every point of the
    group of ``c``; ``levels`` and ``bound_at``: a point's levels, as :class:`BoundOrder` takes them.
    ``skip``: points not to put in the order (those tried already)."""

    def __init__(self, space: SearchSpace, floor_bytes: Callable[[Candidate], float], capacity_bytes: float,
                 group_bound: Callable[[Candidate], float], levels: Callable[[Candidate], tuple[int, int]],
                 bound_at: Callable[[Candidate, int], float], skip: Container[Candidate] = ()) -> None:
        self.space, self.group_bound, self.levels, self.bound_at, self.skip = space, group_bound, levels, bound_at, skip
        self.heap: list = []
        self.size = 0
        """Points in the space."""
        self.left = 0
        """Points still in the order (a group not yet opened counts with all its points)."""
        for group in space.groups():
            key, params, first = next(space.group_points(group))
            self.size += group.size
            self.left += group.size
            if floor_bytes(first) > capacity_bytes:  # final: no point of it fits (opened only if nothing fits)
                self.heap.append((math.inf, key, 1, 1, (group, first)))
            else:
                self.heap.append((0.0, key, 0, 1, (group, first)))
        heapq.heapify(self.heap)

    def __len__(self) -> int:
        return len(self.heap)

    def low(self) -> float:
        """The least bound in the order: a lower bound on every point still in it."""
        return self.heap[0][0]

    def step(self) -> Point | None:
        """One step: refine the top entry by one level, open the top group, or take the top point
        (returned, with its parameters); None when the step took no point."""
        low, key, level, last, item = self.heap[0]
        if isinstance(item[0], Group):
            group, first = item
            if level < last:
                heapq.heapreplace(self.heap, (max(low, self.group_bound(first)), key, level + 1, last, item))
                return None
            heapq.heappop(self.heap)
            self._open(group, low)
            return None
        if level < last:
            heapq.heapreplace(self.heap, (max(low, self.bound_at(item[1], level + 1)), key, level + 1, last, item))
            return None
        heapq.heappop(self.heap)
        self.left -= 1
        return item

    def _open(self, group: Group, bound: float) -> None:
        """Put ``group``'s points in the order at the group's ``bound``, each at its level 0 (a plan with
        recomputation: the group's work bound itself; one without: below its level 1)."""
        for key, params, candidate in self.space.group_points(group):
            if candidate in self.skip:
                self.left -= 1
                continue
            _, last = self.levels(candidate)
            heapq.heappush(self.heap, (bound, key, 0, last, (params, candidate)))
