"""Per-layer, per-microbatch costs: the table every event duration is summed from.

For each layer ``l`` and microbatch ``m`` the table holds seconds for the forward, the input-gradient
(dgrad) and the weight-gradient (wgrad) parts of the backward, the bytes of the layer's output (what a
stage boundary after it sends), the bytes of the activations the forward keeps for the backward, and
the layer's parameter count.

- Explicit-cost layers: ``fwd_s_per_token * tokens`` and ``bwd_s_per_token * tokens`` of the layer's
  stream; the backward splits evenly into dgrad and wgrad (as for a linear layer); no memory figures.
- Architecture layers: FLOPs and bytes from :mod:`mpipe_tune.cost.arch`, timed by the roofline
  ``max(W / (eff * F), D / B)`` with the profile's peak F for the dtype, its memory bandwidth B and its
  efficiency for the layer kind (the forward's, or the backward's for dgrad and wgrad, which differ
  where the profile says so). A layer that has tokens to work on also pays the profile's fixed
  seconds per call for its kind: once per forward, and once per backward it runs (``bwd_overhead_s``,
  charged under the same footprint as the backward). With ``tp_degree > 1`` the forward and the dgrad
  each pay the layer's tensor-parallel all-reduces over the intra-node link.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mpipe_tune.algebra.model import ArchCost, ExplicitCost, Model
from mpipe_tune.cost import arch
from mpipe_tune.cost.profile import HardwareProfile, estimate_collective_s
from mpipe_tune.cost.workload import Microbatch, Workload
from mpipe_tune.errors import MpipeError

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class CostOptions:
    dtype: str = "bf16"
    """Compute and activation dtype; the profile's peak for it is used."""
    tp_degree: int = 1
    """Tensor-parallel degree inside every slab."""
    dp_degree: int = 1
    """Data-parallel degree: replicas of the whole pipeline."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state per parameter (Adam with fp32 master weights and two moments: 12 bytes)."""
    grad_bytes_per_param: float = 4.0
    """Gradient bytes per parameter (fp32 accumulation)."""
    shard_optimizer: bool = True
    """Optimizer state sharded over the data-parallel group (a distributed optimizer, ZeRO-1)."""
    recompute: bool = False
    """Full activation recomputation: each layer keeps only its input for the backward, which first
    re-runs the layer's forward."""

    def dtype_bytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise MpipeError(f"--dtype {self.dtype!r} is not a known dtype; use one of {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LayerTable:
    """Arrays of shape (num_layers, num_microbatches) unless noted."""

    fwd_s: np.ndarray
    dgrad_s: np.ndarray
    wgrad_s: np.ndarray
    boundary_bytes: np.ndarray
    saved_bytes: np.ndarray
    param_count: np.ndarray
    """Shape (num_layers,): full-layer parameters (before tensor-parallel splitting)."""
    recompute_s: np.ndarray
    """The forward re-run before a layer's backward under recomputation (zeros without it)."""
    bwd_overhead_s: np.ndarray
    """Fixed seconds of one backward call of the layer, paid whenever its backward runs (zeros where
    the profile gives no per-call overhead)."""

    def backward_s(self, model: Model) -> np.ndarray:
        """Backward seconds under the footprint: a layer computes its input gradient iff some layer
        before it is trainable, and its weight gradient iff it is trainable; it runs a backward (and
        pays its per-call overhead and any recomputation) iff it does either."""
        needs_dgrad, trainable, runs = _footprint_masks(model.trainable_bits())
        return self.dgrad_s * needs_dgrad + self.wgrad_s * trainable + (self.recompute_s + self.bwd_overhead_s) * runs


@lru_cache(maxsize=256)
def _footprint_masks(trainable_bits: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-layer column masks: computes its input gradient, its weight gradient, runs a backward."""
    trainable = np.array(trainable_bits, dtype=bool)
    needs_dgrad = np.concatenate(([False], np.cumsum(trainable)[:-1] > 0))
    return needs_dgrad[:, None], trainable[:, None], (needs_dgrad | trainable)[:, None]


def build_layer_table(model: Model, workload: Workload, profile: HardwareProfile, options: CostOptions) -> LayerTable:
    unique: dict[tuple, tuple] = {}  # repeated layers share one cost descriptor: compute each once
    for layer in model.layers:
        key = (layer.cost, layer.block)
        if key not in unique:
            unique[key] = _layer_row(layer.cost, layer.block, workload.microbatches, profile, options)
    rows = [unique[(layer.cost, layer.block)] for layer in model.layers]
    fwd, dgrad, wgrad, boundary, saved, bwd_overhead = (np.array(column) for column in zip(*rows))
    return LayerTable(
        fwd_s=fwd,
        dgrad_s=dgrad,
        wgrad_s=wgrad,
        boundary_bytes=boundary,
        saved_bytes=boundary if options.recompute else saved,
        param_count=np.array([_param_count(layer.cost) for layer in model.layers], dtype=float),
        recompute_s=fwd if options.recompute else np.zeros_like(fwd),
        bwd_overhead_s=bwd_overhead,
    )


@lru_cache(maxsize=4096)
def _param_count(cost) -> int:
    return arch.param_count(cost.kind, cost.dims_dict()) if isinstance(cost, ArchCost) else 0


def _layer_row(cost, block: str, microbatches, profile, options):
    if isinstance(cost, ExplicitCost):
        image = block == "encoder"
        tokens = np.array([mb.image_tokens if image else mb.text_tokens for mb in microbatches], dtype=float)
        bwd = cost.bwd_s_per_token * tokens
        zeros = np.zeros_like(tokens)
        return cost.fwd_s_per_token * tokens, bwd / 2, bwd / 2, cost.boundary_bytes_per_token * tokens, zeros, zeros
    values = np.array([_arch_seconds(cost, mb, profile, options) for mb in microbatches], dtype=float)
    return tuple(values[:, i] for i in range(6))


@lru_cache(maxsize=65536)
def _arch_seconds(cost: ArchCost, mb: Microbatch, profile: HardwareProfile, options: CostOptions):
    work = arch.estimate_arch_work(
        cost.kind, cost.dims_dict(), mb, dtype_bytes=options.dtype_bytes(), tp_degree=options.tp_degree
    )
    fwd_peak = profile.peak(options.dtype) * profile.efficiency_for(cost.kind)
    bwd_peak = profile.peak(options.dtype) * profile.backward_efficiency_for(cost.kind)
    bandwidth = profile.memory_bytes_per_s
    tp_s = 0.0
    if options.tp_degree > 1 and work.tp_comm_bytes > 0:
        link = profile.link("all_reduce", inter_node=options.tp_degree > profile.devices_per_node)
        tp_s = estimate_collective_s(link, "all_reduce", work.tp_comm_bytes, options.tp_degree)
    tokens = mb.image_tokens if cost.kind in arch.IMAGE_STREAM_KINDS else mb.text_tokens
    fwd_call_s, bwd_call_s = profile.call_overhead_for(cost.kind) if tokens > 0 else (0.0, 0.0)
    fwd = fwd_call_s + max(work.fwd_flops / fwd_peak, work.fwd_bytes / bandwidth) + tp_s
    dgrad = max(work.dgrad_flops / bwd_peak, work.dgrad_bytes / bandwidth) + tp_s
    wgrad = max(work.wgrad_flops / bwd_peak, work.wgrad_bytes / bandwidth)
    return fwd, dgrad, wgrad, work.boundary_bytes, work.saved_activation_bytes, bwd_call_s
