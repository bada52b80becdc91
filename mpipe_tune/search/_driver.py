"""Driving the search: one strategy run against a problem and an Optuna study.

**Storage.** The study lives in an Optuna RDB storage (SQLite file ``mpipe-tune.db`` in the working
directory by default, any RDB URL for several workers). Each finished trial is written to it as soon
as it is told, so a killed search loses only the trial in flight, and rerunning the same command
continues the study: ``--trials`` is the study's total, not this run's.

**Several workers.** Any number of ``plan`` processes may share one study: they stop at the
requested total. When it starts and whenever it re-synchronises, a worker counts the study's finished
trials (its own still queued for the trial writer included) and stops at ``n_trials`` (counting before
every trial cost a tenth of the default example's search: a read of every trial); each trial is stored by
:func:`~mpipe_tune.search._writer.store_trial`, which decides from what the storage holds at that
moment and reserves the last places, so that workers finishing at the same moment cannot pass the
total either (a trial that finds the study full is stored as failed, and its worker stops).
Exhaustive workers skip the points another worker has already stored and prune against its best.

**Strategies.** How the points are visited is a :class:`~mpipe_tune.search._strategy.SearchStrategy`,
one module each, registered in :data:`STRATEGIES` under its ``--sampler`` name: the bound order
(:mod:`~mpipe_tune.search._bound_order`), Optuna's samplers with refinement (:mod:`~mpipe_tune.search._sampling`),
and the exhaustive walk (:mod:`~mpipe_tune.search._exhaustive`) where asked for or where the space fits in the
trial budget. The driver only runs one against the problem and the study
(:class:`~mpipe_tune.search._search_run.SearchRun`, where the bounds and the memory rules live).

Optuna is imported in search/ only.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import stop_requests
from mpipe_tune.algebra import Candidate
from mpipe_tune.search._bound_order import BoundOrder
from mpipe_tune.search._evaluate import Evaluation, Evaluator
from mpipe_tune.search._exhaustive import Exhaustive
from mpipe_tune.search._sampling import NSGAII, TPE, RandomSampling
from mpipe_tune.search._search_run import SearchRun, stored_trials, trial_info
from mpipe_tune.search._space import SearchSpace, twin_bounds
from mpipe_tune.search._store import (
    check_file, check_study_size, check_trial_budget, claim_study, fault_of, names_storage_faults, payload_digest,
)
from mpipe_tune.search._strategy import SearchStrategy, StrategySettings

DEFAULT_STORAGE = "sqlite:///mpipe-tune.db"
STRATEGIES: dict[str, SearchStrategy] = {s.name: s for s in (
    BoundOrder(),
    TPE(),
    NSGAII(),
    RandomSampling(),
)}
"""The strategies ``--sampler`` names. ``bound`` (the default): the points in increasing order of their
step-time lower bound, whole groups of them bounded first (:mod:`~mpipe_tune.search._grouped`), until the rest
cannot beat the best by more than the tolerance; the others sample."""
SAMPLERS = tuple(STRATEGIES)
EXHAUSTIVE = Exhaustive()
"""The strategy the driver runs where every point is asked for, or the space fits in the trial budget."""
BOUND_SHARE = 0.05
"""``bound`` without a trial budget: it stops on its tolerance, or at the latest once the study holds this
share of the space's points (:func:`bound_trial_cap`): the tolerance stops every measured problem first
(benchmarks/README.md), and the cap keeps a space of tens of thousands of plans within the tolerance of each
other's bounds (512 devices) to minutes, with the gap it leaves named."""
BOUND_MIN_TRIALS = 2_000
"""The least cap of :func:`bound_trial_cap`, and a sampler's budget where ``bound`` is asked for but not run."""
BOUND_MAX_TRIALS = 5_000
"""The largest cap of :func:`bound_trial_cap`: a space of a million points (16,384 devices) stops there, in
minutes, rather than at 50,000 predictions; ``--trials`` raises it."""
_OPEN_ATTEMPTS = 5
"""Tries at opening the study, when workers started together race to create its database."""
optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@dataclass(frozen=True)
class SearchResult:
    best: Evaluation | None
    """The best plan that fits memory; None when no evaluated plan fits."""
    least_memory: Evaluation | None
    """The plan with the smallest peak memory seen (what to report when nothing fits); when it is
    inexact its peak is its static memory, a lower bound."""
    num_trials: int
    """Finished trials in the study, earlier runs included."""
    num_new: int
    """Trials this run added."""
    num_evaluated: int
    """Distinct candidates this run predicted in full (whether or not the evaluator had them cached)."""
    num_bounded: int
    """Candidates this run settled by their lower bound alone."""
    space_size: int | None
    """Points in the space, when enumerated (exhaustive mode)."""
    mode: str
    """``optuna`` or ``exhaustive``."""
    study_name: str
    storage: str
    interrupted: bool
    wall_s: float
    gap: float | None = None
    """Bound order: how much faster than the best the best unvisited point could still be (its bound's
    shortfall, a share of the best's step time), 0 when every point was visited or settled; None otherwise."""
    tolerance: float = 0.0
    ending: str = "budget"
    """Why the run stopped: ``budget`` (the study holds the requested trials, or a sampled run's
    timeout), ``enumerated`` (an exhaustive run), ``converged`` (the sampler kept proposing settled
    points and the untried rest of the space is larger than the budget left), ``exhaustive`` (it
    converged and the untried rest was enumerated with bounds: the best is the space's optimum)."""
    num_settled: int = 0
    """Settled proposals this run (already tried, no untried neighbour open): no trial each."""
    trial_cap: int | None = None
    """The study's total of trials the run stopped at or would have (the budget given, or
    :func:`bound_trial_cap`)."""
    timed_out: bool = False
    """The time budget (``timeout_s``) stopped it."""

    def how(self, sampler: str) -> str:
        """How the study was searched, for the summary line."""
        if self.mode == "bound":
            gap = "" if self.gap is None else f"remaining gap {self.gap:.2%}"
            stop = {"bound": f"stopped: the rest cannot beat the best by more than the {self.tolerance:.1%} tolerance "
                             f"({gap})",
                    "enumerated": "every point predicted or settled by its bound",
                    "budget": f"stopped at the {self.budget_text()} ({gap})"}[self.ending]
            return f"{self.space_size} points in lower-bound order; {stop}"
        if self.mode == "exhaustive":
            return f"{self.space_size} points, exhaustive"
        if self.ending == "exhaustive":
            return (f"sampler {sampler} converged ({self.num_settled} settled proposals), then the rest of the "
                    f"{self.space_size} points exhaustive with bounds")
        if self.ending == "converged":
            return f"sampler {sampler} converged: {self.num_settled} settled proposals, stopped before the budget"
        return f"sampler {sampler}"

    def budget_text(self) -> str:
        """Which budget stopped the run: the time budget, or the trial cap (and how many trials)."""
        if self.timed_out:
            return "time budget"
        return "trial budget" if self.trial_cap is None else f"trial budget of {self.trial_cap:,} trials"


def bound_trial_cap(points: int) -> int:
    """The trial cap of ``bound`` when none is given: :data:`BOUND_SHARE` of the space's ``points``, at
    least :data:`BOUND_MIN_TRIALS` and at most :data:`BOUND_MAX_TRIALS`.

    >>> bound_trial_cap(27_240), bound_trial_cap(64_000), bound_trial_cap(1_000_000)
    (2000, 3200, 5000)
    """
    return min(BOUND_MAX_TRIALS, max(BOUND_MIN_TRIALS, math.ceil(points * BOUND_SHARE)))


def problem_key(evaluator: Evaluator, space: SearchSpace) -> str:
    """A digest of everything a trial's value depends on: a study is for one problem only."""
    return payload_digest(problem_payload(evaluator, space))


def problem_payload(evaluator: Evaluator, space: SearchSpace) -> dict:
    """Everything a trial's value depends on, by part (what :func:`problem_key` digests)."""
    p = evaluator.problem
    if p.dataset is not None:
        source = p.dataset.content_hash
    else:
        source = p.mix if p.mix is not None else [[mb.image_tokens, mb.text_tokens, list(mb.images)]
                                                   for mb in p.workload.microbatches]
    return {
        "model": p.model.content_hash(), "profile": p.profile.content_hash(), "source": source,
        "devices": p.devices, "global_batch": p.global_batch, "samples": p.samples, "seed": p.seed,
        "options": repr(p.options), "space": repr(space.options),
    }


def default_study_name(evaluator: Evaluator, space: SearchSpace) -> str:
    p = evaluator.problem
    return f"{p.model.name}.{p.profile.name}.{p.source_name}.{p.devices}dev.{problem_key(evaluator, space)[:8]}"


@names_storage_faults
def run_search(
    space: SearchSpace,
    evaluator: Evaluator,
    *,
    storage: str | None = DEFAULT_STORAGE,
    study_name: str | None = None,
    n_trials: int | None = 200,
    timeout_s: float | None = None,
    seed: int = 0,
    sampler: str = "tpe",
    exhaustive: bool | None = None,
    progress: bool = True,
    refine: bool = True,
    prune: bool = True,
    sync_every_s: float = 10.0,
    on_trial: Callable[[Evaluation], None] | None = None,
    seeds: Sequence[Evaluation] = (),
    tolerance: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> SearchResult:
    """Run (or continue) the study until it holds ``n_trials`` finished trials, ``timeout_s`` passes
    or Ctrl-C (``n_trials=None``: with sampler ``bound``, :func:`bound_trial_cap` of the space's points,
    else :data:`BOUND_MIN_TRIALS`). ``exhaustive=None`` enumerates when the space has at
    most ``n_trials`` points;
    ``refine`` and ``prune`` switch the hill-climbing and the bounds described above. ``seeds``: plans
    already evaluated (each baseline's own best, the current layout): the fastest that fits is the
    incumbent the bounds prune against from the start (they are not trials of the study). ``tolerance``:
    with sampler ``bound``, stop once no unvisited point can beat the best by more than this share.
    ``clock``: what ``timeout_s`` is read on (``time.process_time``: this process's CPU seconds, a budget that
    does not shrink on a shared machine)."""
    if n_trials is not None and n_trials < 1:
        raise MpipeError(f"trial budget is {n_trials}, but at least one trial is needed", quantities=("trial budget",))
    if n_trials is not None:
        check_trial_budget(n_trials)
    if not 0 <= tolerance < 1:  # checked before the study's storage is opened (a file is created then)
        raise MpipeError(f"tolerance is {tolerance}, but it must be a share >= 0 and < 1, e.g. 0.01 for 1%",
                         quantities=("tolerance",))
    if sampler not in SAMPLERS:
        raise MpipeError(f"sampler {sampler!r} is unknown; use one of {', '.join(SAMPLERS)}", quantities=("sampler",))
    start = time.perf_counter()
    evaluator.twin_bounds = twin_bounds(space)
    study_name = study_name or default_study_name(evaluator, space)
    study = _open_study(storage, study_name, problem_payload(evaluator, space))
    bound = sampler == "bound" and not exhaustive
    if n_trials is None:  # bound: a share of the space's points (counted by group, no point built)
        n_trials = bound_trial_cap(sum(g.size for g in space.groups())) if bound else BOUND_MIN_TRIALS
    if bound:
        strategy = STRATEGIES[sampler]
    elif exhaustive or (exhaustive is None and _count_up_to(space, n_trials + 1) <= n_trials):
        strategy = EXHAUSTIVE
    else:
        strategy = STRATEGIES[sampler]
    settings = StrategySettings(n_trials, seed, tolerance, refine, sync_every_s)
    with stop_requests() as stop:
        run = SearchRun(space, evaluator, study, storage, timeout_s, start, progress, prune, on_trial, stop)
        run.clock, run.start = clock, clock() - (time.perf_counter() - start)
        run.sync_every_s = sync_every_s
        run.seed_incumbent(seeds)
        size = None
        try:
            size = strategy.search(run, settings)
        except KeyboardInterrupt:  # a second Ctrl-C, or Ctrl-C where the first cannot be deferred
            run.interrupted = True
        finally:
            run.close()
        run.interrupted = run.interrupted or stop.requested
    best, least = _best_of(stored_trials(study), evaluator)
    if run.least is not None and (least is None or run.least.peak_bytes < least.peak_bytes):
        least = run.least
    if strategy is EXHAUSTIVE:
        run.ending = "enumerated"
    elif run.ending == "exhaustive":
        size = run.space_size
    return SearchResult(best, least, len(stored_trials(study)), run.new, len(run.predicted), run.bounded, size,
                        strategy.mode, study_name, storage, run.interrupted, time.perf_counter() - start,
                        run.gap if strategy.mode == "bound" else None,
                        tolerance if strategy.mode == "bound" else 0.0, run.ending, run.settled,
                        n_trials if strategy.trial_cap else None, run.timed_out)


# --------------------------------------------------------------------------------------- study


def _create_study(storage: str | None, study_name: str):
    """``optuna.create_study`` (or load it), retried while workers started together race to create the
    same new database or study; any other failure is one line."""
    check_file(storage)
    check_study_size(storage, study_name)
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            return optuna.create_study(storage=storage, study_name=study_name, direction="minimize",
                                       load_if_exists=True)
        except Exception as exc:  # bad URL, missing driver, unreadable file: whatever the RDB layer raises
            racing = type(exc).__name__ in ("IntegrityError", "OperationalError", "DuplicatedStudyError")
            if not racing or attempt + 1 == _OPEN_ATTEMPTS:
                detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise fault_of(exc, storage) or MpipeError(
                    f"study storage {storage}: cannot open it as an Optuna storage ({detail}); give an RDB URL such "
                    f"as sqlite:///mpipe-tune.db", quantities=("study storage",)) from None
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _open_study(storage: str | None, study_name: str, payload: dict):
    """The study in ``storage`` (an RDB URL; None: in memory, for benchmarks and tests), claimed for the
    problem ``payload`` describes (see :func:`~mpipe_tune.search._store.claim_study`)."""
    study = _create_study(storage, study_name)
    claim_study(study, storage, payload)
    return study


def _best_of(trials, evaluator: Evaluator) -> tuple[Evaluation | None, Evaluation | None]:
    """The best exact trial that fits and the trial with the least memory (its peak may be the
    static lower bound of a settled trial), as Evaluations."""
    exact = [t for t in trials if trial_info(t).get("exact", True)]
    feasible = [t for t in exact if trial_info(t)["memory_excess_gib"] <= 0]
    best = min(feasible, key=lambda t: (t.value, t.number), default=None)
    measured = [t for t in trials if trial_info(t)["peak_bytes"] is not None]
    least = min(measured, key=lambda t: (trial_info(t)["peak_bytes"], t.value), default=None)

    def as_eval(t):
        if t is None:
            return None
        c = Candidate.from_dict(trial_info(t)["candidate"])
        return evaluator.evaluate(c) if trial_info(t).get("exact", True) else evaluator.bounded(c)

    best_e = as_eval(best)
    # A trial slower than a seed was stored without a memory estimate (counted as fitting); its own peak decides.
    return (best_e if best_e is None or best_e.fits else None), as_eval(least)


def _count_up_to(space: SearchSpace, limit: int) -> int:
    count = 0
    for _ in space.enumerate():
        count += 1
        if count >= limit:
            break
    return count
