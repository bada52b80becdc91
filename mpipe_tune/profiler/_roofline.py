"""Roofline measurement: peak FLOP/s per dtype from matrix products, memory bandwidth from copies.

Peak: ``torch.matmul`` of square ``n x n`` matrices for growing ``n``; each size's rate is the median
over repeats of ``2 n^3 / seconds``, and the peak is the best such median (the best *sustained* rate, not
the luckiest single call). Growth stops at the last size, once one product takes longer than the
settings allow, or once two sizes in a row fail to beat the best rate by 3%.

Memory bandwidth: ``dst.copy_(src)`` of a tensor much larger than the last-level cache; each copy moves
``2 * size`` bytes (read and write), and the bandwidth is their median rate.
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
