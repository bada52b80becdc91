"""The bound search's order without holding every point: groups first, their points only when opened.

A 512-device space with every knob searched holds half a million points, a 16,384-device one nearly a
million; most of them lose on bounds that their group already gives. A group
(:meth:`~mpipe_tune.search._space.SearchSpace.groups`: one layout, microbatch count and memory setting, every
schedule, cut, owner policy and encoder backward placement in it) shares its static memory floor and its
layer tables, so one bound holds for all its points:

- its static memory floor (:meth:`Evaluator.static_floor_bytes`) over capacity: no point of it can fit
  (infinite bound, read off a one-sequence table; the group is never opened);
- all its work over the ``P`` ranks (:meth:`Evaluator.bound_at` level 0: from the tables of its setting
  without recomputation, plus what full recomputation adds at least): no schedule or cut does better.
  The objective is the mean over the sampled steps, so the work of the first ``j`` steps over all of them
  bounds it too: the work bound comes in levels of one sampled step's layer table each
  (:class:`StagedWorkBound`), and a group that loses on its first steps never builds the tables of the rest.

:class:`GroupOrder` keeps one heap of groups and points. A group enters unbounded (0) and gets its next
level of bound whenever it comes on top; with its final bound on top it is opened: its points enter at the group's bound
and are refined by their own levels (:class:`~mpipe_tune.search._bounds.BoundOrder`'s) when they come on
top in turn. Every entry's bound is a lower bound on every point it stands for, and a point is taken only
once its bound is final, so points come out in increasing order of their final bounds (ties: tree order,
:meth:`~mpipe_tune.search._space.SearchSpace.walk`'s keys; a group's key is its first point's): the order
of the whole space's :class:`~mpipe_tune.search._bounds.BoundOrder`, while only the opened groups' points
are ever built.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Container, Iterable
from dataclasses import replace
from typing import Any

from mpipe_tune.algebra import Candidate
from mpipe_tune.search._evaluate import Evaluator
from mpipe_tune.search._space import Group, SearchSpace

Point = tuple[dict[str, Any], Candidate]


class GroupOrder:
    """The points of ``space`` in increasing order of their final bound, opening groups on demand (see
    the module docstring). ``floor_bytes(c)``: the static memory floor of the group of ``c`` (its first
    point), which cannot fit over ``capacity_bytes``; ``group_bound(c, level)``: the bound for every point of
    the group of ``c`` at ``level`` (1 to ``group_levels``, each at least the one before, the last the tightest);
    ``levels`` and ``bound_at``: a point's levels, as :class:`BoundOrder` takes them.
    ``skip``: points not to put in the order (those tried already). ``expect``: told the first point of every
    group that can fit, once (each of them gets its first level of bound before the order can end)."""

    def __init__(self, space: SearchSpace, floor_bytes: Callable[[Candidate], float], capacity_bytes: float,
                 group_bound: Callable[[Candidate, int], float], group_levels: int,
                 levels: Callable[[Candidate], tuple[int, int]], bound_at: Callable[[Candidate, int], float],
                 skip: Container[Candidate] = (), expect: Callable[[list[Candidate]], None] | None = None) -> None:
        self.space, self.group_bound, self.levels, self.bound_at, self.skip = space, group_bound, levels, bound_at, skip
        self.floor_bytes = floor_bytes
        self.heap: list = []
        self.size = 0
        """Points in the space."""
        self.left = 0
        """Points still in the order (a group not yet opened counts with all its points)."""
        self.unfit_floors: dict[Group, float] = {}
        """The static memory floor of each group that cannot fit."""
        fitting = []
        for group in space.groups():
            key, params, first = next(space.group_points(group))
            self.size += group.size
            self.left += group.size
            floor = floor_bytes(first)
            if floor > capacity_bytes:  # final: no point of it fits (see :meth:`unfit`)
                self.unfit_floors[group] = floor
                self.heap.append((math.inf, key, group_levels, group_levels, (group, first)))
            else:
                self.heap.append((0.0, key, 0, group_levels, (group, first)))
                fitting.append(first)
        heapq.heapify(self.heap)
        if expect is not None:
            expect(fitting)

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
                heapq.heapreplace(self.heap, (max(low, self.group_bound(first, level + 1)), key, level + 1, last, item))
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

    def unfit(self) -> list[tuple[float, list[Point]]]:
        """Once the least bound is infinite (every point left cannot fit): what is left, least static memory
        floor first, as (floor, points not skipped): a group not opened with all its points, or one point of
        an opened group that its own memory floor put out of reach; the order is then empty."""
        entries = []
        for _, key, _, _, item in self.heap:
            if isinstance(item[0], Group):  # not opened: its points, at its static floor
                group, first = item
                floor = self.unfit_floors.get(group)
                entries.append((self.floor_bytes(first) if floor is None else floor, key, group, None))
            else:  # a point of an opened group whose own bound is infinite (its memory floor cannot fit)
                entries.append((self.floor_bytes(item[1]), key, None, item))
        entries.sort(key=lambda e: e[:2])
        self.heap, self.left = [], 0
        return [(floor, [point] if group is None else
                 [(params, c) for _, params, c in self.space.group_points(group) if c not in self.skip])
                for floor, _, group, point in entries]

    def _open(self, group: Group, bound: float) -> None:
        """Put ``group``'s points in the order at the group's ``bound``, each at its level 0 (a plan with
        recomputation: the group's work bound itself; one without: below its level 1)."""
        for key, params, candidate in self.space.group_points(group):
            if candidate in self.skip:
                self.left -= 1
                continue
            _, last = self.levels(candidate)
            heapq.heappush(self.heap, (bound, key, 0, last, (params, candidate)))


class StagedWorkBound:
    """A group's work bound (:meth:`Evaluator.bound_at` level 0) in levels of one sampled step each: at
    level ``j`` below the number of steps, the work of the first ``j`` steps' layer tables (its setting
    without recomputation) over all the steps and the ``P`` ranks, a lower bound on the mean of them all
    (every step's work is >= 0); at the last level, :meth:`Evaluator.bound_at` level 0 itself."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        self.levels = evaluator.problem.samples
        self._work: dict[tuple, float] = {}

    def expect(self, candidates: Iterable[Candidate]) -> None:
        """The groups of ``candidates`` will be bounded: the layer tables of their settings without
        recomputation are built together (:meth:`Evaluator.expect`)."""
        self.evaluator.expect(candidates, plain=True)

    def __call__(self, c: Candidate, level: int) -> float:
        if level >= self.levels:
            return self.evaluator.bound_at(c, 0)
        return sum(self._step_work(c, k) for k in range(level)) / (self.levels * c.pp)

    def _step_work(self, c: Candidate, sample: int) -> float:
        """The work of step ``sample``'s layer table of ``c``'s setting without recomputation (kept per setting:
        the key is read off ``c`` itself, as a group's bound is asked for at every level of every group)."""
        key = (c.tp, c.dp, c.num_microbatches, c.ep, c.cp, c.sequence_parallel, c.encoder_tp, sample)
        if key not in self._work:
            table = self.evaluator.table(sample, replace(c, recompute=False))[1]
            self._work[key] = float(table.fwd_s.sum() + table.backward_s(self.evaluator.problem.model).sum())
        return self._work[key]
