"""Writing finished trials to the study's RDB storage from a child process.

An Optuna RDB write costs a few rows per trial through the SQLAlchemy ORM, about 17 ms a trial on
the 2-core benchmark machine, pure Python: a thread would hold the same interpreter lock as the
search, so the writes run in a child process beside it instead. The search hands each finished
trial over a queue as soon as it is told; the child writes them in order and exits when told to or
when the search process is gone (killed) and the queue is drained, so a killed search still keeps
every trial it had handed over. The child ignores Ctrl-C: the search drains the queue on its way out.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import signal

from mpipe_tune.errors import MpipeError


class TrialWriter:
    def __init__(self, storage: str, study_name: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.queue = context.Queue()
        self.process = context.Process(target=_write_trials, args=(storage, study_name, self.queue, os.getpid()),
                                       name="mpipe-tune trial writer")
        self.process.start()

    def put(self, trial) -> None:
        if not self.process.is_alive():
            raise MpipeError(f"the trial writer stopped (exit code {self.process.exitcode}); the study storage "
                             f"may be locked or full: check it and rerun to continue")
        self.queue.put(trial)

    def close(self) -> None:
        """Wait until every trial handed over is written."""
        if self.process.is_alive():
            self.queue.put(None)
        self.process.join()
        self.queue.close()
        if self.process.exitcode != 0:
            raise MpipeError(f"the trial writer failed (exit code {self.process.exitcode}); some trials may be "
                             f"missing from the study: rerun the same command to continue it")


def _write_trials(storage: str, study_name: str, queue, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=storage)
    while True:
        try:
            trial = queue.get(timeout=0.5)
        except queue_module.Empty:
            if os.getppid() != parent_pid:  # the search was killed and everything it sent is written
                return
            continue
        if trial is None:
            return
        study.add_trial(trial)
