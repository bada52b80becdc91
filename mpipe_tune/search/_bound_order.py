"""The bound order: every point of the space in increasing order of its step-time lower bound, until the
rest cannot beat the best that fits by more than the tolerance (``--sampler bound``, the default), and
the exhaustive walk (the same order to the end: the space's optimum, the yardstick).

The order visits points in increasing bound order and stops evaluating at the first bound above the
best that fits, so with tolerance 0 it stays exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import optuna

from mpipe_tune.algebra import Candidate
from mpipe_tune.search._grouped import GroupOrder, StagedWorkBound
from mpipe_tune.search._search_run import ATTR, HAS_SET_CONSTRAINT, PRUNE_MARGIN, SearchRun, point_distributions
from mpipe_tune.search._strategy import SearchStrategy, StrategySettings


class BoundOrder(SearchStrategy):
    """The points in increasing bound order, whole groups of them bounded first, until the tolerance or
    the trial cap stops it."""

    name = "bound"
    mode = "bound"

    def search(self, run: SearchRun, settings: StrategySettings) -> int | None:
        return walk(run, settings.tolerance, settings.n_trials)


def walk(run: SearchRun, tolerance: float = 0.0, n_trials: int | None = None) -> int:
    """Every point not yet in the study, in increasing bound order, until the next bound cannot beat the
    best that fits by more than ``tolerance`` (0: exact), or the study holds ``n_trials``; returns the
    space size. Sets the run's ``gap`` and, when it stops early, its ``ending``.

    The order (:class:`~mpipe_tune.search._grouped.GroupOrder`) bounds whole groups of points (one
    layout, microbatch count and memory setting) first and builds a group's points only when its bound
    comes on top, so a space of a million points costs the groups that could win; a group whose static
    memory floor cannot fit is never opened. Inside, the bounds refine lazily
    (:meth:`Evaluator.bound_at`): a point whose owners a per-step policy chooses (``greedy``,
    ``optimal``) gets the bound for any owner map first, and its owners' bound only when it comes out on
    top, so the owners of points that lose are never computed."""
    ev, capacity = run.evaluator, run.evaluator.problem.profile.memory_capacity_bytes
    if run.prune:
        work = StagedWorkBound(ev)
        order = GroupOrder(run.space, ev.static_floor_bytes, capacity, work, work.levels, ev.bound_levels,
                           ev.bound_at, run.tried, expect=work.expect)
    else:
        order = GroupOrder(run.space, lambda c: 0.0, capacity, lambda c, level: 0.0, 1, lambda c: (0, 0),
                           lambda c, level: 0.0, run.tried)
    run.open_bar(order.left, "plan (exhaustive)" if n_trials is None else "plan (bound order)")
    run.start_writing(order.left)
    run.gap, run.ending = 0.0, "enumerated"
    last_sync = time.perf_counter()
    while order:
        low = order.low()
        full = n_trials is not None and len(run.stored) + run.new >= n_trials
        if run.must_stop() or full:
            run.ending = "budget"
            if run.incumbent is not None and run.prune:
                run.gap = max(0.0, 1 - low / run.incumbent)
            break
        if run.storage is not None and time.perf_counter() - last_sync > run.sync_every_s:
            last_sync = time.perf_counter()  # another worker may have stored this point meanwhile
            run.absorb_others()
        if low == math.inf and run.incumbent is None:  # nothing fits: find the plan of least static memory
            run.bounded += order.left
            _least_static(run, order.unfit())
            break
        if run.prune and run.incumbent is not None and low * (1 + tolerance) > run.incumbent * (1 + PRUNE_MARGIN):
            run.bounded += order.left  # the least bound of the rest loses too (or by < tolerance)
            run.gap = max(0.0, 1 - low / run.incumbent)
            run.ending = "bound" if run.gap > 0 else "enumerated"
            break
        point = order.step()
        if point is None or point[1] in run.tried:
            continue
        params, candidate = point
        e = run.evaluate(candidate)
        if not e.exact:  # its static memory alone is over capacity
            continue
        info = run.info(e)
        system = {"constraints:memory": info["memory_excess_gib"]} if HAS_SET_CONSTRAINT else {}
        run.record(optuna.trial.create_trial(
            params=params, distributions=point_distributions(run.space, params), value=e.mean_s,
            user_attrs={ATTR: info}, system_attrs=system,
        ))
    return order.size

def _least_static(run: SearchRun, groups: Sequence[tuple[float, Sequence[tuple[dict, Candidate]]]]) -> None:
    """Where no point fits: the static memory of the points of ``groups`` (least floor first), until the
    next group's floor is above the least static memory found (no point of it can be below)."""
    for floor, points in groups:
        if run.least is not None and floor >= run.least.peak_bytes:
            return
        for _, c in points:
            if run.must_stop():
                return
            run.evaluate(c)
            run.bounded -= 1  # counted already
