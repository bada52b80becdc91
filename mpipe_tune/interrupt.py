"""Ctrl-C as a request to stop at the next safe point, for loops that must not be cut in the middle.

Python raises :class:`KeyboardInterrupt` wherever the main thread is when the signal arrives: inside
a queue's lock, an SQLite transaction, a garbage collector's finalizer (where it is printed and
dropped, and the loop runs on). A search interrupted that way could leave the trial writer's queue
without its end marker or its own database read open over the writer's commit, and wait for it
forever. Inside :func:`stop_requests` the first Ctrl-C only sets :attr:`StopRequest.requested`,
which the loop reads between two units of work and leaves through its normal way out (storing what
it finished); a second Ctrl-C raises :class:`KeyboardInterrupt` at once, for a user who will not
wait, and :attr:`StopRequest.forced` says so.

**A whole command.** :func:`command_interrupts` (the CLI's, around every subcommand) makes the same
promise for a command: the first Ctrl-C asks it to stop at its next safe point (:func:`phase`: a
command names where it may stop; a loop inside reads :attr:`StopRequest.requested`), a second stops it
at once, except inside :func:`held` (the few microseconds that rename a command's finished files into
place), which completes first; what the command has kept so far (:meth:`StopRequest.keep`) is what the
CLI says after "interrupted", and the exit code is 130 either way. A Ctrl-C that comes after the last
safe point lets the command finish, and the CLI says it came too late. :func:`stop_requests` blocks
inside such a command share its request.

Where a command starts processes that share the terminal (ranks, link workers), :func:`at_once` makes
the first Ctrl-C stop it at once, with them; entering it is a safe point. :func:`skip` is a safe point
before optional work that a Ctrl-C leaves out (the command then finishes the rest).

**Tests.** ``MPIPE_TUNE_SIGINT_AT=NAME[:N][,NAME[:N]...]`` makes the process send itself SIGINT the N-th
time (default the first) it reaches :func:`mark` or :func:`phase` ``NAME``: an interrupt at a controlled
point, not after a sleep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


class StopRequest:
    """What Ctrl-C asked of the loop in a :func:`stop_requests` block (or of a whole command)."""

    def __init__(self, announce: str = "") -> None:
        self.requested = False
        """A Ctrl-C arrived: stop at the next safe point."""
        self.forced = False
        """A second Ctrl-C arrived and raised KeyboardInterrupt where the loop was."""
        self.consumed = False
        """A loop stopped for the request (:meth:`consume`): later safe points let the command go on."""
        self.kept: list[str] = []
        """What the command has kept so far, for the line after "interrupted"."""
        self._held = 0
        self._announce = announce

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            self.forced = True
            if not self._held:
                raise KeyboardInterrupt
            return
        self.requested = True
        if self._announce:
            print(self._announce, file=sys.stderr, flush=True)

    def consume(self) -> None:
        """The request was served (a search stopped at its next trial): the command goes on to its end."""
        self.consumed = True

    def keep(self, what: str) -> None:
        """Record what the command has kept so far (said after "interrupted")."""
        self.kept.append(what)

    @property
    def stopping(self) -> bool:
        """A request not yet served, or a second Ctrl-C that a loop caught: stop at this safe point."""
        return self.forced or (self.requested and not self.consumed)


_command: StopRequest | None = None
"""The running command's request (see :func:`command_interrupts`)."""
_marks: dict[str, int] = {}


@contextlib.contextmanager
def sigint_handled_by(handler) -> Iterator[None]:
    """SIGINT handled by ``handler`` (a function, or ``signal.SIG_IGN``) inside the block, on the main
    thread (the only one that may change it); elsewhere the block runs with SIGINT as it was."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def at_once() -> Iterator[None]:
    """Inside, Ctrl-C stops at once (KeyboardInterrupt), even inside a command: for a launch of rank
    processes, which share the terminal's process group and are interrupted by the same Ctrl-C, so there
    is no later safe point to wait for. Entering is a safe point: a Ctrl-C that came before (while the
    command checked its inputs) stops the command here, before anything starts. A SIGINT the process
    ignores stays ignored."""
    if _command is not None and _command.stopping:
        raise KeyboardInterrupt
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    with sigint_handled_by(signal.default_int_handler):
        yield


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Turn the first Ctrl-C in the block into :attr:`StopRequest.requested`. Off the main thread, or
    where the program installed its own SIGINT handler, Ctrl-C keeps its meaning (and only a
    KeyboardInterrupt the caller catches stops the loop)."""
    if _command is not None and signal.getsignal(signal.SIGINT) == _command._on_sigint:
        yield _command  # inside a command: its request is the loop's
        return
    stop = StopRequest()
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield stop
        return
    with sigint_handled_by(stop._on_sigint):
        yield stop


@contextlib.contextmanager
def command_interrupts(command: str) -> Iterator[StopRequest]:
    """The first Ctrl-C inside asks the command to stop at its next :func:`phase` (or loop's safe point)
    and says so on stderr; a second raises KeyboardInterrupt at once (after a :func:`held` block)."""
    global _command
    stop = StopRequest(f"mpipe-tune {command}: stopping at the next safe point (Ctrl-C again to stop at once)")
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    _command, _marks_before = stop, dict(_marks)
    try:
        with sigint_handled_by(stop._on_sigint):
            yield stop
    finally:
        _command = None
        _marks.clear()
        _marks.update(_marks_before)


def keep(what: str) -> None:
    """Record, for the running command, what it has kept so far (said after "interrupted")."""
    if _command is not None:
        _command.keep(what)


def served() -> None:
    """The running command's pending Ctrl-C was served by a loop that stopped for it."""
    if _command is not None and _command.requested and not _command.forced:
        _command.consume()


def mark(name: str) -> None:
    """A named point of a command, where ``MPIPE_TUNE_SIGINT_AT`` may send this process SIGINT."""
    wanted = os.environ.get("MPIPE_TUNE_SIGINT_AT")
    if not wanted:
        return
    _marks[name] = _marks.get(name, 0) + 1
    for point in wanted.split(","):
        target, _, count = point.partition(":")
        if target == name and _marks[name] == int(count or 1):
            interrupt_self()


def interrupt_self() -> None:
    """SIGINT to this process, as a terminal's Ctrl-C, but addressed to its main thread (where Python runs
    the handler). One addressed to the whole process while the main thread blocks it (:func:`sigint_blocked`)
    goes to whichever other thread the kernel picks (torch's, tqdm's), and Python sees it only when that thread
    next runs, maybe after the block's handler is gone; one addressed to the main thread waits for the block's
    end and is handled there, as a test of that block needs."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def phase(name: str) -> None:
    """A safe point of the running command before its phase ``name``: a pending Ctrl-C stops it here
    (KeyboardInterrupt, which the CLI reports with what the command kept)."""
    mark(name)
    if _command is not None and _command.stopping:
        raise KeyboardInterrupt


def skip(name: str) -> bool:
    """A safe point before the running command's optional work ``name`` (pictures after a benchmark's
    rounds): True when a Ctrl-C asks the command to stop, which then leaves that work out and goes on to
    its end (the request is served; the command says what it left out and exits 130)."""
    mark(name)
    if _command is not None and _command.stopping and not _command.forced:
        _command.consume()
        return True
    return False


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Every Ctrl-C inside waits until the block is done; then one that came stops at once, as a second
    Ctrl-C does (a first one inside a command stays a request for its next safe point)."""
    stop = _command
    if stop is None:
        arrived: list[int] = []
        with sigint_handled_by(lambda signum, frame: arrived.append(signum)):
            yield
        if arrived:
            raise KeyboardInterrupt
        return
    stop._held += 1
    try:
        yield
    finally:
        stop._held -= 1
    if stop.forced and not stop._held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread inside the block, and on the main thread held back from Python's
    handler too (a signal the C level caught just before the block would otherwise raise inside it):
    a child process started here inherits the mask, so a terminal's Ctrl-C cannot end it while it
    starts, nor cut this process's start of it in the middle (a child forked but not yet known by its
    pid cannot be stopped). A Ctrl-C that came meanwhile goes to this process's handler after the
    block.

    multiprocessing's resource tracker, which its first child process starts, unblocks SIGINT in this
    thread once it has started (its own start is protected so), which would let the child after it
    start unprotected: it is started here first."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    arrived: list[int] = []
    with sigint_handled_by(lambda signum, frame: arrived.append(signum)):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one that waited is delivered now
    handler = signal.getsignal(signal.SIGINT)
    if arrived and callable(handler):
        handler(signal.SIGINT, None)
