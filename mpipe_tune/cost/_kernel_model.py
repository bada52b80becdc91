"""Kernel efficiency by shape and the host's issue cost: the profile's ``kernel_efficiency`` and ``host``.

A profile may give, besides its per-kind efficiencies, one efficiency curve per kernel family and the
host's cost of issuing a kernel. The curve forms are fixed (the profiler fits exactly these):

- GEMM ``(m, n, k)`` (output ``m x n``, reduction ``k``, per rank):
  ``eff = max * wave(m, n) * s(m) * s(n) * s(k)`` with ``s(x) = x / (x + half_dim)`` (the roll-off of a
  small dimension) and ``wave = tiles / (ceil(tiles / units) * units)``,
  ``tiles = ceil(m / tile_m) * ceil(n / tile_n)`` (the last wave of output tiles leaves compute units idle);
- attention core over sequences of length ``L``: ``eff = max * L / (L + half_seq)``;
- memory-bound kernels moving ``b`` bytes each: ``eff = max * b / (b + half_bytes)`` of the memory bandwidth;
- index kernels (a MoE dispatcher's data-dependent gathers, sorts and scatter-adds), where the profile gives
  them a curve of their own: the same form, else the memory curve.

The host (:class:`HostCosts`): ``dispatch_s`` per kernel issued, ``sync_s`` per host sync that drains the
device's queue (the loss read back, the gradient-norm check, MoE token counts), and ``issue`` (:data:`ISSUE_MODES`),
how the device consumes what the host issues: ``async`` (the default, an accelerator): the device runs behind a
queue, so between two syncs a pass takes ``max(device, host issue)``; ``inline`` (a CPU, where eager torch runs each
operator on the issuing thread): nothing overlaps, a pass takes ``device + host issue``. The framework's kernel mode
(:data:`KERNEL_MODES`, :class:`~mpipe_tune.cost._framework.Framework`) says which kernels run and what the host
pays per kernel:

- ``eager``: every operator its own kernel (unfused norms and activations, one GEMM per expert), each issued
  at ``dispatch_s``, the optimizer as torch's ``foreach`` AdamW;
- ``fused``: fused norm, activation and permutation kernels and grouped expert GEMMs (Megatron-LM with
  Transformer Engine, its default), each issued at ``dispatch_s``, a fused optimizer;
- ``compiled``: as ``fused``, and a compiler fuses each run of memory-bound kernels between two GEMMs or
  attention cores into one kernel;
- ``graphs``: the ``fused`` kernels captured in CUDA graphs: the host issues one graph launch per layer pass
  (``dispatch_s``), the device replays the kernels.

Both profile keys are optional: without ``kernel_efficiency`` a layer is timed as before (one efficiency per
kind), without ``host`` the host costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from mpipe_tune.algebra import DEFAULT_KERNEL_MODE, KERNEL_MODES  # noqa: F401 (the modes, described above)
from mpipe_tune.cost._arch_pieces import maximum


@dataclass(frozen=True)
class GemmCurve:
    max: float
    half_dim: float
    tile_m: int
    tile_n: int
    units: int

    def efficiency(self, m, n, k):
        """Achieved fraction of peak of an ``m x n`` output GEMM reducing over ``k`` (arrays elementwise).

        >>> c = GemmCurve(max=0.8, half_dim=128, tile_m=128, tile_n=128, units=132)
        >>> round(float(c.efficiency(8192, 8192, 8192)), 3), round(float(c.efficiency(128, 128, 128)), 4)
        (0.741, 0.0008)
        """
        tiles = np.ceil(np.asarray(m, dtype=float) / self.tile_m) * np.ceil(np.asarray(n, dtype=float) / self.tile_n)
        tiles = np.maximum(tiles, 1.0)
        wave = tiles / (np.ceil(tiles / self.units) * self.units)
        return self.max * wave * _rolloff(m, self.half_dim) * _rolloff(n, self.half_dim) * _rolloff(k, self.half_dim)


@dataclass(frozen=True)
class AttentionCurve:
    max: float
    half_seq: float
    native_ratio: float | None = None
    """The framework's own attention kernel (torch's ``scaled_dot_product_attention`` with its default backend,
    what ``eager`` and ``compiled`` trainers call) as a fraction of the fused stack's rate (Transformer Engine's,
    which ``max`` describes), where the profile states one; None: the same rate."""

    def efficiency(self, seq_len, native: bool = False):
        """Achieved fraction of peak of the attention core over sequences of ``seq_len`` tokens (``native``:
        the framework's own kernel, :attr:`native_ratio`).

        >>> AttentionCurve(0.6, 512).efficiency(512), AttentionCurve(0.6, 512, 0.5).efficiency(512, native=True)
        (0.3, 0.15)
        """
        return self.top(native) * _rolloff(seq_len, self.half_seq)

    def top(self, native: bool = False) -> float:
        """``max``, or for the framework's own kernel ``max * native_ratio`` where the profile gives it."""
        return self.max * self.native_ratio if native and self.native_ratio is not None else self.max


@dataclass(frozen=True)
class MemoryCurve:
    max: float
    half_bytes: float

    def efficiency(self, kernel_bytes):
        """Achieved fraction of the memory bandwidth of a kernel moving ``kernel_bytes``.

        >>> MemoryCurve(0.8, 1e6).efficiency(3e6)
        0.6000000000000001
        """
        return self.max * _rolloff(kernel_bytes, self.half_bytes)


def _rolloff(x, half):
    x = np.maximum(np.asarray(x, dtype=float), 0.0)
    out = x / (x + half) if half > 0 else np.ones_like(x)
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class KernelEfficiency:
    """The profile's curves; a family it does not give (None) runs at the per-kind efficiencies."""

    gemm: GemmCurve | None = None
    attention: AttentionCurve | None = None
    memory: MemoryCurve | None = None
    index: MemoryCurve | None = None
    """Data-dependent index kernels (a MoE dispatcher's token gathers, sorts and scatter-adds,
    :attr:`~mpipe_tune.cost._arch_pieces.Piece.index`), where a device runs them below its streaming kernels'
    bandwidth; None: as ``memory``."""


@dataclass(frozen=True)
class HostCosts:
    dispatch_s: float
    """Host seconds to issue one kernel (or one graph launch in ``graphs`` mode)."""
    sync_s: float
    """Host seconds of one sync that drains the device queue and reads a value back."""
    issue: str = "async"
    """How the device consumes the host's queue (:data:`ISSUE_MODES`): ``async`` overlaps issue and device work,
    ``inline`` runs each kernel on the issuing thread (a CPU), so the two add up."""

    @property
    def inline(self) -> bool:
        return self.issue == "inline"

    def pass_s(self, device_s, host_s):
        """Seconds of a pass whose device (and collective) work takes ``device_s`` and whose kernels the host
        issues in ``host_s`` (arrays elementwise): their sum when inline, else the larger.

        >>> HostCosts(1e-6, 0.0).pass_s(3.0, 2.0), HostCosts(1e-6, 0.0, "inline").pass_s(3.0, 2.0)
        (3.0, 5.0)
        """
        return device_s + host_s if self.inline else maximum(device_s, host_s)


ISSUE_MODES = ("async", "inline")
"""The host section's ``issue``: ``async`` (an accelerator's queue runs ahead of the host), ``inline`` (a CPU)."""
FAMILIES = {"gemm": GemmCurve, "attention": AttentionCurve, "memory": MemoryCurve, "index": MemoryCurve}
_INTEGER_FIELDS = ("tile_m", "tile_n", "units")
_OPTIONAL_FIELDS = ("native_ratio",)


def parse_kernel_efficiency(v, table: Any) -> KernelEfficiency:
    """The ``kernel_efficiency`` object, checked with the profile's validator ``v`` (one-line errors)."""
    entries = v.table("kernel_efficiency", table, allowed=tuple(FAMILIES))
    curves = {}
    for family, entry in entries.items():
        path = f"kernel_efficiency.{family}"
        if not isinstance(entry, Mapping):
            v.fail(path, entry, "must be an object of the curve's numbers and their provenance",
                   "see docs/cost-model.md, 'Kernel efficiency by shape'")
        numbers = tuple(f.name for f in fields(FAMILIES[family])
                        if f.name not in _OPTIONAL_FIELDS or f.name in entry)
        values = {}
        for key in numbers:
            if key not in entry:
                v.fail(f"{path}.{key}", v.missing, "is required", f"give the curve's {key}")
            if key in _INTEGER_FIELDS:
                value = entry[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    v.fail(f"{path}.{key}", value, "must be an integer >= 1", "give the tile size or unit count")
                values[key] = value
            else:
                values[key] = v.scalar(f"{path}.{key}", entry[key], positive=key == "max")
        if values["max"] > 1 or values.get("native_ratio", 0) > 1:
            v.fail(f"{path}.max", values["max"], "must lie in (0, 1]", "give the achieved fraction of peak")
        v.origin(path, entry, numbers)
        curves[family] = FAMILIES[family](**values)
    return KernelEfficiency(**curves)


def parse_host(v, table: Any) -> HostCosts:
    """The ``host`` object: ``dispatch_s`` and ``sync_s``, each a number with its provenance, and the optional
    ``issue`` (one of :data:`ISSUE_MODES`; absent, ``async``)."""
    entries = v.table("host", table, allowed=("dispatch_s", "sync_s", "issue"))
    values = {}
    for key in ("dispatch_s", "sync_s"):
        if key not in entries:
            v.fail(f"host.{key}", v.missing, "is required", "give it with its source (measured, assumed, ...)")
        values[key] = v.number(f"host.{key}", entries[key], positive=False)
    issue = entries.get("issue", "async")
    if issue not in ISSUE_MODES:
        v.fail("host.issue", issue, f"must be one of {', '.join(ISSUE_MODES)}",
               "async where the device runs behind a queue (an accelerator), inline where each kernel runs on "
               "the issuing thread (a CPU)")
    return HostCosts(**values, issue=issue)


def kernel_efficiency_dict(curves: KernelEfficiency, provenance: Mapping[str, Mapping[str, Any]], thaw) -> dict:
    """The JSON form of ``curves`` (what :func:`parse_kernel_efficiency` reads back)."""
    out = {}
    for family in FAMILIES:
        curve = getattr(curves, family)
        if curve is not None:
            out[family] = {**{f.name: getattr(curve, f.name) for f in fields(curve) if getattr(curve, f.name) is not None},
                           **thaw(provenance[f"kernel_efficiency.{family}"])}
    return out


def host_dict(host: HostCosts, provenance: Mapping[str, Mapping[str, Any]], thaw) -> dict:
    """The JSON form of ``host`` (``issue`` written where it is not the default)."""
    out: dict[str, Any] = {key: {"value": getattr(host, key), **thaw(provenance[f"host.{key}"])}
                           for key in ("dispatch_s", "sync_s")}
    return out if not host.inline else {**out, "issue": host.issue}


def optimizer_kernels(tensors, mode: str) -> float:
    """Kernels one optimizer step launches over ``tensors`` parameter tensors under kernel ``mode``: torch's
    ``foreach`` AdamW in ``eager`` (:data:`FOREACH_OPS` multi-tensor ops, each split into launches of at most
    :data:`FOREACH_TENSORS_PER_LAUNCH` tensors), a fused Adam otherwise (one multi-tensor kernel per
    :data:`FOREACH_TENSORS_PER_LAUNCH` tensors); under ``graphs`` the step is one launch.

    >>> optimizer_kernels(100, "eager"), optimizer_kernels(100, "fused"), optimizer_kernels(100, "graphs")
    (48.0, 4.0, 1.0)
    """
    if tensors <= 0:
        return 0.0
    launches = math.ceil(tensors / FOREACH_TENSORS_PER_LAUNCH)
    if mode == "graphs":
        return 1.0
    return float(FOREACH_OPS * launches if mode == "eager" else launches)


FOREACH_OPS = 12
"""Multi-tensor operations of one ``foreach`` AdamW step (torch.optim.adamw's ``_multi_tensor_adamw``: the step
count, weight decay, the two moment updates, bias corrections, square root, division and the update)."""
FOREACH_TENSORS_PER_LAUNCH = 32
"""Tensors one multi-tensor launch takes (the order of torch's and apex's multi_tensor_apply depth-1 lists)."""
