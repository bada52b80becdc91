"""The host time torch FSDP2 adds per sharded layer per forward or backward call: the profile's
``fsdp_host_s``.

On the profiled ranks, for stacks of ``K`` small linear layers (:data:`UNITS`), every rank times three
things over the same repeats: one training step of the stack unsharded (``t_plain``: compute alone), the
collectives FSDP2 runs for it issued by hand on buffers of the same sizes (``t_comm``: per layer two
all-gathers of its weights, before its forward and again before its backward, and one reduce-scatter of
its gradient), and the step of the stack with ``fully_shard`` on each layer and on the stack, resharding
after forward (``t_fsdp``). What FSDP2 costs beyond its compute and its collectives,
``t_fsdp - t_plain - t_comm``, is its host work: the pre- and post-forward and backward hooks, the copy of
the shards into the all-gather's flat buffer and out of it, the gradient's copy into the reduce-scatter's.
It grows with the calls, ``2 K`` (a forward and a backward per layer), and the line fitted through the
stacks (:func:`fit_host_s`) gives the per-call seconds as its slope (the stack's own root hooks in its
intercept). The layers are small (:data:`WIDTH`) so that the host work is not lost in the compute's noise.
Each figure is the slowest rank's per repeat and the medians are used; on a shared host the figure
carries the load (say so in the profile's notes).

>>> [round(x, 12) for x in fit_host_s([2, 4, 8], [0.3, 0.5, 0.9])]  # 0.1 s per call, 0.1 s for the stack
[0.1, 0.1]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler._links import run_ranks
from mpipe_tune.profiler._overlap import slowest_rank_timer
from mpipe_tune.profiler._settings import SweepSettings

UNITS = (2, 4, 8, 16)
"""Layers per timed stack."""
WIDTH = 64
"""Each linear layer's side (``WIDTH x WIDTH`` weights, a ``BATCH x WIDTH`` input)."""
BATCH = 16


@dataclass(frozen=True)
class FsdpHostPoint:
    """The medians of one measurement, in seconds per step, per stack size, and the fitted figure."""

    units: tuple[int, ...]
    plain_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    fsdp_s: tuple[float, ...]
    repeats: int
    group_size: int

    @property
    def extra_s(self) -> tuple[float, ...]:
        """Per stack, FSDP2's seconds beyond its compute and its collectives."""
        return tuple(f - p - c for f, p, c in zip(self.fsdp_s, self.plain_s, self.comm_s))

    @property
    def value(self) -> float:
        """Seconds per sharded layer per forward or backward call (the fit's slope, at least 0)."""
        return max(0.0, fit_host_s([2 * k for k in self.units], self.extra_s)[0])


def fit_host_s(calls: Sequence[float], extra_s: Sequence[float]) -> tuple[float, float]:
    """The least-squares line ``extra = per_call * calls + fixed`` through the stacks' extra seconds:
    ``(per_call, fixed)``; one line unless two or more distinct call counts are given."""
    x, y = np.asarray(calls, dtype=float), np.asarray(extra_s, dtype=float)
    if len(x) != len(y) or len(np.unique(x)) < 2:
        raise MpipeError(f"FSDP2 host-cost fit: {len(np.unique(x))} distinct call counts for {len(y)} timings; "
                         "time two or more stack sizes")  # the profiler's own sweep, not a user's quantity
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def measure_fsdp_host(device: str, nproc: int, settings: SweepSettings, progress: Callable[[str], None],
                      *, timeout_s: float = 300.0) -> FsdpHostPoint:
    """Spawn ``nproc`` ranks and time the stacks plain, their collectives, and sharded (module docstring)."""
    return run_ranks(device, nproc, _measure, settings, what="FSDP2 host-cost measurement", progress=progress,
                     timeout_s=timeout_s)


def _measure(torch, dist, where: str, rank: int, nproc: int, device: str, settings: SweepSettings,
             messages) -> FsdpHostPoint:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    timed = slowest_rank_timer(torch, dist, where, device)
    mesh = init_device_mesh(device, (nproc,))
    repeats = max(5, settings.repeats)
    x = torch.randn(BATCH, WIDTH, device=where)
    out: dict[str, list[float]] = {"plain": [], "comm": [], "fsdp": []}
    for units in UNITS:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, device=where) for _ in range(units)))
        sharded = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, device=where) for _ in range(units)))
        for layer in sharded:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
        params = WIDTH * WIDTH + WIDTH
        padded = -(-params // nproc) * nproc
        shard, whole = torch.zeros(padded // nproc, device=where), torch.zeros(padded, device=where)
        from mpipe_tune.runtime import ALL_GATHER_INTO as gather, REDUCE_SCATTER_FROM as scatter

        def step(module) -> Callable[[], Any]:
            def run() -> None:
                module(x).sum().backward()
                module.zero_grad(set_to_none=True)
            return run

        def collectives() -> None:
            for _ in range(units):
                gather(whole, shard)
                gather(whole, shard)
                scatter(shard, whole)

        fns = {"plain": step(plain), "comm": collectives, "fsdp": step(sharded)}
        for fn in fns.values():  # warm up
            fn()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(timed(fn))
        for name in fns:
            out[name].append(statistics.median(samples[name]))
        if messages is not None:
            messages.put(("progress", f"FSDP2 host cost: {units} layers"))
    return FsdpHostPoint(UNITS, tuple(out["plain"]), tuple(out["comm"]), tuple(out["fsdp"]), repeats, nproc)


def fsdp_host_entry(point: FsdpHostPoint, measured: dict[str, str], between: str, how: str = "") -> dict[str, Any]:
    """The profile's ``fsdp_host_s`` entry of a measurement: its value with provenance and the medians it came
    from."""
    return {
        "value": point.value, **measured,
        "ref": f"slope per layer call of FSDP2's step time beyond its compute and its collectives (t_fsdp - "
               f"t_plain - t_comm) over stacks of {', '.join(map(str, point.units))} fully_shard-ed "
               f"{WIDTH}x{WIDTH} linear layers resharding after forward, {between} (medians of {point.repeats} "
               f"repeats, the slowest rank's){how}",
        "units": list(point.units), "plain_s": list(point.plain_s), "comm_s": list(point.comm_s),
        "fsdp_s": list(point.fsdp_s),
    }
