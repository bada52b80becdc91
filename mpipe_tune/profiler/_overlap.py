"""How much a collective and a GEMM slow each other when they run at once: the profile's
``comm_compute_overlap``.

Every rank times three things, each over the same repeats: a matrix product alone (``t_gemm``, the
size chosen so that it lasts about :data:`TARGET_S`), an all-gather alone (``t_comm``, the buffer chosen
so that it lasts about as long as the product, the largest of the sweep's message sizes that does not
pass it), and the two together: the all-gather issued asynchronously, the product run while it is in
flight, then waited for (``t_both``). Side by side at full speed ``t_both = max(t_gemm, t_comm)``; taking
turns ``t_both = t_gemm + t_comm``. The share of the shorter one that the other hid,

    ``overlap = (t_gemm + t_comm - t_both) / min(t_gemm, t_comm)``, clipped to [0, 1],

is what the cost model reads (:attr:`~mpipe_tune.cost._profile.HardwareProfile.overlap_share`): a
collective of ``x`` seconds beside ``c`` seconds of compute costs ``x - overlap * min(x, c)`` beyond the
compute. On an accelerator the collective runs on its own engine and stream (near 1); on CPU ranks with
gloo its progress thread competes with the product's threads for the same cores (well below 1). Each
figure is the slowest rank's per repeat and the medians are used.

>>> overlap_share(gemm_s=1.0, comm_s=1.0, both_s=1.0), overlap_share(gemm_s=1.0, comm_s=0.5, both_s=1.5)
(1.0, 0.0)
>>> overlap_share(gemm_s=2.0, comm_s=1.0, both_s=2.5)
0.5
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpipe_tune.profiler._device import Timer
from mpipe_tune.profiler._links import payload_elements, run_ranks
from mpipe_tune.profiler._settings import SweepSettings

TARGET_S = 0.02
"""About how long the timed product lasts (and the all-gather beside it)."""
_SIZES = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class OverlapPoint:
    """The medians of one overlap measurement, in seconds, and what was timed."""

    gemm_s: float
    comm_s: float
    both_s: float
    matrix_size: int
    """The square product's side."""
    message_bytes: int
    """The all-gather's full buffer."""
    repeats: int
    group_size: int

    @property
    def value(self) -> float:
        return overlap_share(self.gemm_s, self.comm_s, self.both_s)


def overlap_repeats(settings: SweepSettings) -> int:
    """Timed repeats of each of the three figures (one progress step each)."""
    return max(3, settings.repeats)


def overlap_share(gemm_s: float, comm_s: float, both_s: float) -> float:
    """The share of the shorter of a product and a collective hidden when both run at once (module docstring)."""
    shorter = min(gemm_s, comm_s)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (gemm_s + comm_s - both_s) / shorter))


def measure_overlap(device: str, nproc: int, settings: SweepSettings, progress: Callable[[str], None],
                    *, timeout_s: float = 300.0) -> OverlapPoint:
    """Spawn ``nproc`` ranks and time a product, an all-gather and the two at once (module docstring)."""
    return run_ranks(device, nproc, _measure, settings, what="comm/compute overlap measurement",
                     progress=progress, timeout_s=timeout_s)


def slowest_rank_timer(torch, dist, where: str, device: str) -> Callable[[Callable[[], Any]], float]:
    """A timer of one call of a function run by every rank at once, after a barrier: the slowest rank's seconds."""
    timer = Timer(torch, device)

    def timed(fn: Callable[[], Any]) -> float:
        dist.barrier()
        timer.synchronize()
        value = torch.tensor([timer.seconds_per_call(fn)], dtype=torch.float64 if device == "cpu" else torch.float32,
                             device=where)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    return timed


def _measure(torch, dist, where: str, rank: int, nproc: int, device: str, settings: SweepSettings,
             messages) -> OverlapPoint:
    timed = slowest_rank_timer(torch, dist, where, device)

    def sized(fn: Callable[[], Any]) -> float:  # what the sizes are chosen by: a median, steadier on a busy host
        return statistics.median(timed(fn) for _ in range(3))

    size = _SIZES[0]
    for size in _SIZES:  # the first product that lasts the target (every rank agrees: the slowest's time)
        a = torch.randn(size, size, device=where)
        product = _product(torch, a)
        product()
        if sized(product) >= TARGET_S:
            break
    gemm_s = sized(product)
    nominal = [n for n in settings.message_sizes_bytes if n >= nproc * 4] or [nproc * 4]
    chosen = nominal[0]
    for n in nominal:  # the largest all-gather that does not outlast the product
        gather = _all_gather(torch, where, *payload_elements("all_gather", n, nproc))
        gather()
        if sized(gather) > gemm_s:
            break
        chosen = n
    elements, message_bytes = payload_elements("all_gather", chosen, nproc)
    gather = _all_gather(torch, where, elements, message_bytes)
    gather_async = _all_gather(torch, where, elements, message_bytes, async_op=True)

    def both() -> None:
        work = gather_async()
        product()
        work.wait()

    repeats = overlap_repeats(settings)
    samples: dict[str, list[float]] = {"gemm": [], "comm": [], "both": []}
    for repeat in range(repeats):
        for name, fn in (("gemm", product), ("comm", gather), ("both", both)):
            samples[name].append(timed(fn))
        if messages is not None:
            messages.put(("progress", f"overlap repeat {repeat + 1}"))
    gemm_s, comm_s, both_s = (statistics.median(samples[k]) for k in ("gemm", "comm", "both"))
    return OverlapPoint(gemm_s, comm_s, both_s, size, message_bytes, repeats, nproc)


def _product(torch, a) -> Callable[[], Any]:
    out = torch.empty_like(a)
    return lambda: torch.matmul(a, a, out=out)


def _all_gather(torch, where: str, elements: int, message_bytes: int, *, async_op: bool = False):
    x = torch.zeros(elements, dtype=torch.float32, device=where)
    parts = torch.zeros(message_bytes // 4, dtype=torch.float32, device=where)
    from mpipe_tune.runtime import ALL_GATHER_INTO
    return lambda: ALL_GATHER_INTO(parts, x, async_op=async_op)


def overlap_entry(point: OverlapPoint, measured: dict[str, str], between: str, how: str = "") -> dict[str, Any]:
    """The profile's ``comm_compute_overlap`` entry of a measurement: its value with provenance and the
    three medians it came from."""
    return {
        "value": point.value, **measured,
        "ref": f"share of the shorter of a {point.matrix_size}x{point.matrix_size} float32 product and a "
               f"{point.message_bytes / 2**20:.2f} MiB all-gather hidden when they run at once {between} "
               f"((t_gemm + t_comm - t_both) / min(t_gemm, t_comm), medians of {point.repeats} repeats, "
               f"the slowest rank's){how}",
        "gemm_s": point.gemm_s, "comm_s": point.comm_s, "both_s": point.both_s,
    }
