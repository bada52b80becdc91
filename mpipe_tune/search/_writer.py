"""Storing finished trials in the study's RDB storage: the last ones as reservations, the bulk of a
long search from a child process.

**A shared total.** Several ``plan`` processes may share one study and must stop at its requested
total ``n_trials`` together. :func:`store_trial` decides at the moment a trial is written, from what
the storage holds then: while the study holds fewer than ``n_trials - EXACT_TAIL`` finished trials it
adds the trial as it is; after that it reserves a place first (the trial goes in as running, which
gives it a number), then completes it only if fewer than ``n_trials`` finished or live running
trials precede it, and otherwise marks it failed (a failed trial does not count). Up to
``EXACT_TAIL`` workers writing at the same moment thus stop at exactly ``n_trials``.

**The writer process.** An Optuna RDB write costs a few rows per trial through the SQLAlchemy ORM,
about 17 ms a trial on the 2-core benchmark machine, pure Python: a thread would hold the same
interpreter lock as the search, so the writes of a long search run in a child process beside it
instead. The search hands each finished trial over a queue as soon as it is told; the child writes
them in order with :func:`store_trial` and exits when told to or when the search process is gone
(killed) and the queue is drained, so a killed search still keeps every trial it had handed over.
At most :data:`BACKLOG` trials wait in the queue (:data:`UNCAPPED_BACKLOG` without a shared total).
When a trial is refused (the study is full), the child sets :attr:`TrialWriter.full`, so the search stops, and counts it and every later one without
writing them. The child ignores Ctrl-C: the search drains the queue on its way out (see
:mod:`mpipe_tune.interrupt`). A storage fault (locked, full, read-only, damaged) stops the child with
its one-line error (:mod:`mpipe_tune.search._store`), which the search raises at its next hand-over or
when it closes the writer; every trial written before stays in the study.

**Start-up and shutdown under Ctrl-C.** The child opens the queue's and events' semaphores by name as it
starts, and this process removes those names when it exits: a child still starting when its parent left
(a second Ctrl-C) died with a traceback. So Ctrl-C is held back from the start of the child until it says it
has started (at most :data:`START_WAIT_S`; a Ctrl-C meanwhile, or two, is one request, served after it), and a
writer interrupted while it starts or closes is told to exit once its queue runs dry.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import time

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import mark, sigint_blocked
from mpipe_tune.search._store import faults_named

EXACT_TAIL = 16
"""The last this-many trials of a study are reserved before they count (see the module docstring)."""
STALE_RESERVATION_S = 60.0
"""A running trial older than this is the reservation of a worker that died: it holds no place."""
BACKLOG = 32
"""The most trials handed over and not yet written: the search waits for the writer beyond it, and a
study that other workers fill wastes at most this many of this worker's trials."""
UNCAPPED_BACKLOG = 128
"""The same for a writer with no shared total to stop at (the bound search's): a longer queue lets the search
run on while the writer catches up, and bounds the wait for the queue to drain after Ctrl-C (a few seconds)."""
START_WAIT_S = 120.0
"""The longest wait for the child to start (a Python process importing Optuna on a loaded machine: seconds)."""
_PUT_POLL_S = 1.0
"""While the queue is full, how often a hand-over checks that the child still runs."""


@functools.lru_cache(maxsize=4)
def _rdb_storage(url: str):
    """Optuna's public RDB storage for ``url``, one per process: what a reservation is written through."""
    import optuna

    return optuna.storages.RDBStorage(url)


def store_trial(study, trial, n_trials: int | None = None, storage_url: str | None = None) -> bool:
    """Add the finished ``trial`` (a FrozenTrial) to ``study``; with ``n_trials``, only while the study
    holds fewer finished trials (``storage_url``, the study's RDB URL, is then needed: the last places
    are reserved through it). Returns False when it was not counted (stored as failed)."""
    from optuna.trial import TrialState, create_trial

    mark("trial")
    if n_trials is None or len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < n_trials - EXACT_TAIL:
        study.add_trial(trial)
        return True
    assert storage_url is not None, "a shared trial count needs the study's storage URL"
    storage = _rdb_storage(storage_url)
    study_id = storage.get_study_id_from_name(study.study_name)
    running = create_trial(state=TrialState.RUNNING, params=trial.params, distributions=trial.distributions,
                           user_attrs=trial.user_attrs, system_attrs=trial.system_attrs)
    trial_id = storage.create_new_trial(study_id, template_trial=running)
    number = storage.get_trial_number_from_id(trial_id)
    now = time.time()
    ahead = sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
                if t.number < number and (t.state is TrialState.COMPLETE
                                          or now - t.datetime_start.timestamp() < STALE_RESERVATION_S))
    if ahead >= n_trials:
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
        return False
    storage.set_trial_state_values(trial_id, TrialState.COMPLETE, [trial.value])
    return True


class TrialWriter:
    def __init__(self, storage: str, study_name: str, n_trials: int | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.queue = context.Queue(maxsize=BACKLOG if n_trials is not None else UNCAPPED_BACKLOG)
        self.full = context.Event()
        """Set once a trial was refused because the study holds ``n_trials``."""
        self.refused = context.Value("i", 0)
        """How many handed-over trials were refused."""
        self.abandoned = context.Event()
        """Set when the search stopped waiting (see :meth:`close`): the child exits once the queue runs dry."""
        self.fault = context.SimpleQueue()
        """The one-line error of a storage fault that stopped the child (see :mod:`~mpipe_tune.search._store`)."""
        self.started = context.Event()
        """Set by the child once it runs: it has opened every semaphore it shares with this process."""
        self.process = context.Process(target=_write_trials,
                                       args=(storage, study_name, n_trials, self.queue, self.full, self.refused,
                                             self.abandoned, os.getpid(), self.fault, self.started),
                                       name="mpipe-tune trial writer")
        # A blocked SIGINT is inherited through the exec: a terminal's Ctrl-C cannot end the child's start-up,
        # and one that comes meanwhile reaches this process's handler once the child has started.
        mark("writer")
        try:
            with sigint_blocked():
                self.process.start()
                mark("writer-starting")
                self._await_start()
        except BaseException:  # a Ctrl-C held back while the child started, or a child that never started
            self.close(wait_s=0.0, raising=False)
            raise

    def _await_start(self) -> None:
        deadline = time.monotonic() + START_WAIT_S
        while not self.started.wait(0.1):
            if not self.process.is_alive():
                raise self._stopped()
            if time.monotonic() > deadline:
                raise MpipeError(f"the trial writer did not start within {START_WAIT_S:g} s (a machine too loaded to "
                                 f"start a Python process?); rerun the same command")

    def put(self, trial) -> None:
        """Hand ``trial`` over; a writer that stopped (a storage fault) is its one-line error."""
        while True:
            if not self.process.is_alive():
                raise self._stopped()
            try:
                self.queue.put(trial, timeout=_PUT_POLL_S)
                return
            except queue_module.Full:  # the child is busy, or it died with the queue full
                continue

    def _stopped(self) -> MpipeError:
        """Why the child stopped: the storage fault it reported, or its exit code."""
        if not self.fault.empty():
            return MpipeError(self.fault.get())
        return MpipeError(f"the trial writer stopped (exit code {self.process.exitcode}); the trials it wrote stay in "
                          f"the study: rerun the same command to continue it")

    def close(self, wait_s: float | None = None, *, raising: bool = True) -> None:
        """Wait until every trial handed over is written. With ``wait_s`` (a search stopped at once by a
        second Ctrl-C, whose queue may have been cut mid-put and lost its end marker), wait at most that
        long: the child goes on writing what reached it and exits when the queue runs dry (this
        process's exit waits for it, as for any child it started). A Ctrl-C that stops the wait leaves the
        child so told too. ``raising=False``: a child that stopped on a fault is not this call's error."""
        try:
            self._close(wait_s, raising)
        except BaseException:
            self.abandoned.set()
            self.queue.cancel_join_thread()
            raise

    def _close(self, wait_s: float | None, raising: bool) -> None:
        if self.process.pid is None:  # never started
            return
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while self.process.is_alive():  # a child that died with the queue full takes no end marker
            poll = _PUT_POLL_S if deadline is None else min(_PUT_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                self.queue.put(None, timeout=poll)
                break
            except queue_module.Full:
                if deadline is not None and time.monotonic() >= deadline:
                    break
        self.process.join(wait_s)
        if self.process.is_alive():
            self.abandoned.set()
            self.queue.cancel_join_thread()  # nor for a feeder thread the cut put may have left stuck
            return
        if self.process.exitcode != 0:
            self.queue.cancel_join_thread()  # what it left unread cannot reach a pipe nobody reads
            if raising:
                raise self._stopped()
            return
        self.queue.close()


def _write_trials(storage: str, study_name: str, n_trials: int | None, queue, full, refused, abandoned,
                  parent_pid: int, fault, started) -> None:
    """The child's loop; a storage fault ends it with its one-line error on ``fault`` and exit code 1 (every
    trial it wrote before stays in the study: each is its own transaction)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started.set()
    try:
        with faults_named(storage):
            _write_queued(storage, study_name, n_trials, queue, full, refused, abandoned, parent_pid)
    except MpipeError as exc:
        fault.put(str(exc))
        sys.exit(1)


def _write_queued(storage: str, study_name: str, n_trials: int | None, queue, full, refused, abandoned,
                  parent_pid: int) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=storage)
    while True:
        try:
            trial = queue.get(timeout=0.5)
        except queue_module.Empty:
            if os.getppid() != parent_pid or abandoned.is_set():  # everything that reached it is written
                return
            continue
        if trial is None:
            return
        if full.is_set() or not store_trial(study, trial, n_trials, storage):  # once full, always full: not written
            with refused.get_lock():
                refused.value += 1
            full.set()
