"""Layer costs from architecture: FLOPs, HBM bytes, saved activations and parameters of one layer.

A model spec layer with an architecture ``kind`` (see :data:`ARCH_KINDS`) and its dimensions becomes,
for one microbatch, an :class:`ArchWork`: the work of its forward, input-gradient and weight-gradient
passes, the activations the forward keeps for the backward, the size of the tensor it hands to the
next pipeline stage, and its tensor-parallel traffic. The roofline in :mod:`mpipe_tune.cost` turns
FLOPs and bytes into seconds with a hardware profile; nothing here knows a device.

Assumptions (details in :mod:`~mpipe_tune.cost.arch_pieces` and :mod:`~mpipe_tune.cost.arch_layers`):

- FLOPs count matmuls (``2*m*n*k``), attention scores and values, and a few FLOPs per element for
  norms, activations and softmax. Backward: each matmul's input gradient and weight gradient cost
  its forward once each; the weightless attention core costs twice its forward, all input gradient.
  Causal attention is charged the full square of scores, as in Megatron-LM's FLOPs formula.
- Bytes are HBM traffic: each kernel reads its weights and inputs and writes its output once
  (attention is a fused kernel that keeps scores on chip). Weights and activations are
  ``dtype_bytes`` wide, as are gradients; optimizer traffic is not a layer's.
- Saved activations are every tensor some kernel needs in its backward, without recomputation, each
  counted once per rank (norms and residuals are not split over tensor-parallel ranks).
- Tensor parallelism is Megatron-LM's column/row split of matmuls and attention heads, one
  all-reduce after each row-split output (two per transformer block) and a vocab-parallel embedding
  and loss.
- Image-stream kinds (:data:`IMAGE_STREAM_KINDS`) see ``image_tokens * merge_factor`` ViT patches
  with attention inside each image; every other kind sees one causal sequence of ``text_tokens``.
  A layer whose stream has no tokens in the microbatch does no work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mpipe_tune.algebra.model import ArchCost, Model
from mpipe_tune.cost.arch_dims import (
    ARCH_KINDS,
    IMAGE_STREAM_KINDS,
    OPTIONAL_DIMS,
    resolve_dims,
    tensor_parallel_problem,
    validate_arch,
)
from mpipe_tune.cost.arch_layers import build_layer
from mpipe_tune.cost.workload import Microbatch
from mpipe_tune.errors import MpipeError

__all__ = [
    "ARCH_KINDS",
    "IMAGE_STREAM_KINDS",
    "OPTIONAL_DIMS",
    "ArchWork",
    "activated_param_count",
    "estimate_arch_work",
    "param_count",
    "tensor_parallel_fits",
    "validate_tensor_parallel_degree",
    "validate_arch",
]


@dataclass(frozen=True)
class ArchWork:
    """The work of one layer on one microbatch, per tensor-parallel rank unless a field says otherwise."""

    fwd_flops: float
    """Forward FLOPs."""
    fwd_bytes: float
    """HBM bytes the forward moves: weights read, activations read and written."""
    dgrad_flops: float
    """Backward FLOPs for the input gradient (activation gradients)."""
    dgrad_bytes: float
    wgrad_flops: float
    """Backward FLOPs for the weight gradient (0 for weightless parts)."""
    wgrad_bytes: float
    saved_activation_bytes: float
    """Bytes the forward keeps alive for the backward (no recomputation)."""
    boundary_bytes: float
    """Bytes of the layer's output tensor, what a pipeline stage sends on; full, not split by TP."""
    tp_comm_bytes: float
    """Payload bytes of the tensor-parallel all-reduces in one forward (the backward has the same);
    0 when ``tp_degree == 1``."""


_NO_WORK = ArchWork(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
_ONE_TOKEN = Microbatch(image_tokens=1, text_tokens=1)


def estimate_arch_work(
    kind: str, dims: Mapping[str, object], mb: Microbatch, *, dtype_bytes: int, tp_degree: int = 1
) -> ArchWork:
    """The work of one layer of ``kind`` with ``dims`` on microbatch ``mb`` (``dims`` validated already).

    >>> work = estimate_arch_work("dense_block", {"hidden": 64, "heads": 4, "ffn": 128},
    ...                           Microbatch(image_tokens=0, text_tokens=16), dtype_bytes=2)
    >>> work.wgrad_flops == 2 * 16 * (4 * 64 * 64 + 3 * 64 * 128)
    True
    """
    tokens = mb.image_tokens if kind in IMAGE_STREAM_KINDS else mb.text_tokens
    if tokens == 0:
        return _NO_WORK
    layer = build_layer(kind, resolve_dims(kind, dims), mb, tp_degree)
    saved_elems: dict[str, float] = {}
    for piece in layer.pieces:
        for name, elems in piece.saved:
            saved_elems.setdefault(name, elems)
    pieces = layer.pieces
    return ArchWork(
        fwd_flops=sum(p.fwd_flops for p in pieces),
        fwd_bytes=dtype_bytes * sum(p.fwd_elems for p in pieces),
        dgrad_flops=sum(p.dgrad_flops for p in pieces),
        dgrad_bytes=dtype_bytes * sum(p.dgrad_elems for p in pieces),
        wgrad_flops=sum(p.wgrad_flops for p in pieces),
        wgrad_bytes=dtype_bytes * sum(p.wgrad_elems for p in pieces),
        saved_activation_bytes=dtype_bytes * sum(saved_elems.values()),
        boundary_bytes=float(dtype_bytes * layer.boundary_elems),
        tp_comm_bytes=dtype_bytes * sum(p.comm_elems for p in pieces),
    )


def param_count(kind: str, dims: Mapping[str, object]) -> int:
    """Parameters of one full layer (not split by tensor parallelism; every MoE expert counted)."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return sum(p.params for p in layer.pieces)


def activated_param_count(kind: str, dims: Mapping[str, object]) -> int:
    """Parameters one token touches: for ``moe_block`` the shared and ``top_k`` routed experts, the
    router and the attention; for every other kind the same as :func:`param_count`."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return sum(p.active_params for p in layer.pieces)


def validate_tensor_parallel_degree(model: Model, tp_degree: int) -> None:
    """One-line :class:`MpipeError` unless every architecture layer of ``model`` splits evenly over
    ``tp_degree`` ranks (:func:`~mpipe_tune.cost.arch_dims.tensor_parallel_problem`)."""
    for index, layer in enumerate(model.layers):
        if isinstance(layer.cost, ArchCost):
            kind = layer.cost.kind
            problem = tensor_parallel_problem(kind, resolve_dims(kind, layer.cost.dims_dict()), tp_degree)
            if problem is not None:
                rule, why = problem
                raise MpipeError(f"tensor-parallel degree {tp_degree} {rule} of layer {index} ('{layer.name}', {kind}) "
                                 f"of model '{model.name}'{why}; choose a degree that divides it")


def tensor_parallel_fits(model: Model, tp_degree: int) -> bool:
    """Whether every architecture layer of ``model`` splits evenly over ``tp_degree`` ranks
    (explicit-cost layers always do)."""
    try:
        validate_tensor_parallel_degree(model, tp_degree)
    except MpipeError:
        return False
    return True
