"""Layer costs from architecture: FLOPs, HBM bytes, saved activations and parameters of one layer.

A model spec layer with an architecture ``kind`` (see :data:`ARCH_KINDS`) and its dimensions becomes,
for one microbatch, an :class:`ArchWork`: the work of its forward, input-gradient and weight-gradient
passes, the activations the forward keeps for the backward, the size of the tensor it hands to the
next pipeline stage, and its tensor-parallel traffic. The roofline in :mod:`mpipe_tune.cost` turns
FLOPs and bytes into seconds with a hardware profile; nothing here knows a device.

Assumptions (details in :mod:`~mpipe_tune.cost._arch_pieces` and :mod:`~mpipe_tune.cost._arch_layers`):

- FLOPs count matmuls (``2*m*n*k``), attention scores and values, and a few FLOPs per element for
  norms, activations and softmax. Backward: each matmul's input gradient and weight gradient cost
  its forward once each; the weightless attention core costs twice its forward, all input gradient.
  Causal attention is charged the full square of scores, as in Megatron-LM's FLOPs formula.
- Bytes are HBM traffic: each kernel reads its weights and inputs and writes its output once
  (attention is a fused kernel that keeps scores on chip). Weights and activations are
  ``dtype_bytes`` wide, as are gradients; optimizer traffic is not a layer's.
- Saved activations are every tensor some kernel needs in its backward, without recomputation, each
  counted once per rank (norms and residuals are not split over tensor-parallel ranks).
- The linear layers' matmuls are counted apart (``linear_*_flops``): an fp8 step runs only those at the
  fp8 peak, as Transformer Engine does; the attention core's FLOPs are counted apart too.
- Tensor parallelism is Megatron-LM's column/row split of matmuls and attention heads, one
  all-reduce after each row-split output (two per transformer block) and a vocab-parallel embedding
  and loss. RoPE rotates q and k in every decoder block, as separate kernels or one fused kernel
  (:func:`~mpipe_tune.cost._arch_layers.rotary_embedding`). The loss runs in fp32 whatever the step's dtype, in the passes over the logits that
  Megatron-LM's ``vocab_parallel_cross_entropy`` makes (:func:`~mpipe_tune.cost._arch_layers.vocab_parallel_loss`).
- Expert parallelism divides a MoE layer's routed experts over ``ep`` ranks and adds a dispatch and a
  combine all-to-all per forward (and per backward), each of ``tokens * top_k * hidden`` elements per
  rank (:mod:`~mpipe_tune.cost._arch_layers` states the routing).
- Context parallelism (ring attention over ``cp`` ranks) gives each rank ``1/cp`` of a decoder's
  sequence: ``1/cp`` of every token's work and activations, and of the attention FLOPs, with the
  keys and values passed round the ring in ``cp - 1`` steps forward (each rank sends its share of k
  and v per step) and ``cp - 1`` backward (k, v and the accumulating dk, dv: twice the bytes).
  Image-stream layers are not split: the encoder runs whole on every context-parallel rank.
- Sequence parallelism with tp (Megatron-LM's) keeps the tensors outside the tensor-parallel regions
  (the layer's input and output, norms, residual adds, the norms' outputs the next matmuls save)
  at ``1/tp`` of the tokens per rank; its reduce-scatter and all-gather replace each all-reduce and
  move the same bytes over the same ring, so the all-reduce's time is what is charged.
- Selective recomputation re-runs the attention core before the backward and drops what only the
  core's own output held. The core is a fused kernel that saves no score matrix, and its output is
  also the output projection's saved input, so here it frees nothing: with fused (flash) attention
  the backend already rematerialises the attention internals, as NVIDIA's Megatron Bridge guide on
  activation recomputation notes (compare ``core_attn`` against no recomputation there).
- Image-stream kinds (:data:`IMAGE_STREAM_KINDS`) see ``image_tokens * merge_factor`` ViT patches
  with attention inside each image; every other kind sees one causal sequence of ``text_tokens``.
  A layer whose stream has no tokens in the microbatch does no work.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from mpipe_tune.algebra import ArchCost, Model
from mpipe_tune.inputs import (
    ARCH_KINDS, IMAGE_STREAM_KINDS, OPTIONAL_DIMS, resolve_dims, tensor_parallel_problem, validate_arch,
)
from mpipe_tune.cost._arch_layers import LayerDegrees, build_layer
from mpipe_tune.cost._arch_pieces import Collective, Layer
from mpipe_tune.cost._moe import MoeSettings
from mpipe_tune.inputs import Microbatch
from mpipe_tune.errors import MpipeError

__all__ = [
    "ARCH_KINDS",
    "IMAGE_STREAM_KINDS",
    "OPTIONAL_DIMS",
    "ArchWork",
    "MicrobatchArray",
    "activated_param_count",
    "ParallelTraffic",
    "estimate_arch_work",
    "estimate_parallel_traffic",
    "expert_param_count",
    "expert_parallel_fits",
    "expert_tensor_count",
    "model_param_count",
    "validate_expert_parallel_degree",
    "estimate_layer",
    "param_count",
    "param_tensor_count",
    "tensor_parallel_fits",
    "validate_tensor_parallel_degree",
    "validate_arch",
]


@dataclass(frozen=True)
class ArchWork:
    """The work of one layer on one microbatch, per tensor-parallel rank unless a field says otherwise."""

    fwd_flops: float
    """Forward FLOPs (of the rank's share of the microbatch: ``1/cp`` of a decoder's sequence)."""
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
    """Bytes of the layer's output tensor, what a pipeline stage sends on; not split by TP (but by
    sequence parallelism, and by context parallelism as every rank's tokens are)."""
    tp_comm_bytes: float
    """Payload bytes of the tensor-parallel all-reduces in one forward (the backward has the same);
    0 when ``tp_degree == 1``."""
    attention_core_fwd_flops: float = 0.0
    """Forward FLOPs of the attention core: what selective recomputation re-runs."""
    attention_core_fwd_bytes: float = 0.0
    attention_core_dgrad_flops: float = 0.0
    """Backward FLOPs of the attention core (what its ring steps overlap with under context parallelism)."""
    attention_core_dgrad_bytes: float = 0.0
    selective_saved_activation_bytes: float = 0.0
    """Bytes the forward keeps for the backward under selective recomputation (the attention core's
    own outputs dropped unless another kernel keeps them)."""
    linear_fwd_flops: float = 0.0
    """Of ``fwd_flops``, the linear layers' matmuls (what an fp8 step runs at the fp8 peak)."""
    linear_dgrad_flops: float = 0.0
    linear_wgrad_flops: float = 0.0
    wgrad_grad_bytes: float = 0.0
    """Bytes of the output gradients the weight-gradient pass reads (its matmuls' and lookups'): what a
    split backward (the zero-bubble skeletons) keeps from its input-gradient to its weight-gradient event."""
    memory_bound_fwd_flops: float = 0.0
    """Of ``fwd_flops``, those of the memory-bound kernels: every kernel but the linear layers' matmuls and
    the attention core (norms, activations, residual adds, softmax, token permutes, embedding lookups)."""
    memory_bound_fwd_bytes: float = 0.0
    """Of ``fwd_bytes``, those the memory-bound kernels move."""
    memory_bound_dgrad_flops: float = 0.0
    memory_bound_dgrad_bytes: float = 0.0
    memory_bound_wgrad_flops: float = 0.0
    memory_bound_wgrad_bytes: float = 0.0


_NO_WORK = ArchWork(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, eq=False)
class MicrobatchArray:
    """Several microbatches at once, one array entry each: what :func:`estimate_arch_work`,
    :func:`estimate_parallel_traffic` and the layer builders take in place of one :class:`Microbatch`
    to cost a layer on all of them with the same arithmetic, elementwise (a layer table's row in one
    pass rather than one call per microbatch). :func:`estimate_arch_work` zeroes the entries without tokens
    of the layer's stream (one :class:`Microbatch` without them does no work); whoever times the traffic of
    :func:`estimate_parallel_traffic` zeroes them there.

    >>> batch = MicrobatchArray.of([Microbatch(10, 8, (4, 6)), Microbatch(0, 5)])
    >>> [c.tolist() for c in batch.image_sizes()], batch.num_images.tolist()
    ([[4, 0], [6, 0]], [2, 0])
    """

    image_tokens: np.ndarray
    text_tokens: np.ndarray
    image_columns: tuple[np.ndarray, ...]
    """Per image slot, each microbatch's tokens of its image there (0 past its last image)."""
    num_images: np.ndarray
    text_columns: tuple[np.ndarray, ...] = ()
    """Per text-sequence slot, each microbatch's tokens of its sequence there (0 past its last)."""

    @classmethod
    def of(cls, microbatches: Sequence[Microbatch]) -> MicrobatchArray:
        sizes = [mb.image_sizes() for mb in microbatches]
        return cls(np.array([mb.image_tokens for mb in microbatches], dtype=np.int64),
                   np.array([mb.text_tokens for mb in microbatches], dtype=np.int64), _slots(sizes),
                   np.array([len(s) for s in sizes], dtype=np.int64),
                   _slots([mb.text_sizes() for mb in microbatches]))

    def image_sizes(self) -> tuple[np.ndarray, ...]:
        """As :meth:`Microbatch.image_sizes`, by image slot: the attention builders sum over them."""
        return self.image_columns

    def text_sizes(self) -> tuple[np.ndarray, ...]:
        """As :meth:`Microbatch.text_sizes`, by sequence slot."""
        return self.text_columns


def _slots(sizes: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, ...]:
    """Per slot, each entry's size there (0 past its last): the columns of a ragged list (filled in one
    scatter: a table's joined batch holds hundreds of entries, each costed by every layer kind).

    >>> [c.tolist() for c in _slots([(4, 6), (), (5,)])]
    [[4, 0, 5], [6, 0, 0]]
    """
    lengths = np.fromiter(map(len, sizes), dtype=np.int64, count=len(sizes))
    columns = np.zeros((int(lengths.max(initial=0)), len(sizes)), dtype=np.int64)
    if columns.size:
        flat = np.fromiter(itertools.chain.from_iterable(sizes), dtype=np.int64, count=int(lengths.sum()))
        slot = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        columns[slot, np.repeat(np.arange(len(sizes)), lengths)] = flat
    return tuple(columns)


def stream_tokens(kind: str, mb: Microbatch | MicrobatchArray):
    """The tokens of ``kind``'s stream in ``mb``: its image tokens for an image-stream kind, else its text."""
    return mb.image_tokens if kind in IMAGE_STREAM_KINDS else mb.text_tokens


@dataclass(frozen=True)
class ParallelTraffic:
    """The expert- and context-parallel collectives of one layer on one microbatch, per rank (none by
    default)."""

    all_to_all_bytes: tuple[float, ...] = ()
    """Per expert-parallel all-to-all of one forward (dispatch, combine), the bytes of the buffer each
    rank exchanges, ``(ep-1)/ep`` of which leaves it; the backward runs as many of the same size.
    Empty when ``ep_degree == 1`` or the layer routes nothing."""
    ring_step_bytes: float = 0.0
    """Ring attention: bytes one rank sends to the next in each forward step (its share of k and v);
    each backward step sends twice this (k, v and the partial dk, dv)."""
    ring_steps: int = 0
    """Ring attention: steps that exchange, ``cp - 1`` forward and as many backward (0 without)."""
    group_collectives: tuple[Collective, ...] = ()
    """The forward's other collectives (a MoE dispatcher's gathers and its exchange of token counts), their sizes
    in bytes; the backward runs the same but for the forward-only ones (:attr:`Collective.forward_only`)."""


_NO_TRAFFIC = ParallelTraffic()
_ONE_TOKEN = Microbatch(image_tokens=1, text_tokens=1)


def estimate_arch_work(
    kind: str, dims: Mapping[str, object], mb: Microbatch | MicrobatchArray, *, dtype_bytes: int, tp_degree: int = 1,
    ep_degree: int = 1, moe_imbalance: float = 1.0, cp_degree: int = 1, sequence_parallel: bool = False,
    fused_loss: bool = False, rope: str = "fused", moe: MoeSettings = MoeSettings(),
) -> ArchWork:
    """The work of one layer of ``kind`` with ``dims`` on microbatch ``mb`` (``dims`` validated already),
    on one rank of ``tp_degree`` tensor-parallel, ``ep_degree`` expert-parallel and ``cp_degree``
    context-parallel ranks (``moe_imbalance``, ``sequence_parallel``, ``moe``: see
    :class:`~mpipe_tune.cost._arch_layers.LayerDegrees`; ``fused_loss``: the trainer's fused loss kernels,
    :func:`~mpipe_tune.cost._arch_layers.vocab_parallel_loss`; ``rope``: how it runs RoPE,
    :func:`~mpipe_tune.cost._arch_layers.rotary_embedding`).

    >>> work = estimate_arch_work("dense_block", {"hidden": 64, "heads": 4, "ffn": 128},
    ...                           Microbatch(image_tokens=0, text_tokens=16), dtype_bytes=2)
    >>> work.wgrad_flops == 2 * 16 * (4 * 64 * 64 + 3 * 64 * 128)
    True
    """
    return estimate_layer(kind, dims, mb, dtype_bytes=dtype_bytes, tp_degree=tp_degree, ep_degree=ep_degree,
                          moe_imbalance=moe_imbalance, cp_degree=cp_degree, sequence_parallel=sequence_parallel,
                          fused_loss=fused_loss, rope=rope, moe=moe)[0]


def estimate_layer(
    kind: str, dims: Mapping[str, object], mb: Microbatch | MicrobatchArray, *, dtype_bytes: int, tp_degree: int = 1,
    ep_degree: int = 1, moe_imbalance: float = 1.0, cp_degree: int = 1, sequence_parallel: bool = False,
    fused_loss: bool = False, rope: str = "fused", moe: MoeSettings = MoeSettings(),
) -> tuple[ArchWork, Layer | None]:
    """:func:`estimate_arch_work` and the layer's kernels it sums (None for one microbatch without tokens of
    the layer's stream; an array's entries without them are zeroed in the work, not in the kernels)."""
    vector = isinstance(mb, MicrobatchArray)
    if not vector and stream_tokens(kind, mb) == 0:
        return _NO_WORK, None
    layer = _build(kind, dims, mb, LayerDegrees(tp_degree, ep_degree, moe_imbalance, cp_degree, sequence_parallel, moe),
                   dtype_bytes, fused_loss, rope)
    saved_elems: dict[str, float] = {}
    selective_elems: dict[str, float] = {}
    for piece in layer.pieces:
        for name, elems in piece.saved:
            saved_elems.setdefault(name, elems)
            if not (piece.attention_core and name in piece.outputs):
                selective_elems.setdefault(name, elems)
    pieces = layer.pieces
    cores = [p for p in pieces if p.attention_core]
    linears = [p for p in pieces if p.linear]
    streamed = _passes([p for p in pieces if not (p.linear or p.attention_core)], dtype_bytes)
    whole = _passes(pieces, dtype_bytes)
    work = ArchWork(
        **whole,
        saved_activation_bytes=dtype_bytes * sum(saved_elems.values()),
        boundary_bytes=dtype_bytes * layer.boundary_elems if vector else float(dtype_bytes * layer.boundary_elems),
        tp_comm_bytes=dtype_bytes * sum(p.comm_elems for p in pieces),
        attention_core_fwd_flops=sum(p.fwd_flops for p in cores),
        attention_core_fwd_bytes=dtype_bytes * sum(p.fwd_elems for p in cores),
        attention_core_dgrad_flops=sum(p.dgrad_flops for p in cores),
        attention_core_dgrad_bytes=dtype_bytes * sum(p.dgrad_elems for p in cores),
        selective_saved_activation_bytes=dtype_bytes * sum(selective_elems.values()),
        linear_fwd_flops=sum(p.fwd_flops for p in linears),
        linear_dgrad_flops=sum(p.dgrad_flops for p in linears),
        linear_wgrad_flops=sum(p.wgrad_flops for p in linears),
        wgrad_grad_bytes=dtype_bytes * sum(p.wgrad_grad_elems for p in pieces),
        **{f"memory_bound_{name}": value for name, value in streamed.items()},
    )
    if not vector:
        return work, layer
    has_tokens = stream_tokens(kind, mb) > 0  # an entry without tokens does no work, as one microbatch
    return ArchWork(**{f.name: np.where(has_tokens, getattr(work, f.name), 0.0) for f in fields(ArchWork)}), layer


def _passes(pieces, dtype_bytes: int) -> dict[str, float]:
    """FLOPs and bytes of ``pieces``' forward, dgrad and wgrad, named as :class:`ArchWork`'s fields."""
    out = {}
    for phase in ("fwd", "dgrad", "wgrad"):
        out[f"{phase}_flops"] = sum(getattr(p, f"{phase}_flops") for p in pieces)
        out[f"{phase}_bytes"] = dtype_bytes * sum(getattr(p, f"{phase}_elems") for p in pieces)
    return out


def estimate_parallel_traffic(
    kind: str, dims: Mapping[str, object], mb: Microbatch | MicrobatchArray, *, dtype_bytes: int, tp_degree: int = 1,
    ep_degree: int = 1, moe_imbalance: float = 1.0, cp_degree: int = 1, sequence_parallel: bool = False,
    moe: MoeSettings = MoeSettings(),
) -> ParallelTraffic:
    """The expert- and context-parallel collectives of one layer (arguments as :func:`estimate_arch_work`'s).

    >>> dims = {"hidden": 64, "heads": 4, "experts": 8, "top_k": 2, "moe_ffn": 32}
    >>> traffic = estimate_parallel_traffic("moe_block", dims, Microbatch(0, 16), dtype_bytes=2, ep_degree=4)
    >>> traffic.all_to_all_bytes, [(c.kind, c.elems, c.forward_only) for c in traffic.group_collectives]
    ((4096.0, 4096.0), [('all_to_all', 64.0, True)])
    """
    if ep_degree == 1 and cp_degree == 1 and (tp_degree == 1 or kind != "moe_block"):
        return _NO_TRAFFIC
    if not isinstance(mb, MicrobatchArray) and stream_tokens(kind, mb) == 0:
        return _NO_TRAFFIC
    layer = _build(kind, dims, mb, LayerDegrees(tp_degree, ep_degree, moe_imbalance, cp_degree, sequence_parallel, moe),
                   dtype_bytes, False, "fused")  # the loss and RoPE have no expert- or context-parallel traffic
    rings = [p for p in layer.pieces if p.ring_steps > 0]
    return ParallelTraffic(
        all_to_all_bytes=tuple(dtype_bytes * p.all_to_all_elems for p in layer.pieces
                               if np.any(p.all_to_all_elems > 0)),
        group_collectives=tuple(replace(c, elems=dtype_bytes * c.elems) for p in layer.pieces
                                for c in p.group_collectives),
        ring_step_bytes=dtype_bytes * sum(p.ring_step_elems for p in rings),
        ring_steps=max((p.ring_steps for p in rings), default=0),
    )


def _build(kind: str, dims: Mapping[str, object], mb: Microbatch | MicrobatchArray, degrees: LayerDegrees,
           dtype_bytes: int, fused_loss: bool, rope: str):
    return build_layer(kind, resolve_dims(kind, dims), mb, degrees, dtype_bytes=dtype_bytes, fused_loss=fused_loss,
                       rope=rope)


def param_count(kind: str, dims: Mapping[str, object]) -> int:
    """Parameters of one full layer (not split by tensor parallelism; every MoE expert counted)."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return sum(p.params for p in layer.pieces)


def param_tensor_count(kind: str, dims: Mapping[str, object]) -> int:
    """Parameter tensors of one full layer (every expert's): what a per-tensor optimizer step launches over."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return int(sum(p.param_tensors for p in layer.pieces))


def model_param_count(model: Model) -> int:
    """Parameters of ``model``'s architecture layers, each counted once: their :func:`param_count`, less the table
    of a tied ``lm_head``, which is the embedding's (a stage holding the head alone keeps a copy of it, as
    Megatron-LM's pipeline does, so the per-layer counts that memory reads keep it)."""
    total = 0
    for layer in model.layers:
        if isinstance(layer.cost, ArchCost):
            dims = resolve_dims(layer.cost.kind, layer.cost.dims_dict())
            total += param_count(layer.cost.kind, dims)
            if layer.cost.kind == "lm_head" and dims["tied"]:
                total -= dims["hidden"] * dims["vocab"]
    return total


def expert_param_count(kind: str, dims: Mapping[str, object]) -> int:
    """Of :func:`param_count`, the routed experts' parameters (0 for every kind but ``moe_block``):
    what expert parallelism divides over its ranks."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return sum(p.expert_params for p in layer.pieces)


def expert_tensor_count(kind: str, dims: Mapping[str, object]) -> int:
    """Of :func:`param_tensor_count`, the routed experts' tensors (0 for every kind but ``moe_block``)."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return int(sum(p.param_tensors for p in layer.pieces if p.expert_params))


def activated_param_count(kind: str, dims: Mapping[str, object]) -> int:
    """Parameters one token touches: for ``moe_block`` the shared and ``top_k`` routed experts, the
    router and the attention; for every other kind the same as :func:`param_count`."""
    layer = build_layer(kind, resolve_dims(kind, dims), _ONE_TOKEN, 1)
    return sum(p.active_params for p in layer.pieces)


def validate_tensor_parallel_degree(model: Model, tp_degree: int) -> None:
    """One-line :class:`MpipeError` unless every architecture layer of ``model`` splits evenly over
    ``tp_degree`` ranks (:func:`~mpipe_tune.inputs._arch_dims.tensor_parallel_problem`)."""
    for index, layer in enumerate(model.layers):
        if isinstance(layer.cost, ArchCost):
            kind = layer.cost.kind
            problem = tensor_parallel_problem(kind, resolve_dims(kind, layer.cost.dims_dict()), tp_degree)
            if problem is not None:
                rule, why = problem
                raise MpipeError(f"tensor-parallel degree {tp_degree} {rule} of layer {index} ('{layer.name}', {kind}) "
                                 f"of model '{model.name}'{why}; choose a degree that divides it")


def validate_expert_parallel_degree(model: Model, ep_degree: int) -> None:
    """One-line :class:`MpipeError` unless ``ep_degree`` is 1, or ``model`` has MoE layers and
    ``ep_degree`` divides each one's routed experts (every expert-parallel rank holds as many)."""
    if ep_degree == 1:
        return
    moe = [(i, u) for i, u in enumerate(model.layers) if isinstance(u.cost, ArchCost) and u.cost.kind == "moe_block"]
    if not moe:
        raise MpipeError(f"expert-parallel degree {ep_degree} needs MoE layers, and model '{model.name}' has none; "
                         f"use expert-parallel degree 1")
    for index, layer in moe:
        experts = layer.cost.dims_dict()["experts"]
        if experts % ep_degree:
            raise MpipeError(f"expert-parallel degree {ep_degree} must divide the {experts} routed experts of layer "
                             f"{index} ('{layer.name}') of model '{model.name}'; choose a divisor of {experts}")


def expert_parallel_fits(model: Model, ep_degree: int) -> bool:
    """Whether :func:`validate_expert_parallel_degree` accepts ``ep_degree`` for ``model``."""
    try:
        validate_expert_parallel_degree(model, ep_degree)
    except MpipeError:
        return False
    return True


def tensor_parallel_fits(model: Model, tp_degree: int) -> bool:
    """Whether every architecture layer of ``model`` splits evenly over ``tp_degree`` ranks
    (explicit-cost layers always do)."""
    try:
        validate_tensor_parallel_degree(model, tp_degree)
    except MpipeError:
        return False
    return True
