"""How much to measure: matrix sizes, copy size, message sizes, warm-up and repeats per device."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
MAX_PROCESSES = 64
"""The most processes a link sweep starts: one per device, and no host holds more devices than this."""


@dataclass(frozen=True)
class SweepSettings:
    """Everything that sets the length of one profiling run."""

    matmul_sizes: tuple[int, ...]
    """Square matrix sizes tried in increasing order for the peak FLOP/s of each dtype."""
    matmul_max_call_s: float
    """Stop growing the matrices once one product takes longer than this."""
    copy_bytes: int
    """Size of the copied tensor for the memory bandwidth (well above the last-level cache)."""
    message_sizes_bytes: tuple[int, ...]
    """Message sizes of the alpha-beta sweep (the full buffer of a gather-like collective)."""
    warmup: int
    """Untimed calls before every measured point."""
    repeats: int
    """Timed repeats of every roofline point; the median and the IQR over them are reported."""
    link_repeats: int
    """Timed repeats of every (collective, message size) point."""
    min_repeat_s: float
    """One timed repeat batches back-to-back calls until it lasts at least this long, so that short
    calls are not measured at the timer's resolution."""
    calibration_tokens: tuple[int, ...]
    """Microbatch sizes (image and text tokens) at which each layer is timed for its efficiency."""
    calibration_max_point_s: float
    """Stop growing a layer's token count once its forward plus backward takes longer than this."""
    calibration_tolerance: float = 0.02
    """A layer's calibration repeats stop once every median moved by at most this (relative) over the
    last batch of ``repeats``."""
    calibration_max_repeats: int = 35
    """... or once this many repeats were taken (whichever comes first)."""


def sweep_settings(device: str, *, quick: bool) -> SweepSettings:
    """The full sweep for ``device``, or the reduced ``--quick`` one (seconds, for tests and smoke runs)."""
    if quick:
        return SweepSettings(
            matmul_sizes=(64, 128, 256), matmul_max_call_s=0.05, copy_bytes=16 * MiB,
            message_sizes_bytes=tuple(4**k for k in range(1, 9)),  # 4 B .. 64 KiB
            warmup=1, repeats=3, link_repeats=5, min_repeat_s=5e-4,
            calibration_tokens=(16, 64), calibration_max_point_s=0.2, calibration_max_repeats=6,
        )
    messages = tuple(4**k for k in range(1, 13))  # 4 B .. 16 MiB, powers of 4
    if device == "cpu":  # up to 64 MiB: a gradient reduce's size, past the caches that speed up smaller ones
        return SweepSettings(
            matmul_sizes=(256, 512, 1024, 2048, 4096), matmul_max_call_s=0.5, copy_bytes=512 * MiB,
            message_sizes_bytes=messages + (4**13,), warmup=3, repeats=7, link_repeats=25, min_repeat_s=1e-2,
            calibration_tokens=(64, 256, 1024), calibration_max_point_s=1.0,
        )
    return SweepSettings(
        matmul_sizes=(1024, 2048, 4096, 8192, 16384), matmul_max_call_s=0.5, copy_bytes=1024 * MiB,
        message_sizes_bytes=messages, warmup=5, repeats=10, link_repeats=20, min_repeat_s=2e-3,
        calibration_tokens=(256, 1024, 4096), calibration_max_point_s=1.0,
    )
