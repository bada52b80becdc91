"""Sampling with an Optuna sampler (``--sampler tpe``, ``nsga2``, ``random``), refined by a best-first
local search and ended early once it converges.

Sampling runs on an in-memory mirror of the study, seeded with the stored trials and re-synchronised with
trials other workers wrote every ``sync_every_s`` seconds: the sampler reads the whole history on every
trial, and reading it from SQLite costs more than the whole evaluation (2,000 trivial TPE trials: 173 s on
SQLite, 48 s in memory, on the 2-core benchmark machine).

**Refinement.** Once half the budget is spent, the trials are a best-first local search: the next trial is
an untried neighbour (one choice changed) of the most promising trial that has any left (fastest, by step
time or bound; a plan a little over memory counts slower by its peak over the capacity), passing over
neighbours whose bound already loses (they cost no trial); the sampler proposes only when no trial has. A
sampler proposal that was already tried is replaced by one of its untried neighbours, so trials are not
spent on repeats.

**Convergence.** A proposal that was already tried and has no untried neighbour that its bounds leave open
is *settled*: it costs no trial (the sampler is told it failed, so it is not in its history). After
``_SETTLED_STREAK`` settled proposals in a row the sampler has converged: the refinement starts at once if
it has not yet, and once it has run out of neighbours to try too, the run ends early: when the untried
rest of the space fits in the trial budget that is left, it is enumerated in increasing bound order
(:func:`~mpipe_tune.search._bound_order.walk`, so the result is the space's optimum), else the run stops as
converged. The run's ``ending`` says which.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
import time
from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from mpipe_tune.algebra import Candidate
from mpipe_tune.search._bound_order import walk
from mpipe_tune.search._evaluate import Evaluator
from mpipe_tune.search._search_run import ATTR, HAS_SET_CONSTRAINT, SearchRun, stored_trials, trial_info
from mpipe_tune.search._space import SearchSpace
from mpipe_tune.search._strategy import SearchStrategy, StrategySettings

_NEAR_FIT = 1.25
"""Plans up to this many times over memory stay in the refinement's frontier (the way to a fitting
optimum can pass through them); plans further over are left out, as their neighbours rarely fit."""
_SETTLED_STREAK = 20
"""Settled proposals in a row (see Convergence) after which the sampler counts as converged."""
_CONSTRAINTS = {} if HAS_SET_CONSTRAINT else {"constraints_func": lambda t: (trial_info(t)["memory_excess_gib"],)}


class Sampling(SearchStrategy):
    """An Optuna sampler's proposals, then the refinement; subclasses name the sampler."""

    mode = "optuna"

    @abstractmethod
    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        """The Optuna sampler, seeded with ``seed``."""

    def search(self, run: SearchRun, settings: StrategySettings) -> int | None:
        _sampled(run, self.make_sampler, settings.n_trials, settings.seed, settings.refine, settings.sync_every_s)
        return None


class TPE(Sampling):
    name = "tpe"

    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.TPESampler(seed=seed, **_CONSTRAINTS)


class NSGAII(Sampling):
    name = "nsga2"

    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.NSGAIISampler(seed=seed, **_CONSTRAINTS)


class RandomSampling(Sampling):
    name = "random"

    def make_sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.RandomSampler(seed=seed)


def _sampled(run: SearchRun, make_sampler: Callable[[int], optuna.samplers.BaseSampler], n_trials: int, seed: int,
         refine: bool, sync_every_s: float) -> None:
    remaining = n_trials - len(run.stored)
    if remaining <= 0:
        return
    mirror = optuna.create_study(direction="minimize", sampler=make_sampler(seed + len(run.stored)))
    known: set = set()
    frontier = _Frontier(run.space)
    for t in run.stored:
        mirror.add_trial(t)
        known.add(trial_info(t).get("uid"))
        frontier.add(_priority(t.value, trial_info(t)["peak_bytes"], run.evaluator), t.params)
    explore_until = len(run.stored) + (remaining // 2 if refine else remaining)
    last_sync = time.perf_counter()
    run.open_bar(remaining, "plan")
    run.start_writing(remaining, n_trials)
    done = streak = 0
    full = run.study_full(n_trials)
    while done < remaining and not full and not run.must_stop():
        if run.writer is not None and run.writer.full.is_set():
            break
        if refine and len(run.stored) + done >= explore_until:
            step = frontier.next_untried(run.hopeless)
            if step is not None:
                mirror.enqueue_trial(step)
        trial, params, candidate = _propose(run, mirror)
        if candidate in run.tried:  # the sampler proposes a point already tried: try an untried neighbour
            alternative = next(((p, c) for p, c in run.space.neighbors(params) if not run.hopeless(c)), None)
            mirror.tell(trial, state=TrialState.FAIL)  # a discarded proposal, not a trial
            if alternative is None:  # settled: no trial, and after a streak of them, converged
                run.settled += 1
                streak += 1
                if streak >= _SETTLED_STREAK and refine and len(run.stored) + done < explore_until:
                    explore_until, streak = len(run.stored) + done, 0  # the sampler settled early: refine now
                elif streak >= _SETTLED_STREAK:
                    _converged(run, remaining - done)
                    return
                continue
            mirror.enqueue_trial(alternative[0])
            trial, params, candidate = _propose(run, mirror)
        streak = 0
        e = run.evaluate(candidate)
        info = run.info(e)
        trial.set_user_attr(ATTR, info)
        if HAS_SET_CONSTRAINT:
            trial.set_constraint("memory", info["memory_excess_gib"])
        frozen = mirror.tell(trial, e.mean_s)
        stored = run.record(optuna.trial.create_trial(
            params=frozen.params, distributions=frozen.distributions, value=e.mean_s,
            user_attrs=frozen.user_attrs, system_attrs=frozen.system_attrs,
        ), n_trials)
        if not stored:  # other workers finished the study first
            break
        known.add(info["uid"])
        done += 1
        frontier.add(_priority(e.mean_s, e.peak_bytes, run.evaluator), params)
        if time.perf_counter() - last_sync > sync_every_s:
            last_sync = time.perf_counter()
            for t in stored_trials(run.study):
                uid = trial_info(t).get("uid")
                if uid is not None and uid not in known:
                    mirror.add_trial(t)
                    known.add(uid)
                    run.tried.add(Candidate.from_dict(trial_info(t)["candidate"]))
            remaining = n_trials - len(known) + done  # other workers count toward the study's total
            full = run.study_full(n_trials)


def _converged(run: SearchRun, budget: int) -> None:
    """The sampler converged with ``budget`` trials left: enumerate the untried rest of the space
    when it fits in them (``ending`` ``exhaustive``), else stop (``converged``)."""
    untried = 0
    for _, c in run.space.enumerate():
        untried += c not in run.tried
        if untried > budget:
            run.ending = "converged"
            return
    run.space_size = walk(run)
    run.ending = "exhaustive"


def _propose(run: SearchRun, mirror):
    """Ask the sampler for a point: (trial, params, candidate)."""
    trial = mirror.ask()
    params: dict = {}

    def choose(name, options):
        params[name] = trial.suggest_categorical(name, list(options))
        return params[name]

    return trial, params, run.space.build(choose)


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
