"""The encoder backward placements read with the cost model: slots for each policy, and ``optimised``.

:func:`placed` gives a compiled plan's encoder backward arrangement under a placement
(:mod:`mpipe_tune.algebra._encoder_backward`): ``cooldown`` and ``earliest`` from the unit-time steps
alone, ``optimised`` from :func:`optimise` (:func:`placement_slots`, :func:`optimise_slots`: the
slots on the owners alone).

**optimised** chooses the slots with the compiled plan's timing on one step's layer table:

1. it times the cooldown and the earliest placements and starts from the faster;
2. then, one microbatch at a time in increasing ``m``, it tries moving that microbatch's encoder
   backward to each of the first ``gaps`` idle gaps of its owner that open after its gradient
   arrives (on the current timeline: before a backbone event that starts later than both the
   gradient's arrival and the end of the rank's previous event), and to the cooldown, re-timing
   each with the order alone (the durations of the starting arrangement held fixed, so only the
   longest path is recomputed), and keeps a move that shortens the step; it repeats that round, up to
   :data:`PASSES` times, while a round still moves something;
3. it times the result exactly (the data-parallel reduces' overlap reads the ranks' orders, so
   durations can move with them) and, on the owners alone, returns the fastest of the three by that
   exact time, ties to the simpler (cooldown, then earliest).

Under full recomputation (:attr:`~mpipe_tune.algebra._candidate.Candidate.moves_encoder_backward`)
``optimised`` also moves encoder backwards to other ranks (:attr:`EncoderBackward.ranks`):

4. from the result of step 2 it makes the same rounds with, per microbatch, these moves: the first
   ``gaps`` idle gaps of the rank that now runs it, the first :data:`RANK_GAPS` idle gaps of every
   other rank after the gradient's arrival there (the first stage's backward, then the Scatter over
   that rank's link), and the cooldown of its rank and of the :data:`TAIL_RANKS` ranks whose backbone
   ends first; a trial times the order with the Scatter of the moved microbatch at its new link's
   seconds (a Scatter to the first stage's own rank costs nothing);
5. the result is timed exactly too, and the fastest of all of them is returned, ties to the simpler
   (cooldown, earliest, owners only, then with moves).

So ``optimised`` is never slower than ``cooldown`` or ``earliest``, nor, with moves, than
``optimised`` on the owners alone, on the step it was chosen for. Slots after a gradient's arrival
on a timeline with positive durations are legal on any rank (module docstring of the algebra's
placement), so every order tried is deadlock-free. The moved backward's rank reads the microbatch's
images with its own data loader (the inputs are deterministic per microbatch); that load is not
charged, as no encode's is (the profiles have no figure for it). Its seconds are the owner's:
under full recomputation every backward already re-runs its layers' forward.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra import COOLDOWN, EARLIEST, OPTIMISED, EncoderBackward, moved_count, validate_placement, Comm
from mpipe_tune.cost._compiled import CompiledPlan
from mpipe_tune.cost._durations import TableSums, table_sums
from mpipe_tune.cost._event_arrays import COLL, COMMS
from mpipe_tune.cost._layers import LayerTable

GAPS_PER_MICROBATCH = 4
"""Idle gaps :func:`optimise` tries per encoder backward on its rank (besides the cooldown)."""
RANK_GAPS = 2
"""Idle gaps :func:`optimise` tries per encoder backward on each other rank (full recomputation)."""
TAIL_RANKS = 2
"""Other ranks whose cooldown :func:`optimise` tries per encoder backward: those whose backbone ends first."""
PASSES = 3
"""Rounds over the microbatches :func:`optimise` makes at most per phase (it stops at one that moves nothing)."""


def placed(compiled: CompiledPlan, placement: str, table: LayerTable | TableSums) -> EncoderBackward:
    """The arrangement of ``compiled``'s encoder backwards under ``placement`` for its owners: explicit
    slots, and for ``optimised`` under full recomputation the ranks it moved some to (``table`` is
    read by ``optimised`` only)."""
    validate_placement(placement)
    if placement != OPTIMISED:
        return EncoderBackward(placement, placement_slots(compiled, placement, table))
    return optimise(compiled, table)


def placement_slots(compiled: CompiledPlan, placement: str, table: LayerTable | TableSums) -> tuple[int, ...]:
    """The slots of ``compiled``'s encoder backwards under ``placement`` on their owners (``table``
    is read by ``optimised`` only, which here moves none to another rank)."""
    validate_placement(placement)
    steps = compiled.backbone_steps
    if placement == COOLDOWN:
        return steps.cooldown_slots(compiled.owners)
    if placement == EARLIEST:
        return steps.earliest_slots(compiled.owners)
    return optimise_slots(compiled, table)


def optimise_slots(compiled: CompiledPlan, table: LayerTable | TableSums, *, gaps: int = GAPS_PER_MICROBATCH,
                   passes: int = PASSES) -> tuple[int, ...]:
    """The ``optimised`` slots of ``compiled``'s encoder backwards on their owners (steps 1 to 3 of
    the module docstring)."""
    return optimise(compiled, table, gaps=gaps, passes=passes, other_ranks=False).slots


def optimise(compiled: CompiledPlan, table: LayerTable | TableSums, *, gaps: int = GAPS_PER_MICROBATCH,
             passes: int = PASSES, other_ranks: bool | None = None) -> EncoderBackward:
    """The ``optimised`` arrangement of ``compiled``'s encoder backwards on ``table`` (module
    docstring): on other ranks too when ``other_ranks`` (None: when the plan's recomputation is full)."""
    assert compiled.has_encoder_backward, "a plan without encoder backwards has nothing to place"
    if other_ranks is None:
        other_ranks = compiled.options.recompute_granularity == "full"
    assert not other_ranks or compiled.options.recompute_granularity == "full", "moves need full recomputation"
    steps, owners = compiled.backbone_steps, compiled.owners
    exact: dict[tuple, float] = {}

    def timed(slots: tuple[int, ...], ranks: tuple[int, ...] | None) -> None:
        exact.setdefault((slots, ranks), compiled.with_encoder_backward(slots, ranks).makespan(table))

    for slots in (steps.cooldown_slots(owners), steps.earliest_slots(owners)):
        timed(slots, None)
    search = _Search(compiled, min(exact, key=exact.get), table)  # the first of equals: cooldown before earliest
    search.run(passes, lambda m, finish: _gap_slots(search.order.nodes[owners[m]], steps.compute[owners[m]],
                                                     finish, search.durations, finish[steps.first_bwd[m]], gaps),
               moves=False)
    timed(*search.current)
    if other_ranks:
        search.run(passes, lambda m, finish: search.rank_moves(m, finish, gaps), moves=True)
        timed(*search.current)
    slots, ranks = min(exact, key=exact.get)
    return EncoderBackward(OPTIMISED, slots, None if moved_count(ranks, owners) == 0 else ranks)


class _Search:
    """The local search of :func:`optimise` over one arrangement (slots, ranks; None: the owners),
    timed on the order alone with the starting arrangement's durations, each moved Scatter's taking
    its new link."""

    def __init__(self, compiled: CompiledPlan, start: tuple, table: LayerTable | TableSums) -> None:
        self.compiled, self.current = compiled, start
        placed_plan = compiled.with_encoder_backward(*start)
        self.durations = placed_plan.durations(table)
        self.order = compiled.order_with_encoder_backward(*start)
        self.best = self.order.makespan(self.durations)
        self.sums = table if isinstance(table, TableSums) else table_sums(table, compiled.model)
        self.scatter: np.ndarray | None = None
        self.scatter_s: dict[int, np.ndarray] = {}

    def run(self, passes: int, candidates, moves: bool) -> None:
        """Up to ``passes`` rounds over the microbatches, each trying ``candidates(m, finish)``: slots
        on the current rank of ``m`` (``moves`` False) or (slot, rank) pairs (``moves`` True)."""
        owners = self.compiled.owners
        for _ in range(passes):
            start = self.current
            for m in range(len(owners)):
                finish = self.order.finish_times(self.durations)
                for candidate in candidates(m, finish):
                    slot, rank = candidate if moves else (candidate, self._ranks()[m])
                    self._try(m, slot, rank)
            if self.current == start:
                break

    def _ranks(self) -> tuple[int, ...]:
        return self.current[1] or self.compiled.owners

    def _try(self, m: int, slot: int, rank: int) -> None:
        slots, ranks = self.current
        if slot == slots[m] and rank == self._ranks()[m]:
            return
        trial_slots = slots[:m] + (slot,) + slots[m + 1:]
        trial_ranks = None if ranks is None and rank == self.compiled.owners[m] else (
            self._ranks()[:m] + (rank,) + self._ranks()[m + 1:])
        durations = self.durations
        if rank != self._ranks()[m]:
            durations = durations.copy()
            durations[self._scatter(m)] = self._scatter_s(m)[rank]
        order = self.compiled.order_with_encoder_backward(trial_slots, trial_ranks)
        time_s = order.makespan(durations)
        if time_s < self.best * (1 - 1e-12):
            self.best, self.current, self.order, self.durations = time_s, (trial_slots, trial_ranks), order, durations

    def _scatter(self, m: int) -> int:
        """The Scatter that brings microbatch ``m``'s gradient to its encoder backward (event index)."""
        if self.scatter is None:
            a = self.compiled.arrays
            at = np.flatnonzero((a.kind == COLL) & (a.comm == COMMS.index(Comm.SCATTER))
                                & (a.other_region == a.source_region))
            self.scatter = np.empty(len(self.compiled.owners), dtype=np.int64)
            self.scatter[a.mb[at]] = at
        return int(self.scatter[m])

    def _scatter_s(self, m: int) -> np.ndarray:
        """Per rank, the seconds of microbatch ``m``'s Scatter were it to reach that rank."""
        if m not in self.scatter_s:
            ranks = np.arange(len(self.compiled.backbone_steps.compute))
            self.scatter_s[m] = self.compiled.durations_model.transfer_seconds(self.sums, self._scatter(m), ranks)
        return self.scatter_s[m]

    def rank_moves(self, m: int, finish: np.ndarray, gaps: int) -> list[tuple[int, int]]:
        """(slot, rank) moves of microbatch ``m``'s encoder backward: the first ``gaps`` idle gaps of
        its rank, the first :data:`RANK_GAPS` of every other rank, each after the gradient's arrival
        there, and the cooldown of its rank and of the :data:`TAIL_RANKS` ranks whose backbone ends first."""
        steps = self.compiled.backbone_steps
        out = []
        here = self._ranks()[m]
        scatter_s = self._scatter_s(m)
        ends = []
        for r in range(steps.num_ranks):
            arrival = finish[steps.first_bwd[m]] + scatter_s[r]
            slots = _gap_slots(self.order.nodes[r], steps.compute[r], finish, self.durations, arrival,
                               gaps if r == here else RANK_GAPS)
            out.extend((slot, r) for slot in slots[:-1])
            ends.append(finish[steps.compute[r][-1]] if len(steps.compute[r]) else 0.0)
        tails = [here] + [r for r in np.argsort(ends, kind="stable").tolist() if r != here][:TAIL_RANKS]
        return out + [(len(steps.compute[r]), r) for r in tails]


def _gap_slots(rank_nodes: np.ndarray, compute: np.ndarray, finish: np.ndarray, durations: np.ndarray,
               arrival: float, gaps: int) -> list[int]:
    """The slots before the first ``gaps`` backbone events of a rank that start later than both
    ``arrival`` and the end of the rank's event before them, then the cooldown slot."""
    start = finish - durations
    previous_end = np.empty(len(rank_nodes))
    previous_end[0] = 0.0
    previous_end[1:] = finish[rank_nodes[:-1]]
    end_before = dict(zip(rank_nodes.tolist(), previous_end.tolist()))
    out = []
    for k, e in enumerate(compute.tolist()):
        if start[e] > max(arrival, end_before[e]) * (1 + 1e-12):
            out.append(k)
            if len(out) == gaps:
                break
    return out + [len(compute)]
