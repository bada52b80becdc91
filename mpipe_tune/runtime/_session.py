"""What ``mpipe-tune run`` and ``mpipe-tune bench`` share: check a list of jobs, start the ranks once,
run the jobs one after another on them, and hand each job's result back as soon as it finishes.

:func:`run_session` does every check first (each distinct job's :func:`~mpipe_tune.runtime._job.preflight`,
one world size for all of them, the host's device and memory), with one-line errors and nothing
started; then it launches the ranks (the local spawner, or this process as the rank ``torchrun``
started) and runs the jobs with :func:`~mpipe_tune.runtime._worker.run_jobs`. Rank 0 writes each
job's result to a scratch folder the moment the job ends, and this process reads them from there, so
``on_result`` sees progress while later jobs still run, and a run cut short by Ctrl-C or a failed
rank still returns every job that finished.

Importing this module imports no torch.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import at_once, phase
from mpipe_tune.runtime._job import RunJob
from mpipe_tune.runtime._plan_view import PlanView

Result = dict[str, Any]
_POLL_S = 0.2


@dataclass(frozen=True)
class SessionResult:
    results: tuple[Result, ...]
    """Rank 0's result of each job that finished, in job order (empty on a torchrun rank other than 0)."""
    exit_code: int
    """0: every job ran; 1: a rank failed; 2: a rank refused bad input found at run time (one line);
    130: interrupted (each already reported on stderr)."""
    is_rank0: bool
    """False on a torchrun rank other than 0, which prints nothing."""


def prepare(jobs: Sequence[RunJob], device_kind: str) -> tuple[dict[RunJob, PlanView], list[str]]:
    """Every check before anything starts: each distinct job's view, and the notes to show first.

    One-line :class:`MpipeError` for a bad job, for jobs whose plans need different world sizes,
    or for a device or memory this host lacks."""
    from mpipe_tune.runtime import _launch as launch
    from mpipe_tune.runtime._job import check_host, preflight

    world = launch.torchrun_world_size() if launch.under_torchrun() else None
    views = {job: preflight(job, world) for job in dict.fromkeys(jobs)}
    first_job, first = next(iter(views.items()))
    for job, view in views.items():
        if view.layout.world_size != first.layout.world_size:
            raise MpipeError(
                f"plan file {view.path}: plan {job.plan_name or 'best'} runs on {view.layout.world_size} ranks but plan "
                f"{first_job.plan_name or 'best'} on {first.layout.world_size}; jobs of one session share one world size"
            )
    notes = list(dict.fromkeys(note for job, view in views.items() for note in check_host(view, job, device_kind)))
    return views, notes


def run_session(
    command: str,
    jobs: Sequence[RunJob],
    device_kind: str,
    *,
    on_result: Callable[[int, Result], None] | None = None,
    timeout_s: float = 600.0,
) -> SessionResult:
    """Check, launch and run ``jobs`` in order on one set of ranks (see the module docstring).

    ``command`` names the subcommand in the lines this prints on stderr (notes, a failed rank with its
    traceback, an interruption). ``on_result(index, result)`` is called once per finished job, in
    order, while the session runs. Bad input raises :class:`MpipeError` before anything starts."""
    from mpipe_tune.runtime import _launch as launch

    launch.disable_backend_autoload()  # before the first import of torch
    views, notes = prepare(jobs, device_kind)
    launch.require_torch(f"mpipe-tune {command}")
    for note in notes:
        print(f"mpipe-tune {command}: note: {note}", file=sys.stderr)
    world_size = next(iter(views.values())).layout.world_size
    phase("launch")  # a Ctrl-C during the checks stops here, before any rank starts
    with tempfile.TemporaryDirectory(prefix="mpipe-session-") as folder:
        collector = _Collector(Path(folder), on_result)
        collector.start()
        exit_code, is_rank0 = 0, True
        try:
            with at_once():  # the ranks get the same Ctrl-C: the session stops with them, at once
                if launch.under_torchrun():
                    is_rank0 = launch.run_under_torchrun(run_jobs_into, (list(jobs), folder), device_kind,
                                                         timeout_s=timeout_s) is not None
                else:
                    launch.launch_local(run_jobs_into, (list(jobs), folder), world_size, device_kind,
                                        timeout_s=timeout_s)
        except launch.RankFailed as exc:
            if exc.details:
                print(exc.details.rstrip(), file=sys.stderr)
            print(f"mpipe-tune {command}: error: {exc}", file=sys.stderr)
            exit_code = 2 if exc.user_error else 1
        except KeyboardInterrupt:
            print(f"mpipe-tune {command}: interrupted", file=sys.stderr)
            exit_code = 130
        finally:
            results = collector.finish()
    return SessionResult(tuple(results), exit_code, is_rank0)


def run_jobs_into(ctx, jobs: list[RunJob], folder: str) -> int | None:
    """What every rank runs: the jobs in turn; rank 0 writes each result to ``folder`` as it ends.
    Returns the job count on rank 0, None elsewhere."""
    from mpipe_tune.runtime._worker import run_jobs

    for index, job in enumerate(jobs):
        results = run_jobs(ctx, [job])
        if results is not None:
            tmp = Path(folder) / f".{index:06d}.tmp"
            tmp.write_bytes(pickle.dumps(results[0]))
            tmp.rename(_result_path(folder, index))
    return len(jobs) if ctx.rank == 0 else None


def _result_path(folder: str | Path, index: int) -> Path:
    return Path(folder) / f"{index:06d}.pkl"


class _Collector:
    """Reads the results rank 0 writes, in job order, on a thread of its own while the ranks run."""

    def __init__(self, folder: Path, on_result: Callable[[int, Result], None] | None) -> None:
        self.folder = folder
        self.on_result = on_result
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="mpipe-session-results", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> list[Result]:
        """Stop the thread and take whatever it has not read yet."""
        self._stop.set()
        self._thread.join()
        self._drain()
        return self.results

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            while (path := _result_path(self.folder, len(self.results))).exists():
                result = pickle.loads(path.read_bytes())
                self.results.append(result)
                if self.on_result is not None:
                    self.on_result(len(self.results) - 1, result)
