"""The device under measurement: importing torch for it, checking it is there, and timing work on it.

``--device npu`` imports ``torch_npu`` explicitly and only then. For ``cpu`` and ``cuda``,
:func:`import_torch` sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (unless the user has set it) before the
first ``import torch``: since torch 2.5, ``import torch`` loads every out-of-tree device extension
registered under the ``torch.backends`` entry point, torch_npu among them, and turns any failure there
into a ``RuntimeError`` of ``import torch`` itself. On an Ascend host whose CANN environment is not
sourced that would break a CPU profile, and everywhere it costs seconds for a backend the run never
touches. The variable is inherited by the spawned measurement workers, so they import the same way.
It has no effect once torch is imported, and an explicit setting by the user is kept.

Timing: on CPU ``time.perf_counter`` around the (synchronous) calls; on CUDA and NPU a pair of
device events (``torch.cuda.Event`` / ``torch.npu.Event``) recorded on the current stream around the
calls, read after the end event synchronizes.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

from mpipe_tune.errors import MpipeError

DEVICES = ("cpu", "cuda", "npu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""torch.distributed backend per device."""
_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def import_torch(device: str) -> ModuleType:
    """Import torch for ``device`` (and torch_npu for ``npu``); a missing package is one MpipeError line."""
    assert device in DEVICES, device
    if device != "npu" and "torch" not in sys.modules:
        os.environ.setdefault(_AUTOLOAD, "0")
    try:
        import torch
    except ImportError as exc:
        raise MpipeError(f"the profiler needs torch, which cannot be imported ({exc}); "
                         "install it with pip install 'mpipe-tune[torch]'") from None
    except RuntimeError as exc:  # an auto-loaded device extension failed
        raise MpipeError(f"import torch failed while loading a device extension ({exc}); "
                         f"set {_AUTOLOAD}=0 or fix that extension's installation") from None
    if device == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)
        except (ImportError, RuntimeError, OSError) as exc:
            raise MpipeError(f"device kind npu needs torch_npu, which cannot be imported ({exc}); install "
                             f"torch_npu built for torch {torch.__version__} with the CANN toolkit, "
                             "or profile another device kind", quantities=("device kind",)) from None
    return torch


def check_device(torch: ModuleType, device: str, nproc: int) -> None:
    """Raise one MpipeError line unless ``device`` is usable with ``nproc`` processes, one device each."""
    import torch.distributed as dist

    if device == "cpu":
        available = 0
    else:
        module = getattr(torch, device)
        if not module.is_available():
            built = "" if device != "cuda" or torch.version.cuda else ", and this torch build has no CUDA"
            raise MpipeError(f"device kind {device}: no {device.upper()} device is visible to torch "
                             f"{torch.__version__} (torch.{device}.is_available() is False{built}); "
                             f"run on a host with one, or profile device kind cpu", quantities=("device kind",))
        available = module.device_count()
        if nproc > available:
            raise MpipeError(f"process count {nproc} needs {nproc} {device.upper()} devices, one per process, "
                             f"but torch sees {available}; lower the process count", quantities=("process count",))
    if not dist.is_available():
        raise MpipeError(f"this torch build ({torch.__version__}) has no torch.distributed; "
                         "install a build with it to measure links")
    backend = BACKENDS[device]
    has_backend = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available}.get(backend)
    if has_backend is not None and not has_backend():
        raise MpipeError(f"device kind {device} measures links with the {backend} backend, which this "
                         f"torch build ({torch.__version__}) lacks; install a build with {backend}", quantities=("device kind",))


def device_name(torch: ModuleType, device: str) -> str:
    """A human name for the device: the CPU model and core count, or the accelerator's name."""
    if device != "cpu":
        return getattr(torch, device).get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def memory_capacity_bytes(torch: ModuleType, device: str, nproc: int) -> tuple[float, str]:
    """Memory of one device in bytes and how it was read; on CPU the host memory shared by ``nproc``."""
    if device != "cpu":
        total = getattr(torch, device).get_device_properties(0).total_memory
        return float(total), f"torch.{device}.get_device_properties(0).total_memory"
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(total // nproc), f"physical host memory ({total / 2**30:.1f} GiB) divided by {nproc} processes"


def threads_per_process(nproc: int) -> int:
    """CPU threads one of ``nproc`` processes gets on this host (at least one)."""
    return max(1, (os.cpu_count() or 1) // nproc)


@contextmanager
def device_share(torch: ModuleType, device: str, nproc: int) -> Iterator[None]:
    """Run the block on one device's share of the host: on CPU a device is one of ``nproc`` processes,
    so torch runs with that process's share of the cores; accelerators are whole devices already."""
    if device != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(nproc))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class Timer:
    """Seconds per call of a function on one device."""

    def __init__(self, torch: ModuleType, device: str) -> None:
        self._module = None if device == "cpu" else getattr(torch, device)

    def seconds_per_call(self, fn: Callable[[], object], calls: int = 1) -> float:
        """Run ``fn`` ``calls`` times back to back; return the elapsed time divided by ``calls``."""
        if self._module is None:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - begin) / calls
        begin, end = self._module.Event(enable_timing=True), self._module.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / calls

    def synchronize(self) -> None:
        if self._module is not None:
            self._module.synchronize()


def calls_for(time_per_call_s: float, min_time_s: float, max_calls: int) -> int:
    """Back-to-back calls per timed repeat so that one repeat lasts at least ``min_time_s``.

    >>> calls_for(1e-5, 1e-3, 1000), calls_for(0.5, 1e-3, 1000), calls_for(0.0, 1e-3, 64)
    (100, 1, 64)
    """
    if time_per_call_s <= 0:
        return max_calls
    return max(1, min(max_calls, math.ceil(min_time_s / time_per_call_s)))


def time_repeats(timer: Timer, fn: Callable[[], object], *, warmup: int, repeats: int,
                 min_time_s: float, max_calls: int = 1000) -> list[float]:
    """Seconds per call of ``fn``, one figure per repeat, after ``warmup`` calls (at least one)."""
    for _ in range(max(1, warmup) - 1):
        fn()
    timer.synchronize()
    calls = calls_for(timer.seconds_per_call(fn), min_time_s, max_calls)
    return [timer.seconds_per_call(fn, calls) for _ in range(repeats)]
