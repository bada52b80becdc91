"""Hot loops that run as plain Python until compiling them pays, then as their numba compilation.

A :func:`kernel` is a plain loop over flat arrays (the cost model's longest path, durations and
memory peaks, the owner policies, derive's topological sort). numba compiles such a loop to run
20-40 times faster, but a first compile costs about two seconds per kernel on a small machine, and
a fresh install has nothing cached: compiling every kernel up front cost the default ``mpipe-tune
plan`` 15 s more than its few hundred events take in Python (benchmarks/HISTORY.md, "First-call
compile"). So each kernel starts as its own Python source and counts the seconds it spends there;
once that reaches :data:`COMPILE_AFTER_S` (about what compiling costs: the ski-rental rule, never
worse than twice the better choice), or a call's largest array has :data:`COMPILE_FROM_SIZE`
elements or more, it is compiled (``cache=True``: loaded from numba's cache when an earlier run
compiled it) and stays compiled. numba itself is imported only then. Where numba's cache already holds
the kernel (:func:`numba_cache_holds`: an earlier run compiled this source) getting it compiled costs a
load, not a compile, so the same rule buys it after :data:`COMPILE_CACHED_AFTER_S`.

A Ctrl-C that lands while numba is imported or compiles (a command interrupted in its first
seconds; a search defers the first Ctrl-C to its next trial, see :mod:`mpipe_tune.interrupt`, but not
a second) leaves numba half imported; from then on the automatic rule keeps every kernel of the
process as Python (:func:`compiling_stopped`), so the work a search does on its way out (storing what
it found, the report) runs on, where importing numba again would fail.

Both tiers run the same source, so they do the same floating-point operations in the same order
and agree bit for bit (``tests/test_jit.py`` checks every kernel on random inputs). :func:`tier`
pins the choice, for tests and benchmarks that measure one of them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

COMPILE_AFTER_S = 1.0
"""Seconds a kernel spends as Python before it is compiled."""
COMPILE_CACHED_AFTER_S = 0.1
"""Seconds a kernel whose compilation numba's cache holds spends as Python: about what importing numba
and loading the kernel cost (0.3 s and 0.05 s on a 2-core VM; the plan commands' kernels spent 1-3 s
as Python before compiling, each run)."""
COMPILE_FROM_SIZE = 20_000
"""A call with an array this large is compiled at once (Python would take milliseconds per call)."""
TIERS = ("auto", "python", "compiled")

_pinned = "auto"
_compiling_stopped = False
KERNELS: list["Kernel"] = []
"""Every kernel defined, in definition order."""


class Kernel:
    """A loop that :func:`kernel` made: call it like the function it wraps."""

    def __init__(self, fn: Callable) -> None:
        functools.update_wrapper(self, fn)
        self.python = fn
        self.python_s = 0.0
        """Seconds spent in the Python tier so far."""
        self._compiled = None
        self._cached: bool | None = None
        """Whether numba's cache held this kernel when first asked (:func:`numba_cache_holds`)."""

    @property
    def compiled(self):
        """The numba dispatcher (compiled for an argument type on its first call with it)."""
        if self._compiled is None:
            import numba

            self._compiled = numba.njit(cache=True, nogil=True)(self.python)
        return self._compiled

    def uses_compiled(self, args: tuple) -> bool:
        if _pinned != "auto":
            return _pinned == "compiled"
        if _compiling_stopped:
            return False
        return (self._compiled is not None or self.python_s >= self.compile_after_s()
                or max((a.size for a in args if isinstance(a, np.ndarray)), default=0) >= COMPILE_FROM_SIZE)

    def compile_after_s(self) -> float:
        """Python seconds after which this kernel is compiled: what getting it compiled costs."""
        if self._cached is None:
            self._cached = numba_cache_holds(self.python)
        return COMPILE_CACHED_AFTER_S if self._cached else COMPILE_AFTER_S

    def __call__(self, *args):
        if self.uses_compiled(args):
            try:
                return self.compiled(*args)
            except KeyboardInterrupt:
                global _compiling_stopped
                _compiling_stopped = True
                raise
        start = time.perf_counter()
        try:
            return self.python(*args)
        finally:
            self.python_s += time.perf_counter() - start


def numba_cache_holds(fn: Callable) -> bool:
    """Whether numba's cache beside ``fn``'s source (``__pycache__``, where ``cache=True`` writes it) holds an
    index of ``fn`` written after the source's last change, without importing numba (the index's name as
    numba's ``InTreeCacheLocator`` gives it). False where ``NUMBA_CACHE_DIR`` moves the cache elsewhere: the
    rule then waits :data:`COMPILE_AFTER_S`, as for a kernel never compiled."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return False
    code = fn.__code__
    source = code.co_filename
    name = f"{os.path.splitext(os.path.basename(source))[0]}.{fn.__qualname__}".replace("<", "").replace(">", "")
    index = os.path.join(os.path.dirname(source), "__pycache__",
                         f"{name}-{code.co_firstlineno}.py{sys.version_info[0]}{sys.version_info[1]}"
                         f"{getattr(sys, 'abiflags', '')}.nbi")
    try:
        return os.stat(index).st_mtime >= os.stat(source).st_mtime
    except OSError:
        return False


def compiling_stopped() -> bool:
    """Whether a Ctrl-C during numba's import or a compile stopped the automatic rule from compiling."""
    return _compiling_stopped


def kernel(fn: Callable) -> Kernel:
    """Make ``fn`` (numba-compilable Python: loops over numpy arrays, no Python objects) a :class:`Kernel`."""
    k = Kernel(fn)
    KERNELS.append(k)
    return k


@contextlib.contextmanager
def tier(name: str) -> Iterator[None]:
    """Run every kernel as ``"python"`` or ``"compiled"`` inside the block (``"auto"``: the rule above)."""
    global _pinned
    if name not in TIERS:
        raise ValueError(f"tier {name!r} is unknown; use one of {', '.join(TIERS)}")
    before, _pinned = _pinned, name
    try:
        yield
    finally:
        _pinned = before
