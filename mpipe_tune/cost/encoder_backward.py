"""The encoder backward placements read with the cost model: slots for each policy, and ``optimised``.

:func:`placement_slots` gives a compiled plan's encoder backward slots under a placement
(:mod:`mpipe_tune.algebra.encoder_backward`): ``cooldown`` and ``earliest`` from the unit-time steps
alone, ``optimised`` from :func:`optimise_slots`.

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
   durations can move with them) and returns the fastest of the three by that exact time, ties to
   the simpler (cooldown, then earliest).

So ``optimised`` is never slower than ``cooldown`` or ``earliest`` on the step it was chosen for.
Slots after a gradient's arrival on a timeline with positive durations are legal (module docstring
of the algebra's placement), so every order tried is deadlock-free.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra.encoder_backward import COOLDOWN, EARLIEST, validate_placement
from mpipe_tune.cost.compiled import CompiledPlan
from mpipe_tune.cost.durations import TableSums
from mpipe_tune.cost.layers import LayerTable

GAPS_PER_MICROBATCH = 4
"""Idle gaps :func:`optimise_slots` tries per encoder backward (besides the cooldown)."""
PASSES = 3
"""Rounds over the microbatches :func:`optimise_slots` makes at most (it stops at one that moves nothing)."""


def placement_slots(compiled: CompiledPlan, placement: str, table: LayerTable | TableSums) -> tuple[int, ...]:
    """The slots of ``compiled``'s encoder backwards under ``placement`` for its owners (``table``
    is read by ``optimised`` only)."""
    validate_placement(placement)
    steps = compiled.backbone_steps
    if placement == COOLDOWN:
        return steps.cooldown_slots(compiled.owners)
    if placement == EARLIEST:
        return steps.earliest_slots(compiled.owners)
    return optimise_slots(compiled, table)


def optimise_slots(compiled: CompiledPlan, table: LayerTable | TableSums, *, gaps: int = GAPS_PER_MICROBATCH,
                   passes: int = PASSES) -> tuple[int, ...]:
    """The ``optimised`` placement of ``compiled``'s encoder backwards on ``table`` (module docstring)."""
    assert compiled.has_encoder_backward, "a plan without encoder backwards has nothing to place"
    steps, owners = compiled.backbone_steps, compiled.owners
    exact: dict[tuple[int, ...], float] = {}
    for slots in (steps.cooldown_slots(owners), steps.earliest_slots(owners)):
        exact.setdefault(slots, compiled.with_encoder_backward(slots).makespan(table))
    current = min(exact, key=exact.get)  # the first of equals: cooldown before earliest
    durations = compiled.with_encoder_backward(current).durations(table)
    order = compiled.order_with_encoder_backward(current)
    best = order.makespan(durations)
    for _ in range(passes):
        start = current
        for m, r in enumerate(owners):
            finish = order.finish_times(durations)
            arrival = finish[steps.first_bwd[m]]
            for slot in _gap_slots(order.nodes[r], steps.compute[r], finish, durations, arrival, gaps):
                if slot == current[m]:
                    continue
                trial = current[:m] + (slot,) + current[m + 1:]
                trial_order = compiled.order_with_encoder_backward(trial)
                time_s = trial_order.makespan(durations)
                if time_s < best * (1 - 1e-12):
                    best, current, order = time_s, trial, trial_order
        if current == start:
            break
    exact.setdefault(current, compiled.with_encoder_backward(current).makespan(table))
    return min(exact, key=exact.get)


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
