"""Each baseline at its own best layout: the fastest plan of its family that fits memory.

A baseline's *family* is its layout rule (:func:`~mpipe_tune.search._baselines.baseline`) over the
choices it leaves free, drawn from the same :class:`SearchSpace` the search walks:

- the space's ``(pp, tp, dp, cp)`` (its pins ``--pp/--tp/--dp`` included);
- the microbatch counts the space allows the family's schedule at those degrees (for interleaving,
  those that run in equal rounds);
- the space's recomputation settings, expert-parallel degrees, ZeRO stages and sequence
  parallelism (:meth:`~mpipe_tune.search._space.SearchSpace.memory_settings`);
- for ``vpp``, the chunk count: 2 up to the space's ``max_chunks`` (at least 2).

That is a few dozen candidates on a few devices and tens of thousands at 512 (every layout, microbatch
count and memory setting), so a family is searched exhaustively and exactly, with the search's own bounds
(see :mod:`mpipe_tune.search._driver`): candidates are visited in increasing step-time lower bound, refined
lazily (:class:`~mpipe_tune.search._bounds.BoundOrder`) and staged as the search's groups are
(:mod:`mpipe_tune.search._grouped`), so that a candidate costs nothing until its bound comes on top:

- level 0: infinite where the static memory floor of its degrees and memory knobs cannot fit
  (:meth:`Evaluator.static_floor_bytes`, no layer table), else 0;
- levels 1 to ``S`` (the sampled steps): the work bound of its setting one sampled step's layer tables at
  a time (:class:`~mpipe_tune.search._grouped.StagedWorkBound`, shared by the candidates of a setting);
- then its own levels (:meth:`Evaluator.bound_at` 1 to 3: its slabs', its memory floors', its owners').

Only the candidates whose bound comes on top before the family's best is found build layer tables; the
visit stops at the first bound above the fastest plan that fits (or once every candidate left is out of
memory by its floors), one whose static memory alone is over capacity is skipped, and memory is estimated
only for plans faster than that one (until one fits, every plan is predicted with its memory at once: the
step time alone would be predicted twice). Ties in step time go to the candidate listed first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mpipe_tune.interrupt import mark
from mpipe_tune.search._baselines import baseline, schedule_of
from mpipe_tune.search._bounds import BoundOrder
from mpipe_tune.algebra import Candidate
from mpipe_tune.search._evaluate import Evaluation, Evaluator
from mpipe_tune.search._grouped import StagedWorkBound
from mpipe_tune.search._space import SearchSpace, twin_bounds
from mpipe_tune.plan_file import BASELINES, OWN

_PRUNE_MARGIN = 1e-9


@dataclass(frozen=True)
class OwnBest:
    """One family's search: its fastest plan that fits memory, and what it cost."""

    name: str
    """The baseline (``megatron``, ...)."""
    best: Evaluation | None
    """None when the family has no candidate, or none that fits memory."""
    num_candidates: int
    num_evaluated: int
    """Candidates predicted (step time, and memory where it could win)."""
    num_bounded: int
    """Candidates settled by their static memory or their step-time lower bound alone."""

    @property
    def label(self) -> str:
        return self.name + OWN


def chunk_choices(name: str, space: SearchSpace) -> tuple[int, ...]:
    """The woven-region counts a family may use: ``vpp`` 2 .. max(2, max_chunks), others 1."""
    return tuple(range(2, max(2, space.options.max_chunks) + 1)) if name == "vpp" else (1,)


def family_candidates(name: str, space: SearchSpace) -> list[Candidate]:
    """Every plan of baseline ``name``'s family in ``space``, labelled ``name@own``."""
    assert name in BASELINES, f"unknown baseline {name}"
    model = space.problem.model
    out = []
    for pp, tp, dp, cp in space.layouts:
        settings = space.memory_settings(dp, cp, tp)
        for chunks in chunk_choices(name, space):
            for m in space.microbatch_choices(pp, dp, schedule_of(name, chunks)):
                c = baseline(name, model, pp, tp, dp, m, vpp_microbatches=(m,), num_chunks=chunks)
                if c is None:
                    continue
                out.extend(replace(c, cp=cp, label=name + OWN, **setting) for setting in settings)
    return out


class StagedBound:
    """A family candidate's bound levels (see the module docstring): ``levels`` and ``bound_at`` as
    :class:`~mpipe_tune.search._bounds.BoundOrder` takes them. Each level's bound is a lower bound on the
    candidate's step time (infinite: it cannot fit), so the order's final bounds are the evaluator's."""

    def __init__(self, evaluator: Evaluator, work: StagedWorkBound | None = None) -> None:
        self.evaluator = evaluator
        self.work = StagedWorkBound(evaluator) if work is None else work
        self.capacity_bytes = evaluator.problem.profile.memory_capacity_bytes

    def levels(self, c: Candidate) -> tuple[int, int]:
        return 0, self.work.levels + self.evaluator.bound_levels(c)[1]

    def bound_at(self, c: Candidate, level: int) -> float:
        if self.evaluator.static_floor_bytes(c) > self.capacity_bytes:
            return math.inf
        if level <= self.work.levels:  # 0 at level 0; at the last, the evaluator's level 0
            return self.work(c, level)
        # never below the evaluator's level 0: at pp 1 its level 1 is the same work summed in another order,
        # which can round a few ulps lower, and each level must be at least the one before
        return max(self.work(c, self.work.levels), self.evaluator.bound_at(c, level - self.work.levels))


def search_family(name: str, space: SearchSpace, evaluator: Evaluator, work: StagedWorkBound | None = None) -> OwnBest:
    """The fastest plan of ``name``'s family that fits memory (exact; see the module docstring). ``work``:
    the staged work bounds to share with other searches of ``evaluator`` (None: a new one)."""
    candidates = family_candidates(name, space)
    staged = StagedBound(evaluator, work)
    staged.work.expect(c for c in candidates if evaluator.static_floor_bytes(c) <= staged.capacity_bytes)
    order = BoundOrder(candidates, staged.levels, staged.bound_at)
    capacity = staged.capacity_bytes
    best: tuple[float, int, Evaluation] | None = None
    evaluated = 0
    while order:
        low, i = order.peek()
        if low == math.inf:
            break  # every candidate left is out of memory by its floors
        if best is not None and low > best[0] * (1 + _PRUNE_MARGIN):
            break  # in bound order: every later candidate loses too
        order.pop()
        c = candidates[i]
        static = evaluator.static_peak_bytes(c)
        if static is not None and static > capacity:
            continue
        twin = evaluator.twin_s(c, predict=False)
        if best is not None and twin > 0 and (twin, i) >= best[:2]:
            continue  # a ZeRO-3 plan is never faster than its stage-1 twin, known to lose (or tie) already
        evaluated += 1
        if best is not None:  # its step time first: memory only for a plan that could win
            e = evaluator.evaluate(c, memory=False)
            if (e.mean_s, i) >= best[:2]:
                continue
        e = evaluator.evaluate(c)  # with none that fits yet, any plan could: step time and memory in one pass
        if e.fits:
            best = (e.mean_s, i, e)
    return OwnBest(name, None if best is None else best[2], len(candidates), evaluated, len(candidates) - evaluated)


def search_families(space: SearchSpace, evaluator: Evaluator, work: StagedWorkBound | None = None) -> list[OwnBest]:
    """:func:`search_family` for every baseline, in :data:`BASELINES` order, sharing ``work`` (each a named
    point ``family`` of the Ctrl-C tests: a Ctrl-C here stops the plan at its next safe point, before the
    search)."""
    work = StagedWorkBound(evaluator) if work is None else work
    evaluator.twin_bounds = twin_bounds(space)
    found = []
    for name in BASELINES:
        mark("family")
        found.append(search_family(name, space, evaluator, work))
    return found
