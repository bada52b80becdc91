"""Driving the search: an Optuna study (sampled) or every point of the space (exhaustive).

**Storage.** The study lives in an Optuna RDB storage (SQLite file ``mpipe-tune.db`` in the working
directory by default, any RDB URL for several workers). Each finished trial is written to it as soon
as it is told, so a killed search loses only the trial in flight, and rerunning the same command
continues the study: ``--trials`` is the study's total, not this run's. Sampling itself runs on an
in-memory mirror of the study, seeded with the stored trials and re-synchronised with trials other
workers wrote every ``sync_every_s`` seconds: the sampler reads the whole history on every trial,
and reading it from SQLite costs more than the whole evaluation (2,000 trivial TPE trials: 173 s on
SQLite, 48 s in memory, on the 2-core benchmark machine).

**Several workers.** Any number of ``plan`` processes may share one study: they stop at the
requested total. When it starts and whenever it re-synchronises, a worker counts the study's finished
trials (its own still queued for the trial writer included) and stops at ``n_trials`` (counting before
every trial cost a tenth of the default example's search: a read of every trial); each trial is stored by
:func:`~mpipe_tune.search.writer.store_trial`, which decides from what the storage holds at that
moment and reserves the last places, so that workers finishing at the same moment cannot pass the
total either (a trial that finds the study full is stored as failed, and its worker stops).
Exhaustive workers skip the points another worker has already stored and prune against its best.

**Constraints.** A plan over memory capacity is infeasible, not penalised: each trial records its
memory excess (GiB over capacity, <= 0 when it fits) as an Optuna constraint, which TPE and NSGA-II
use to steer away, and which ``best`` respects.

**Bounds.** Two bounds settle a candidate without deriving it: its static memory (weights,
gradients, optimizer state, read off the placement) over capacity means it cannot fit; once a plan
that fits is known, a step-time lower bound (:meth:`Evaluator.lower_bound`) already slower means it
cannot win. Its trial records the bounds, marked inexact, and can never be the best. Exhaustive
search visits points in increasing bound order and stops evaluating at the first bound above the
best that fits, so it stays exact.

**Memory** is estimated only for plans that could become the best (faster than the best that fits,
or when none fits yet): a slower plan's trial records no peak and counts as fitting, harmlessly, as
it can never be the best.

**Refinement.** In sampled mode, once half the budget is spent, the trials are a best-first local
search: the next trial is an untried neighbour (one choice changed) of the most promising trial that
has any left (fastest, by step time or bound; a plan a little over memory counts slower by its peak
over the capacity), passing over neighbours whose bound already loses (they cost no trial); the sampler
proposes only when no trial has. A sampler proposal that was already tried is replaced by one of its
untried neighbours, so trials are not spent on repeats.

**Convergence.** A proposal that was already tried and has no untried neighbour that its bounds
leave open is *settled*: it costs no trial (the sampler is told it failed, so it is not in its
history). After ``_SETTLED_STREAK`` settled proposals in a row the sampler has converged: the
refinement starts at once if it has not yet, and once it has run out of neighbours to try too, the run
ends early: when the untried rest of the space fits in the trial budget that is left, it is
enumerated in increasing bound order as in exhaustive mode (so the result is the space's optimum),
else the run stops as converged. :attr:`SearchResult.ending` says which, and :meth:`SearchResult.how`
is the summary's wording.

Optuna is imported here and in search/ only (the trial writer's child process, :mod:`mpipe_tune.search.trials`).
"""

from __future__ import annotations

import heapq
import math
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import StopRequest, stop_requests
from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.search.evaluate import Evaluation, Evaluator
from mpipe_tune.search.grouped import GroupOrder, StagedWorkBound
from mpipe_tune.search.space import SearchSpace, twin_bounds
from mpipe_tune.search.store import (check_file, check_study_size, check_trial_budget, claim_study, fault_of,
                                     names_storage_faults, payload_digest)
from mpipe_tune.search.writer import TrialWriter, store_trial

DEFAULT_STORAGE = "sqlite:///mpipe-tune.db"
SAMPLERS = ("bound", "tpe", "nsga2", "random")
"""``bound`` (the default): the points in increasing order of their step-time lower bound, whole groups of
them bounded first (:mod:`~mpipe_tune.search.grouped`), until the rest cannot beat the best by more than
the tolerance; the others sample."""
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
ATTR = "mpipe"
"""The one user attribute of a trial (each attribute is a row in an RDB: fewer rows, faster writes)."""
_PRUNE_MARGIN = 1e-9
_NEAR_FIT = 1.25
"""Plans up to this many times over memory stay in the refinement's frontier (the way to a fitting
optimum can pass through them); plans further over are left out, as their neighbours rarely fit."""
_WRITER_FROM = 400
"""Runs expected to add at least this many trials write them from a child process (see writer.py)."""
_OPEN_ATTEMPTS = 5
"""Tries at opening the study, when workers started together race to create its database."""
_GIB = 2.0**30
_FORCED_WAIT_S = 5.0
"""After a second Ctrl-C, how long the search waits for the trial writer before it leaves it to finish alone."""
_SETTLED_STREAK = 20
"""Settled proposals in a row (see Convergence) after which the sampler counts as converged."""
_HAS_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")  # Optuna >= 5; older: constraints_func

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
    size = None
    bound = sampler == "bound" and not exhaustive
    if n_trials is None:  # bound: a share of the space's points (counted by group, no point built)
        n_trials = bound_trial_cap(sum(g.size for g in space.groups())) if bound else BOUND_MIN_TRIALS
    if bound:
        exhaustive = False
    elif exhaustive is None:
        exhaustive = _count_up_to(space, n_trials + 1) <= n_trials
    with stop_requests() as stop:
        run = _Run(space, evaluator, study, storage, timeout_s, start, progress, prune, on_trial, stop)
        run.clock, run.start = clock, clock() - (time.perf_counter() - start)
        run.sync_every_s = sync_every_s
        run.seed_incumbent(seeds)
        try:
            if exhaustive:
                size = run.exhaustive()
            elif bound:
                size = run.exhaustive(tolerance, n_trials)
            else:
                run.sampled(n_trials, seed, sampler, refine, sync_every_s)
        except KeyboardInterrupt:  # a second Ctrl-C, or Ctrl-C where the first cannot be deferred
            run.interrupted = True
        finally:
            run.close()
        run.interrupted = run.interrupted or stop.requested
    best, least = _best_of(_stored(study), evaluator)
    if run.least is not None and (least is None or run.least.peak_bytes < least.peak_bytes):
        least = run.least
    if exhaustive:
        run.ending = "enumerated"
    elif run.ending == "exhaustive":
        size = run.space_size
    mode = "exhaustive" if exhaustive else "bound" if bound else "optuna"
    return SearchResult(best, least, len(_stored(study)), run.new, len(run.predicted), run.bounded, size, mode,
                        study_name, storage, run.interrupted, time.perf_counter() - start,
                        run.gap if bound else None, tolerance if bound else 0.0, run.ending, run.settled,
                        None if exhaustive else n_trials, run.timed_out)


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
    problem ``payload`` describes (see :func:`~mpipe_tune.search.store.claim_study`)."""
    study = _create_study(storage, study_name)
    claim_study(study, storage, payload)
    return study


def _info(trial) -> dict:
    return trial.user_attrs.get(ATTR, {})


def _stored(study) -> list:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "candidate" in _info(t)]


def _best_of(trials, evaluator: Evaluator) -> tuple[Evaluation | None, Evaluation | None]:
    """The best exact trial that fits and the trial with the least memory (its peak may be the
    static lower bound of a settled trial), as Evaluations."""
    exact = [t for t in trials if _info(t).get("exact", True)]
    feasible = [t for t in exact if _info(t)["memory_excess_gib"] <= 0]
    best = min(feasible, key=lambda t: (t.value, t.number), default=None)
    measured = [t for t in trials if _info(t)["peak_bytes"] is not None]
    least = min(measured, key=lambda t: (_info(t)["peak_bytes"], t.value), default=None)

    def as_eval(t):
        if t is None:
            return None
        c = Candidate.from_dict(_info(t)["candidate"])
        return evaluator.evaluate(c) if _info(t).get("exact", True) else evaluator.bounded(c)

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


def _make_sampler(name: str, seed: int):
    constraints = {} if _HAS_SET_CONSTRAINT else {"constraints_func": lambda t: (_info(t)["memory_excess_gib"],)}
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **constraints)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, **constraints)
    return optuna.samplers.RandomSampler(seed=seed)


def _distributions(space: SearchSpace, params: dict) -> dict[str, CategoricalDistribution]:
    """The options of each parameter on the path to ``params`` (replayed through the tree)."""
    out = {}

    def choose(name, options):
        out[name] = CategoricalDistribution(list(options))
        return params[name]

    space.build(choose)
    return out


# ----------------------------------------------------------------------------------------- run


def _priority(step_s: float, peak_bytes: float | None, evaluator: Evaluator) -> float | None:
    """A trial's rank in the frontier: its step time (or bound), scaled up by how far it is over
    memory; None (left out) when it is more than ``_NEAR_FIT`` times over."""
    capacity = evaluator.problem.profile.memory_capacity_bytes
    if peak_bytes is None or peak_bytes <= capacity:
        return step_s
    return step_s * peak_bytes / capacity if peak_bytes <= _NEAR_FIT * capacity else None


class _Frontier:
    """Trials, fastest first, with their neighbours: the next neighbour to try is an untried one of
    the fastest trial that has any left (a best-first search over one-choice moves). Plans settled by
    their lower bound rank by it (optimistic); plans a little over memory rank by step time times peak
    over capacity: the way to the optimum can pass through slower plans and plans that do not fit."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.heap: list = []
        self.count = 0

    def add(self, value: float | None, params: dict) -> None:
        if value is None:
            return
        heapq.heappush(self.heap, (value, self.count, params, None))
        self.count += 1

    def next_untried(self, skip: Callable[[Candidate], bool]) -> dict | None:
        """The parameters of the next neighbour to try, passing over those ``skip`` rejects."""
        while self.heap:
            value, count, params, neighbours = self.heap[0]
            if neighbours is None:
                neighbours = self.space.neighbors(params)
                heapq.heapreplace(self.heap, (value, count, params, neighbours))
            while neighbours and skip(neighbours[0][1]):
                neighbours.pop(0)
            if neighbours:
                return neighbours.pop(0)[0]
            heapq.heappop(self.heap)
        return None


class _Run:
    """One run's bookkeeping: the incumbent, what was tried, counters, the progress bar."""

    def __init__(self, space, evaluator, study, storage, timeout_s, start, progress, prune, on_trial,
                 stop: StopRequest) -> None:
        self.space, self.evaluator, self.study, self.storage, self.stop = space, evaluator, study, storage, stop
        self.writer: TrialWriter | None = None
        self.timeout_s, self.start, self.progress, self.prune, self.on_trial = timeout_s, start, progress, prune, on_trial
        self.clock: Callable[[], float] = time.perf_counter
        """What :attr:`timeout_s` is read on, from :attr:`start`."""
        self.stored = _stored(study)
        self.tried = {Candidate.from_dict(_info(t)["candidate"]) for t in self.stored}
        self.lost: set[Candidate] = set()
        self.least: Evaluation | None = None
        """The evaluation with the smallest peak (or static bound) this run saw."""
        exact = [t.value for t in self.stored if _info(t).get("exact", True) and _info(t)["memory_excess_gib"] <= 0]
        self.incumbent = min(exact, default=None)
        self.worker = uuid.uuid4().hex[:12]
        self.new = self.bounded = 0
        self._synced = len(self.stored)
        """How many stored trials :meth:`absorb_others` has looked at."""
        self.predicted: set[Candidate] = set()
        self.interrupted = False
        self.bar = None
        self.ending = "budget"
        self.timed_out = False
        self.settled = 0
        self.space_size: int | None = None
        self.gap: float | None = None
        self.sync_every_s = 10.0
        """How often an enumeration reads the trials other workers stored (each read is a read of every trial)."""

    def seed_incumbent(self, seeds: Sequence[Evaluation]) -> None:
        """Start from the fastest of ``seeds`` that fits, where it beats the study's best."""
        fitting = [e.mean_s for e in seeds if e.exact and e.peak_bytes is not None and e.fits]
        if fitting and (self.incumbent is None or min(fitting) < self.incumbent):
            self.incumbent = min(fitting)

    def must_stop(self) -> bool:
        """Ctrl-C asked to stop, or the time budget is spent (:attr:`timed_out`): checked between two trials."""
        if self.timeout_s is not None and self.clock() - self.start > self.timeout_s:
            self.timed_out = True
        return self.stop.requested or self.timed_out

    def open_bar(self, total: int, label: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.progress and total > 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="trial", dynamic_ncols=True, leave=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close(wait_s=_FORCED_WAIT_S if self.stop.forced else None)
            self.new -= self.writer.refused.value  # handed over, but found the study full

    def start_writing(self, expected_new: int, n_trials: int | None = None) -> None:
        if self.writer is None and self.storage is not None and expected_new >= _WRITER_FROM:
            self.writer = TrialWriter(self.storage, self.study.study_name, n_trials)

    def record(self, trial, n_trials: int | None = None) -> bool:
        """Persist a finished trial (a FrozenTrial) in the study; with ``n_trials``, only while the study
        holds fewer (see :func:`~mpipe_tune.search.writer.store_trial`). False: the study is full."""
        if self.writer is not None:
            if self.writer.full.is_set():
                return False
            self.writer.put(trial)
            return True
        if self.storage is None:
            self.study.add_trial(trial)
            return True
        if store_trial(self.study, trial, n_trials, self.storage):
            return True
        self.new -= 1  # it found the study full: stored as failed, not a trial of this run
        return False

    def study_total(self) -> int:
        """Finished trials in the study now, every worker's, this run's still queued for the writer included."""
        stored = _stored(self.study)
        if self.writer is None:
            return len(stored)
        mine = sum(1 for t in stored if str(_info(t).get("uid", "")).startswith(f"{self.worker}-"))
        return len(stored) + self.new - mine

    def study_full(self, n_trials: int) -> bool:
        """The shared study already holds ``n_trials`` finished trials (other workers count too)."""
        return self.storage is not None and self.study_total() >= n_trials

    def absorb_others(self) -> list:
        """Trials stored since the last call that other workers wrote, now counted as tried (and their
        best plan that fits as the incumbent the bounds prune against)."""
        stored = _stored(self.study)
        fresh, self._synced = stored[self._synced:], len(stored)
        others = [t for t in fresh if not str(_info(t).get("uid", "")).startswith(f"{self.worker}-")]
        for t in others:
            info = _info(t)
            self.tried.add(Candidate.from_dict(info["candidate"]))
            if info.get("exact", True) and info["memory_excess_gib"] <= 0 and (
                    self.incumbent is None or t.value < self.incumbent):
                self.incumbent = t.value
        return others

    def settled_by_bounds(self, c: Candidate) -> bool:
        """Its static memory alone is over capacity, or its step-time bound (for a ZeRO-3 plan, also its stage-1
        twin's step where that is predicted already: :meth:`Evaluator.twin_s`) loses to the best fitting plan."""
        if not self.prune:
            return False
        static = self.evaluator.static_peak_bytes(c)
        if static is not None and static > self.evaluator.problem.profile.memory_capacity_bytes:
            return True
        if self.incumbent is None:
            return False
        twin = self.evaluator.twin_s(c, predict=False)  # a ZeRO-3 plan's twin's step, where it is known
        if twin > 0 and twin >= self.incumbent:  # it can at best tie the twin, or a plan as fast that fits
            return True
        return self.evaluator.lower_bound(c) > self.incumbent * (1 + _PRUNE_MARGIN)

    def hopeless(self, c: Candidate) -> bool:
        """Tried already, or settled by its bounds: not worth a trial."""
        if c in self.tried or c in self.lost:
            return True
        if self.settled_by_bounds(c):
            self.lost.add(c)  # the incumbent only improves: it stays settled
            return True
        return False

    def evaluate(self, c: Candidate) -> Evaluation:
        """The candidate's evaluation, or its bounds when they settle it (see :meth:`settled_by_bounds`)."""
        e = self._evaluate(c)
        if e.peak_bytes is not None and (self.least is None or e.peak_bytes < self.least.peak_bytes):
            self.least = e
        return e

    def _evaluate(self, c: Candidate) -> Evaluation:
        if self.settled_by_bounds(c):
            self.bounded += 1
            return self.evaluator.bounded(c)
        e = self.evaluator.evaluate(c, memory=False)
        if self.incumbent is None or e.mean_s < self.incumbent:  # it could be the best: does it fit?
            e = self.evaluator.evaluate(c)
        self.predicted.add(c)
        if e.fits and (self.incumbent is None or e.mean_s < self.incumbent):
            self.incumbent = e.mean_s
        return e

    def info(self, e: Evaluation) -> dict:
        uid = f"{self.worker}-{self.new}"
        self.new += 1
        self.tried.add(e.candidate)
        if self.bar is not None:
            self.bar.update(1)
            if self.incumbent is not None:
                self.bar.set_postfix_str(f"best {self.incumbent * 1e3:.4g} ms", refresh=False)
        if self.on_trial:
            self.on_trial(e)
        return {
            "candidate": e.candidate.to_dict(), "mean_s": e.mean_s, "p90_s": e.p90_s, "exact": e.exact,
            "bubble_share": None if not e.exact else e.bubble_share, "peak_bytes": e.peak_bytes,
            "memory_excess_gib": e.memory_excess_bytes / _GIB, "uid": uid,
        }

    def exhaustive(self, tolerance: float = 0.0, n_trials: int | None = None) -> int:
        """Every point not yet in the study, in increasing bound order, until the next bound cannot beat the
        best that fits by more than ``tolerance`` (0: exact), or the study holds ``n_trials``; returns the
        space size. Sets :attr:`gap` and, when it stops early, :attr:`ending`.

        The order (:class:`~mpipe_tune.search.grouped.GroupOrder`) bounds whole groups of points (one
        layout, microbatch count and memory setting) first and builds a group's points only when its bound
        comes on top, so a space of a million points costs the groups that could win; a group whose static
        memory floor cannot fit is never opened. Inside, the bounds refine lazily
        (:meth:`Evaluator.bound_at`): a point whose owners a per-step policy chooses (``greedy``,
        ``optimal``) gets the bound for any owner map first, and its owners' bound only when it comes out on
        top, so the owners of points that lose are never computed."""
        ev, capacity = self.evaluator, self.evaluator.problem.profile.memory_capacity_bytes
        if self.prune:
            work = StagedWorkBound(ev)
            order = GroupOrder(self.space, ev.static_floor_bytes, capacity, work, work.levels, ev.bound_levels,
                               ev.bound_at, self.tried, expect=work.expect)
        else:
            order = GroupOrder(self.space, lambda c: 0.0, capacity, lambda c, level: 0.0, 1, lambda c: (0, 0),
                               lambda c, level: 0.0, self.tried)
        self.open_bar(order.left, "plan (exhaustive)" if n_trials is None else "plan (bound order)")
        self.start_writing(order.left)
        self.gap, self.ending = 0.0, "enumerated"
        last_sync = time.perf_counter()
        while order:
            low = order.low()
            full = n_trials is not None and len(self.stored) + self.new >= n_trials
            if self.must_stop() or full:
                self.ending = "budget"
                if self.incumbent is not None and self.prune:
                    self.gap = max(0.0, 1 - low / self.incumbent)
                break
            if self.storage is not None and time.perf_counter() - last_sync > self.sync_every_s:
                last_sync = time.perf_counter()  # another worker may have stored this point meanwhile
                self.absorb_others()
            if low == math.inf and self.incumbent is None:  # nothing fits: find the plan of least static memory
                self.bounded += order.left
                self.least_static(order.unfit())
                break
            if self.prune and self.incumbent is not None and low * (1 + tolerance) > self.incumbent * (1 + _PRUNE_MARGIN):
                self.bounded += order.left  # the least bound of the rest loses too (or by < tolerance)
                self.gap = max(0.0, 1 - low / self.incumbent)
                self.ending = "bound" if self.gap > 0 else "enumerated"
                break
            point = order.step()
            if point is None or point[1] in self.tried:
                continue
            params, candidate = point
            e = self.evaluate(candidate)
            if not e.exact:  # its static memory alone is over capacity
                continue
            info = self.info(e)
            system = {"constraints:memory": info["memory_excess_gib"]} if _HAS_SET_CONSTRAINT else {}
            self.record(optuna.trial.create_trial(
                params=params, distributions=_distributions(self.space, params), value=e.mean_s,
                user_attrs={ATTR: info}, system_attrs=system,
            ))
        return order.size

    def least_static(self, groups: Sequence[tuple[float, Sequence[tuple[dict, Candidate]]]]) -> None:
        """Where no point fits: the static memory of the points of ``groups`` (least floor first), until the
        next group's floor is above the least static memory found (no point of it can be below)."""
        for floor, points in groups:
            if self.least is not None and floor >= self.least.peak_bytes:
                return
            for _, c in points:
                if self.must_stop():
                    return
                self.evaluate(c)
                self.bounded -= 1  # counted already

    def converged(self, budget: int) -> None:
        """The sampler converged with ``budget`` trials left: enumerate the untried rest of the space
        when it fits in them (``ending`` ``exhaustive``), else stop (``converged``)."""
        untried = 0
        for _, c in self.space.enumerate():
            untried += c not in self.tried
            if untried > budget:
                self.ending = "converged"
                return
        self.space_size = self.exhaustive()
        self.ending = "exhaustive"

    def propose(self, mirror):
        """Ask the sampler for a point: (trial, params, candidate)."""
        trial = mirror.ask()
        params: dict = {}

        def choose(name, options):
            params[name] = trial.suggest_categorical(name, list(options))
            return params[name]

        return trial, params, self.space.build(choose)

    def sampled(self, n_trials: int, seed: int, sampler: str, refine: bool, sync_every_s: float) -> None:
        remaining = n_trials - len(self.stored)
        if remaining <= 0:
            return
        mirror = optuna.create_study(direction="minimize", sampler=_make_sampler(sampler, seed + len(self.stored)))
        known: set = set()
        frontier = _Frontier(self.space)
        for t in self.stored:
            mirror.add_trial(t)
            known.add(_info(t).get("uid"))
            frontier.add(_priority(t.value, _info(t)["peak_bytes"], self.evaluator), t.params)
        explore_until = len(self.stored) + (remaining // 2 if refine else remaining)
        last_sync = time.perf_counter()
        self.open_bar(remaining, "plan")
        self.start_writing(remaining, n_trials)
        done = streak = 0
        full = self.study_full(n_trials)
        while done < remaining and not full and not self.must_stop():
            if self.writer is not None and self.writer.full.is_set():
                break
            if refine and len(self.stored) + done >= explore_until:
                step = frontier.next_untried(self.hopeless)
                if step is not None:
                    mirror.enqueue_trial(step)
            trial, params, candidate = self.propose(mirror)
            if candidate in self.tried:  # the sampler proposes a point already tried: try an untried neighbour
                alternative = next(((p, c) for p, c in self.space.neighbors(params) if not self.hopeless(c)), None)
                mirror.tell(trial, state=TrialState.FAIL)  # a discarded proposal, not a trial
                if alternative is None:  # settled: no trial, and after a streak of them, converged
                    self.settled += 1
                    streak += 1
                    if streak >= _SETTLED_STREAK and refine and len(self.stored) + done < explore_until:
                        explore_until, streak = len(self.stored) + done, 0  # the sampler settled early: refine now
                    elif streak >= _SETTLED_STREAK:
                        self.converged(remaining - done)
                        return
                    continue
                mirror.enqueue_trial(alternative[0])
                trial, params, candidate = self.propose(mirror)
            streak = 0
            e = self.evaluate(candidate)
            info = self.info(e)
            trial.set_user_attr(ATTR, info)
            if _HAS_SET_CONSTRAINT:
                trial.set_constraint("memory", info["memory_excess_gib"])
            frozen = mirror.tell(trial, e.mean_s)
            stored = self.record(optuna.trial.create_trial(
                params=frozen.params, distributions=frozen.distributions, value=e.mean_s,
                user_attrs=frozen.user_attrs, system_attrs=frozen.system_attrs,
            ), n_trials)
            if not stored:  # other workers finished the study first
                break
            known.add(info["uid"])
            done += 1
            frontier.add(_priority(e.mean_s, e.peak_bytes, self.evaluator), params)
            if time.perf_counter() - last_sync > sync_every_s:
                last_sync = time.perf_counter()
                for t in _stored(self.study):
                    uid = _info(t).get("uid")
                    if uid is not None and uid not in known:
                        mirror.add_trial(t)
                        known.add(uid)
                        self.tried.add(Candidate.from_dict(_info(t)["candidate"]))
                remaining = n_trials - len(known) + done  # other workers count toward the study's total
                full = self.study_full(n_trials)
