"""The host time torch FSDP2 adds around its collectives: the profile's ``fsdp_host_s`` (seconds per sharded
layer per forward or backward call), ``fsdp_bytes_s`` (seconds per byte of the layer's unsharded buffer per
collective it issues), ``fsdp_collective_s`` (seconds per collective) and ``fsdp_tensor_s`` (seconds per parameter
tensor of the layer per collective).

On the profiled ranks, for stacks of ``K`` sharded layers (:data:`UNITS`) of three shapes (:data:`WIDTHS`,
:data:`LINEARS`: one linear layer of each of two widths, and eight narrow ones as one layer), every rank times
three things over the same repeats: one training step of the stack unsharded (``t_plain``: compute alone), the
collectives FSDP2 runs for it issued by hand on buffers of the same sizes (``t_comm``: per layer two all-gathers of
its weights, before its forward and again before its backward, and one reduce-scatter of its gradient), and the
step of the stack with ``fully_shard`` on each layer and on the stack, resharding after forward (``t_fsdp``). What
FSDP2 costs beyond its compute and its collectives, ``t_fsdp - t_plain - t_comm``, is its host work: the pre- and
post-forward and backward hooks (a fixed cost per call) and, growing with the layer's size, the copies of the
shards into the all-gather's flat buffer and of the gathered weights out of it, the gradient's copy into the
reduce-scatter's, and the fresh buffers they fill. Per width, the line fitted through the stacks
(:func:`fit_host_s`) gives the seconds per layer as its slope (the stack's own root hooks in its intercept); a
layer takes two calls (its forward and its backward) and three collectives of its ``B`` bytes. The narrow layers
show the hooks, the wide ones (a few MB, a small model's block) the copies, and FSDP2's work on each parameter
tensor around a collective (its views into the buffers, the swap of sharded and unsharded parameters, the sharded
gradients) grows with the layer's tensors: the shapes' slopes ``2 h + 3 B c + 3 T k`` (``T`` tensors) give the
per-call ``h``, the per-byte ``c`` and the per-tensor ``k`` (:func:`split_per_layer`), each held at 0 or above. The
collectives issued by hand, back to back as FSDP2 issues them, are compared with what the profile's own measured
links price them at (:func:`priced_layer_comm_s`, the cost model's reading of the sweeps, which time each
collective on its own): per width their excess per collective, fitted against the layer's bytes
(:func:`~mpipe_tune.profiler._fit.fit_nonnegative_line`), gives ``fsdp_collective_s`` (fixed seconds per
collective, a host's wake-ups between small ones) and a per-byte share added to ``fsdp_bytes_s``. Each figure is
the slowest rank's per repeat and the medians are used; on a shared host the figures carry the load (say so in the
profile's notes).

>>> [round(x, 12) for x in fit_host_s([2, 4, 8], [0.3, 0.5, 0.9])]  # 0.1 s per call, 0.1 s for the stack
[0.1, 0.1]
>>> [round(x, 15) for x in split_per_layer([100, 1100, 800], [2, 2, 16],  # 0.1 s a call, 1 us a byte, 1 ms a tensor
...                                          [0.2 + 3e-4 + 6e-3, 0.2 + 3.3e-3 + 6e-3, 0.2 + 2.4e-3 + 4.8e-2])]
[0.1, 1e-06, 0.001]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler._fit import fit_nonnegative_line, nonnegative_fit
from mpipe_tune.profiler._links import run_ranks
from mpipe_tune.profiler._overlap import slowest_rank_timer
from mpipe_tune.profiler._settings import SweepSettings

UNITS = (2, 4, 8, 16)
"""Layers per timed stack."""
WIDTHS = (64, 768, 64)
"""Per shape, each linear layer's side (``WIDTH x WIDTH`` weights and a bias, a ``BATCH x WIDTH`` input)."""
LINEARS = (1, 1, 8)
"""Per shape, the linear layers one sharded layer holds: the hooks, the copies, then the per-tensor work."""
TENSORS_PER_LINEAR = 2
"""A weight and a bias."""
BATCH = 16
CALLS_PER_LAYER = 2
"""A forward and a backward."""
COLLECTIVES_PER_LAYER = 3
"""Resharding after forward: an all-gather before each call and the gradient's reduce-scatter."""
ELEMENT_BYTES = 4
"""The stacks' weights are float32."""


def layer_bytes(width: int, group_size: int, linears: int = 1) -> int:
    """The unsharded bytes of a sharded layer of ``linears`` ``width``-wide linear layers' weights and biases,
    padded to the group."""
    params = linears * (width * width + width)
    return -(-params // group_size) * group_size * ELEMENT_BYTES


@dataclass(frozen=True)
class FsdpHostPoint:
    """The medians of one measurement, in seconds per step, per width (outer) and stack size (inner), and the
    fitted figures."""

    units: tuple[int, ...]
    plain_s: tuple[tuple[float, ...], ...]
    comm_s: tuple[tuple[float, ...], ...]
    fsdp_s: tuple[tuple[float, ...], ...]
    repeats: int
    group_size: int
    widths: tuple[int, ...] = WIDTHS
    linears: tuple[int, ...] = LINEARS
    """Per shape, the linear layers one sharded layer holds (its tensors: :data:`TENSORS_PER_LINEAR` each)."""
    priced_s: tuple[float, ...] | None = None
    """Per shape, what the profile's measured links price one layer's three collectives at
    (:func:`priced_layer_comm_s`); None: not compared (no per-collective figure)."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """Per shape, a sharded layer's unsharded bytes."""
        return tuple(layer_bytes(w, self.group_size, n) for w, n in zip(self.widths, self.linears))

    def extra_s(self, width_index: int) -> tuple[float, ...]:
        """Per stack of the width, FSDP2's seconds beyond its compute and its collectives."""
        return tuple(f - p - c for f, p, c in zip(self.fsdp_s[width_index], self.plain_s[width_index],
                                                  self.comm_s[width_index]))

    @property
    def per_layer_s(self) -> tuple[float, ...]:
        """Per width, the seconds a sharded layer adds (the fit's slope over the stacks)."""
        return tuple(fit_host_s(self.units, self.extra_s(i))[0] for i in range(len(self.widths)))

    @property
    def excess_s(self) -> tuple[float, ...]:
        """Per width, the seconds each of a layer's collectives takes issued back to back beyond the links' price
        (0 without :attr:`priced_s`)."""
        if self.priced_s is None:
            return (0.0,) * len(self.widths)
        comm = (fit_host_s(self.units, self.comm_s[i])[0] for i in range(len(self.widths)))
        return tuple((c - p) / COLLECTIVES_PER_LAYER for c, p in zip(comm, self.priced_s))

    @property
    def figures(self) -> tuple[float, float, float, float]:
        """``(fsdp_host_s, fsdp_bytes_s, fsdp_collective_s, fsdp_tensor_s)``: seconds per layer call (the hooks),
        per byte of a layer per collective (the copies, and the collectives' excess per byte), per collective (their
        fixed excess) and per tensor of a layer per collective, each >= 0."""
        sizes = [float(b) for b in self.sizes]
        per_call, per_byte, per_tensor = split_per_layer(
            sizes, [TENSORS_PER_LINEAR * n for n in self.linears], self.per_layer_s)
        fixed, excess_per_byte = fit_nonnegative_line(np.array(sizes), np.array(self.excess_s), np.ones(len(sizes)))
        return per_call, per_byte + excess_per_byte, fixed, per_tensor


def fit_host_s(calls: Sequence[float], extra_s: Sequence[float]) -> tuple[float, float]:
    """The least-squares line ``extra = slope * calls + fixed`` through the stacks' extra seconds:
    ``(slope, fixed)``; one line unless two or more distinct call counts are given."""
    x, y = np.asarray(calls, dtype=float), np.asarray(extra_s, dtype=float)
    if len(x) != len(y) or len(np.unique(x)) < 2:
        raise MpipeError(f"FSDP2 host-cost fit: {len(np.unique(x))} distinct call counts for {len(y)} timings; "
                         "time two or more stack sizes")  # the profiler's own sweep, not a user's quantity
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)


def split_per_layer(sizes: Sequence[float], tensors: Sequence[float],
                    per_layer_s: Sequence[float]) -> tuple[float, float, float]:
    """``(per_call, per_byte, per_tensor)`` of the least-squares fit ``per_layer = 2 per_call + 3 size per_byte +
    3 tensors per_tensor`` over the shapes (:data:`CALLS_PER_LAYER`, :data:`COLLECTIVES_PER_LAYER`), each held at 0
    or above (:func:`~mpipe_tune.profiler._fit.nonnegative_fit`); with one tensor count among the shapes, no
    per-tensor figure (0)."""
    sizes, tensors = np.asarray(sizes, dtype=float), np.asarray(tensors, dtype=float)
    if len(sizes) != len(per_layer_s) or len(np.unique(sizes)) < 2:
        raise MpipeError(f"FSDP2 host-cost fit: {len(np.unique(sizes))} distinct layer sizes for {len(per_layer_s)} "
                         "slopes; time two or more widths")  # the profiler's own sweep, not a user's quantity
    columns = [np.full(len(sizes), float(CALLS_PER_LAYER)), COLLECTIVES_PER_LAYER * sizes]
    if len(np.unique(tensors)) > 1:
        columns.append(COLLECTIVES_PER_LAYER * tensors)
    per_call, per_byte, *per_tensor = nonnegative_fit(columns, per_layer_s)
    return per_call, per_byte, (per_tensor or [0.0])[0]


def priced_layer_comm_s(profile, sizes: Sequence[float], group_size: int) -> tuple[float, ...]:
    """Per layer size (bytes), the seconds ``profile`` (a :class:`~mpipe_tune.cost.HardwareProfile`) prices one
    resharding layer's collectives at over ``group_size`` neighbouring ranks, as the cost model prices FSDP2's
    (:func:`~mpipe_tune.cost.sharded_half_s`): two all-gathers and a reduce-scatter of the layer's bytes."""
    from mpipe_tune.cost import sharded_half_s

    return tuple(2 * sharded_half_s(profile, "all_gather", n, group_size, 1)
                 + sharded_half_s(profile, "reduce_scatter", n, group_size, 1) for n in sizes)


def measure_fsdp_host(device: str, nproc: int, settings: SweepSettings, progress: Callable[[str], None],
                      *, timeout_s: float = 300.0) -> FsdpHostPoint:
    """Spawn ``nproc`` ranks and time the stacks plain, their collectives, and sharded (module docstring)."""
    return run_ranks(device, nproc, _measure, settings, what="FSDP2 host-cost measurement", progress=progress,
                     timeout_s=timeout_s)


def _measure(torch, dist, where: str, rank: int, nproc: int, device: str, settings: SweepSettings,
             messages) -> FsdpHostPoint:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mpipe_tune.runtime import ALL_GATHER_INTO as gather, REDUCE_SCATTER_FROM as scatter

    timed = slowest_rank_timer(torch, dist, where, device)
    mesh = init_device_mesh(device, (nproc,))
    repeats = max(5, settings.repeats)
    out: dict[str, list[tuple[float, ...]]] = {"plain": [], "comm": [], "fsdp": []}

    def layer(width: int, linears: int):
        made = [torch.nn.Linear(width, width, device=where) for _ in range(linears)]
        return made[0] if linears == 1 else torch.nn.Sequential(*made)

    for width, linears in zip(WIDTHS, LINEARS):
        x = torch.randn(BATCH, width, device=where)
        medians: dict[str, list[float]] = {k: [] for k in out}
        for units in UNITS:
            torch.manual_seed(0)
            plain = torch.nn.Sequential(*(layer(width, linears) for _ in range(units)))
            sharded = torch.nn.Sequential(*(layer(width, linears) for _ in range(units)))
            for unit in sharded:
                fully_shard(unit, mesh=mesh, reshard_after_forward=True)
            fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
            padded = layer_bytes(width, nproc, linears) // ELEMENT_BYTES
            shard, whole = torch.zeros(padded // nproc, device=where), torch.zeros(padded, device=where)

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
                medians[name].append(statistics.median(samples[name]))
            if messages is not None:
                messages.put(("progress", f"FSDP2 host cost: {units} layers of {linears} x {width}x{width}"))
        for name in out:
            out[name].append(tuple(medians[name]))
    return FsdpHostPoint(UNITS, tuple(out["plain"]), tuple(out["comm"]), tuple(out["fsdp"]), repeats, nproc)


def fsdp_host_entries(point: FsdpHostPoint, measured: dict[str, str], between: str,
                      how: str = "") -> dict[str, dict[str, Any]]:
    """The profile's ``fsdp_host_s``, ``fsdp_bytes_s``, ``fsdp_collective_s`` and ``fsdp_tensor_s`` entries of a
    measurement: their values with provenance, the first with the medians they came from."""
    per_call, per_byte, per_collective, per_tensor = point.figures
    shapes = ", ".join(f"{n} x {w}x{w}" for w, n in zip(point.widths, point.linears))
    stacks = (f"stacks of {', '.join(map(str, point.units))} fully_shard-ed layers of linear layers ({shapes}) "
              f"resharding after forward, {between} (medians of {point.repeats} repeats, the slowest rank's){how}")
    return {
        "fsdp_host_s": {
            "value": per_call, **measured,
            "ref": f"per layer call: FSDP2's step time beyond its compute and its collectives (t_fsdp - t_plain - "
                   f"t_comm), its slope per layer of each shape split into {CALLS_PER_LAYER} calls and "
                   f"{COLLECTIVES_PER_LAYER} collectives of the layer's bytes and tensors, over {stacks}",
            "units": list(point.units), "widths": list(point.widths), "linears": list(point.linears),
            "layer_bytes": list(point.sizes),
            "plain_s": [list(v) for v in point.plain_s], "comm_s": [list(v) for v in point.comm_s],
            "fsdp_s": [list(v) for v in point.fsdp_s],
            **({} if point.priced_s is None else {"priced_comm_s": list(point.priced_s)}),
        },
        "fsdp_bytes_s": {
            "value": per_byte, **measured,
            "ref": f"per byte of a layer's unsharded weights per all-gather or reduce-scatter FSDP2 issues: its "
                   f"copies and buffers (the same fit as fsdp_host_s, whose entry holds the medians) and what its "
                   f"collectives issued back to back take per byte beyond the profile's links (fsdp_collective_s), "
                   f"over {stacks}",
        },
        "fsdp_tensor_s": {
            "value": per_tensor, **measured,
            "ref": f"per parameter tensor of a layer per all-gather or reduce-scatter FSDP2 issues: its work on each "
                   f"tensor (the same fit as fsdp_host_s, whose entry holds the medians), over {stacks}",
        },
        **({} if point.priced_s is None else {"fsdp_collective_s": {
            "value": per_collective, **measured,
            "ref": f"per all-gather or reduce-scatter FSDP2 issues: the fixed seconds its collectives, issued back to "
                   f"back as it issues them (t_comm), take beyond what this profile's measured links price them at "
                   f"(priced_comm_s in fsdp_host_s, per layer), fitted over the layer sizes with fsdp_bytes_s, over "
                   f"{stacks}",
        }}),
    }
