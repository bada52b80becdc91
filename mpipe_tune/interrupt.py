"""Ctrl-C as a request to stop at the next safe point, for loops that must not be cut in the middle.

Python raises :class:`KeyboardInterrupt` wherever the main thread is when the signal arrives: inside
a queue's lock, an SQLite transaction, a garbage collector's finalizer (where it is printed and
dropped, and the loop runs on). A search interrupted that way could leave the trial writer's queue
without its end marker or its own database read open over the writer's commit, and wait for it
forever. Inside :func:`stop_requests` the first Ctrl-C only sets :attr:`StopRequest.requested`,
which the loop reads between two units of work and leaves through its normal way out (storing what
it finished); a second Ctrl-C raises :class:`KeyboardInterrupt` at once, for a user who will not
wait, and :attr:`StopRequest.forced` says so.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class StopRequest:
    """What Ctrl-C asked of the loop in a :func:`stop_requests` block."""

    def __init__(self) -> None:
        self.requested = False
        """A Ctrl-C arrived: stop at the next safe point."""
        self.forced = False
        """A second Ctrl-C arrived and raised KeyboardInterrupt where the loop was."""

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            self.forced = True
            raise KeyboardInterrupt
        self.requested = True


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
def stop_requests() -> Iterator[StopRequest]:
    """Turn the first Ctrl-C in the block into :attr:`StopRequest.requested`. Off the main thread, or
    where the program installed its own SIGINT handler, Ctrl-C keeps its meaning (and only a
    KeyboardInterrupt the caller catches stops the loop)."""
    stop = StopRequest()
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield stop
        return
    with sigint_handled_by(stop._on_sigint):
        yield stop
