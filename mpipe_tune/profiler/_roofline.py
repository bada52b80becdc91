"""Roofline measurement: peak FLOP/s per dtype from matrix products, memory bandwidth from copies.

Peak: ``torch.matmul`` of square ``n x n`` matrices for growing ``n``; each size's rate is the median
over repeats of ``2 n^3 / seconds``, and the peak is the best such median (the best *sustained* rate, not
the luckiest single call). Growth stops at the last size, once one product takes longer than the
settings allow, or once two sizes in a row fail to beat the best rate by 3%.

Memory bandwidth: ``dst.copy_(src)`` of a tensor much larger than the last-level cache; each copy moves
``2 * size`` bytes (read and write), and the bandwidth is their median rate. On CPU the ``nproc`` devices are
processes of one host sharing its memory: :func:`measure_memory_together` times the same copy on every one of
them at once (each after a barrier), as a run's ranks stream their weights and activations at once, and that
per-process rate is the profile's bandwidth (this VM: 23 GB/s for one process alone, 16 for each of two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from mpipe_tune.algebra import TORCH_DTYPE_NAMES
from mpipe_tune.profiler._device import Timer, time_repeats
from mpipe_tune.profiler._settings import SweepSettings
from mpipe_tune.profiler._stats import Spread, summarize

TORCH_DTYPES = {name: TORCH_DTYPE_NAMES[name] for name in ("fp64", "fp32", "tf32", "bf16", "fp16")}
"""The dtypes a profile measures -> torch dtype of the operands (the one table: :data:`~mpipe_tune.algebra._candidate_text.DTYPES`)."""
_STALL_GAIN = 1.03


@dataclass(frozen=True)
class RatePoint:
    """One measured point: the size it was measured at and the rate's median and spread."""

    size: int
    """Matrix side (matmul) or tensor bytes (copy)."""
    rate: Spread
    """FLOP/s (matmul) or bytes/s (copy) over the repeats."""


@dataclass(frozen=True)
class RateSweep:
    points: tuple[RatePoint, ...]

    @property
    def best(self) -> RatePoint:
        return max(self.points, key=lambda p: p.rate.median)


def measure_peak_flops(torch: ModuleType, device: str, dtype: str, settings: SweepSettings,
                       progress: Callable[[str], None]) -> RateSweep:
    """Matmul rates for growing sizes of ``dtype``; ``progress`` is called once per size in the settings."""
    timer = Timer(torch, device)
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    tf32 = _Tf32(torch, device, enabled=dtype == "tf32")
    points: list[RatePoint] = []
    stalls = 0
    with tf32:
        for index, n in enumerate(settings.matmul_sizes):
            a = torch.randn(n, n, device=device, dtype=torch_dtype)
            b = torch.randn(n, n, device=device, dtype=torch_dtype)
            out = torch.empty(n, n, device=device, dtype=torch_dtype)
            seconds = time_repeats(timer, lambda: torch.matmul(a, b, out=out), warmup=settings.warmup,
                                   repeats=settings.repeats, min_time_s=settings.min_repeat_s)
            del a, b, out
            best_before = max((p.rate.median for p in points), default=0.0)
            points.append(RatePoint(n, summarize([2.0 * n**3 / s for s in seconds])))
            progress(f"matmul {dtype} {n}")
            stalls = 0 if points[-1].rate.median > best_before * _STALL_GAIN else stalls + 1
            if min(seconds) > settings.matmul_max_call_s or stalls == 2:
                for skipped in settings.matmul_sizes[index + 1:]:
                    progress(f"matmul {dtype} {skipped} (skipped)")
                break
    return RateSweep(tuple(points))


def measure_memory_bandwidth(torch: ModuleType, device: str, settings: SweepSettings,
                             progress: Callable[[str], None]) -> RateSweep:
    """Copy rate of a ``settings.copy_bytes`` tensor, counting the bytes read and written."""
    timer = Timer(torch, device)
    elements = settings.copy_bytes // 4
    src = torch.ones(elements, device=device, dtype=torch.float32)
    dst = torch.zeros_like(src)
    seconds = time_repeats(timer, lambda: dst.copy_(src), warmup=settings.warmup, repeats=settings.repeats,
                           min_time_s=settings.min_repeat_s)
    progress("copy")
    return RateSweep((RatePoint(elements * 4, summarize([2.0 * elements * 4 / s for s in seconds])),))


MIN_TOGETHER_BYTES = 64 * 2**20
"""The smallest tensor each process copies in :func:`measure_memory_together` (far beyond a core's caches)."""


def shares_memory(device: str, nproc: int) -> bool:
    """Whether the profiled devices share one memory: CPU processes of one host, two or more
    (:func:`measure_memory_together` times them then)."""
    return device == "cpu" and nproc >= 2


def measure_memory_together(device: str, nproc: int, settings: SweepSettings, progress: Callable[[str], None],
                            *, timeout_s: float = 300.0) -> RatePoint:
    """The copy rate of one of ``nproc`` processes while every one copies at once (module docstring): each
    copies ``max(settings.copy_bytes / nproc, MIN_TOGETHER_BYTES)``; the median over every rank's repeats."""
    from mpipe_tune.profiler._links import run_ranks

    return run_ranks(device, nproc, _copy_together, settings, what="memory bandwidth measurement",
                     progress=progress, timeout_s=timeout_s)


def _copy_together(torch, dist, where: str, rank: int, nproc: int, device: str, settings: SweepSettings,
                   messages) -> RatePoint | None:
    size = max(settings.copy_bytes // nproc, MIN_TOGETHER_BYTES) // 4 * 4
    src = torch.ones(size // 4, device=where, dtype=torch.float32)
    dst = torch.zeros_like(src)
    timer = Timer(torch, device)
    rates = []
    for repeat in range(max(1, settings.warmup) + settings.repeats):
        dist.barrier()
        seconds = timer.seconds_per_call(lambda: dst.copy_(src))
        if repeat >= max(1, settings.warmup):
            rates.append(2.0 * size / seconds)
    gathered = [None] * nproc if rank == 0 else None
    dist.gather_object(rates, gathered, dst=0)
    if messages is not None:
        messages.put(("progress", "copy, every process at once"))
    return RatePoint(size, summarize([r for rank_rates in gathered for r in rank_rates])) if rank == 0 else None


class _Tf32:
    """Allow TF32 matmuls on CUDA for the duration of a ``with`` block (a no-op elsewhere)."""

    def __init__(self, torch: ModuleType, device: str, *, enabled: bool) -> None:
        self._flags = torch.backends.cuda.matmul if enabled and device == "cuda" else None
        self._saved = False

    def __enter__(self) -> None:
        if self._flags is not None:
            self._saved = self._flags.allow_tf32
            self._flags.allow_tf32 = True

    def __exit__(self, *exc: object) -> None:
        if self._flags is not None:
            self._flags.allow_tf32 = self._saved
