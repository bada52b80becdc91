"""A search's run: what every strategy (:mod:`mpipe_tune.search._strategy`) drives the search through.

:class:`SearchRun` is one run's state against a problem (the space and its evaluator) and a store (the
Optuna study): the incumbent, the points tried, counters, the trial writer and the progress bar; it
evaluates a point (or settles it by its bounds) and records it as a trial.

**Bounds.** Two bounds settle a candidate without deriving it: its static memory (weights,
gradients, optimizer state, read off the placement) over capacity means it cannot fit; once a plan
that fits is known, a step-time lower bound (:meth:`Evaluator.lower_bound`) already slower means it
cannot win. Its trial records the bounds, marked inexact, and can never be the best.

**Memory** is estimated only for plans that could become the best (faster than the best that fits,
or when none fits yet): a slower plan's trial records no peak and counts as fitting, harmlessly, as
it can never be the best.

**Constraints.** A plan over memory capacity is infeasible, not penalised: each trial records its
memory excess (GiB over capacity, <= 0 when it fits) as an Optuna constraint, which TPE and NSGA-II
use to steer away, and which ``best`` respects.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mpipe_tune.algebra import Candidate
from mpipe_tune.interrupt import StopRequest
from mpipe_tune.search._evaluate import Evaluation
from mpipe_tune.search._space import SearchSpace
from mpipe_tune.search._writer import TrialWriter, store_trial

ATTR = "mpipe"
"""The one user attribute of a trial (each attribute is a row in an RDB: fewer rows, faster writes)."""
PRUNE_MARGIN = 1e-9
HAS_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")  # Optuna >= 5; older: constraints_func
_GIB = 2.0**30
_WRITER_FROM = 400
"""Runs expected to add at least this many trials write them from a child process (see _writer.py)."""
_FORCED_WAIT_S = 5.0
"""After a second Ctrl-C, how long the search waits for the trial writer before it leaves it to finish alone."""


def trial_info(trial) -> dict:
    """The attribute the search stores in a trial (:data:`ATTR`): its candidate and predicted figures."""
    return trial.user_attrs.get(ATTR, {})


def stored_trials(study) -> list:
    """The study's finished trials that hold a candidate."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "candidate" in trial_info(t)]


def point_distributions(space: SearchSpace, params: dict) -> dict[str, CategoricalDistribution]:
    """The options of each parameter on the path to ``params`` (replayed through the tree)."""
    out = {}

    def choose(name, options):
        out[name] = CategoricalDistribution(list(options))
        return params[name]

    space.build(choose)
    return out


class SearchRun:
    """One run of a strategy against a problem (the space and its evaluator) and a store (the study):
    the incumbent, what was tried, the bounds that settle a point, counters, the trial writer, the
    progress bar. Strategies read and record points only through it."""

    def __init__(self, space, evaluator, study, storage, timeout_s, start, progress, prune, on_trial,
                 stop: StopRequest) -> None:
        self.space, self.evaluator, self.study, self.storage, self.stop = space, evaluator, study, storage, stop
        self.writer: TrialWriter | None = None
        self.timeout_s, self.start, self.progress, self.prune, self.on_trial = timeout_s, start, progress, prune, on_trial
        self.clock: Callable[[], float] = time.perf_counter
        """What :attr:`timeout_s` is read on, from :attr:`start`."""
        self.stored = stored_trials(study)
        self.tried = {Candidate.from_dict(trial_info(t)["candidate"]) for t in self.stored}
        self.lost: set[Candidate] = set()
        self.least: Evaluation | None = None
        """The evaluation with the smallest peak (or static bound) this run saw."""
        exact = [t.value for t in self.stored if trial_info(t).get("exact", True) and trial_info(t)["memory_excess_gib"] <= 0]
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
        holds fewer (see :func:`~mpipe_tune.search._writer.store_trial`). False: the study is full."""
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
        stored = stored_trials(self.study)
        if self.writer is None:
            return len(stored)
        mine = sum(1 for t in stored if str(trial_info(t).get("uid", "")).startswith(f"{self.worker}-"))
        return len(stored) + self.new - mine

    def study_full(self, n_trials: int) -> bool:
        """The shared study already holds ``n_trials`` finished trials (other workers count too)."""
        return self.storage is not None and self.study_total() >= n_trials

    def absorb_others(self) -> list:
        """Trials stored since the last call that other workers wrote, now counted as tried (and their
        best plan that fits as the incumbent the bounds prune against)."""
        stored = stored_trials(self.study)
        fresh, self._synced = stored[self._synced:], len(stored)
        others = [t for t in fresh if not str(trial_info(t).get("uid", "")).startswith(f"{self.worker}-")]
        for t in others:
            info = trial_info(t)
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
        return self.evaluator.lower_bound(c) > self.incumbent * (1 + PRUNE_MARGIN)

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
