"""The kernels a layer is made of, each costed for one tensor-parallel rank.

A :class:`Piece` is one kernel (a matmul, the attention core, a pointwise op, a lookup, a collective)
with its forward, input-gradient and weight-gradient work. Sizes are in *elements*; the caller turns
them into bytes with the dtype. The rules, shared by every kind:

- matmul ``[tokens, in] x [in, out]``: forward ``2*tokens*in*out`` FLOPs; the input gradient and the
  weight gradient each cost the same again. The forward reads the weights and the input and writes
  the output; the input-gradient pass reads the weights and the output gradient and writes the input
  gradient; the weight-gradient pass reads the saved input and the output gradient and writes the
  weight gradient. It keeps its input for the backward.
- attention core (scores and values, weightless): a fused (flash-attention style) kernel that never
  writes the score matrix to memory. It reads q, k, v, writes the output, keeps all four for the
  backward, and its backward costs twice its forward FLOPs, all of it input gradient.
- pointwise (norms, activations, residual adds, softmax, token permutes): reads its inputs, writes its
  output; the backward costs twice the forward FLOPs, reads what it kept and the output gradient and
  writes the input gradient. Norm weights are tiny; their gradients are counted with the input
  gradient, as fused norm kernels produce both at once.
- lookup (embedding rows): no FLOPs forward; the backward scatter-adds the output gradient into the
  rows, one FLOP per element, counted as weight gradient.

Tensor parallelism follows Megatron-LM: a ``column`` matmul splits its output features over the ranks,
a ``row`` matmul its input features (its output is a partial sum that an all-reduce completes), and a
``replicated`` one runs whole on every rank.

- all-to-all (expert parallelism's token exchange): no FLOPs; the buffer each rank sends from, of
  which ``(ep-1)/ep`` leaves the rank (see :func:`all_to_all`).

Each piece also says how many kernels each pass launches (``kernels``: forward, input gradient, weight
gradient, as an eager framework runs them; ``fused_kernels`` where fused kernels launch fewer), its family
(:attr:`Piece.family`: ``gemm``, ``attention``, ``memory`` or ``comm``) and its shape: a matmul's
``gemm_shape`` (rows, output features, input features per rank and per GEMM), the attention core's
``seq_lens``; a memory-bound kernel's size is its bytes over its kernels. The host issues every kernel
(:mod:`mpipe_tune.cost._kernel_passes` counts and times them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Split = Literal["column", "row", "replicated"]


def maximum(a, b):
    """The larger of ``a`` and ``b``, elementwise where either is an array (a microbatch array's
    entries, :class:`~mpipe_tune.cost._arch.MicrobatchArray`); scalars stay Python scalars."""
    return max(a, b) if np.isscalar(a) and np.isscalar(b) else np.maximum(a, b)


def minimum(a, b):
    """The smaller of ``a`` and ``b``, elementwise where either is an array (as :func:`maximum`)."""
    return min(a, b) if np.isscalar(a) and np.isscalar(b) else np.minimum(a, b)


@dataclass(frozen=True)
class Piece:
    """One kernel of one layer on one microbatch, per tensor-parallel rank (sizes in elements)."""

    fwd_flops: float = 0.0
    fwd_elems: float = 0.0
    """Elements read and written by the forward (weights and activations)."""
    dgrad_flops: float = 0.0
    dgrad_elems: float = 0.0
    wgrad_flops: float = 0.0
    wgrad_elems: float = 0.0
    saved: tuple[tuple[str, float], ...] = ()
    """(tensor name, elements) kept for the backward; a name shared by two pieces is one tensor."""
    comm_elems: float = 0.0
    """Elements all-reduced over the tensor-parallel group in the forward."""
    all_to_all_elems: float = 0.0
    """Elements of the buffer each rank exchanges in one expert-parallel all-to-all in the forward
    (the backward runs the same exchange for the gradient)."""
    attention_core: bool = False
    """The attention core: what selective recomputation re-runs before the backward."""
    ring_step_elems: float = 0.0
    """Ring attention (context parallelism): elements one rank sends in each forward ring step."""
    ring_steps: int = 0
    """Ring attention: forward ring steps that exchange keys and values (``cp - 1``)."""
    outputs: tuple[str, ...] = ()
    """Names among ``saved`` that this piece produces (a re-run of it regenerates them)."""
    params: int = 0
    """Parameters this piece owns in the full layer (not split by tensor parallelism, every expert)."""
    active_params: int = 0
    """Parameters one token touches in the full layer (for MoE experts: its top-k, not all)."""
    expert_params: int = 0
    """Of ``params``, those of routed experts: what expert parallelism divides over its ranks."""
    linear: bool = False
    """A matmul of a linear layer: the only kind of kernel an fp8 step runs in fp8 (Transformer Engine's
    mixed precision; attention cores, norms and pointwise kernels stay in bf16)."""
    wgrad_grad_elems: float = 0.0
    """Elements of the output gradient the weight-gradient pass reads: what a split backward keeps from
    its input-gradient event until its weight-gradient event."""
    kernels: tuple = (0.0, 0.0, 0.0)
    """Kernels the (forward, input-gradient, weight-gradient) passes launch in an eager framework."""
    fused_kernels: tuple | None = None
    """The same with fused kernels (fused norms and activations, grouped expert GEMMs); None: as ``kernels``."""
    gemm_shape: tuple | None = None
    """A matmul's forward GEMM (rows, output features, input features) per rank and per weight copy."""
    seq_lens: tuple = ()
    """The attention core's sequence lengths (per rank's share of the queries), whose FLOPs go as their squares."""
    head_dim: float = 0.0
    """The attention core's query-key head dimension: the reduction of its scores matmul (0: not an attention core)."""
    param_tensors: float = 0.0
    """Parameter tensors this piece owns in the full layer (what a per-tensor optimizer step launches per)."""
    eager_traffic: tuple | None = None
    """The (forward, input-gradient, weight-gradient) traffic of the eager kernels where it exceeds what
    ``*_elems`` count (those are a fused kernel's reads and writes): per pass, (elements in the step's dtype,
    fp32 elements), as an eager norm that computes in fp32 moves them (:meth:`bytes_moved`); None: the same."""
    group_collectives: tuple["Collective", ...] = ()
    """Collectives of the forward over groups other than the tensor-parallel all-reduce's and the
    expert-parallel all-to-all's (a MoE dispatcher's gathers and its exchange of token counts,
    :mod:`mpipe_tune.cost._moe`); the backward runs each one's mirror on the gradients, at the same cost, but for
    the forward-only ones (:attr:`Collective.forward_only`)."""
    index: bool = False
    """A data-dependent index kernel (a MoE dispatcher's token gathers, sorts and scatter-adds): timed at the
    profile's ``kernel_efficiency.index`` curve where it gives one, else as any memory-bound kernel."""

    @property
    def family(self) -> str:
        """The kernel family whose efficiency curve times it: ``gemm``, ``attention``, ``comm`` or ``memory``."""
        if self.linear:
            return "gemm"
        if self.attention_core:
            return "attention"
        if np.any(self.comm_elems) or np.any(self.all_to_all_elems) or self.group_collectives:
            return "comm"
        return "memory"

    def kernels_of(self, fused: bool) -> tuple:
        """Kernels per pass, fused or eager."""
        return self.fused_kernels if fused and self.fused_kernels is not None else self.kernels

    def bytes_moved(self, index: int, dtype_bytes: int, eager: bool):
        """Bytes pass ``index`` (0 forward, 1 input gradient, 2 weight gradient) reads and writes, fused or
        ``eager`` (:attr:`eager_traffic` where the piece gives it)."""
        if eager and self.eager_traffic is not None:
            in_dtype, in_fp32 = self.eager_traffic[index]
            return dtype_bytes * in_dtype + 4 * in_fp32
        return dtype_bytes * (self.fwd_elems, self.dgrad_elems, self.wgrad_elems)[index]


@dataclass(frozen=True)
class Collective:
    """One collective of a forward: ``kind`` (a :data:`~mpipe_tune.cost._profile.COLLECTIVES` name) over
    ``group`` ranks lying within ``span`` consecutive devices, on ``elems`` elements as
    :func:`~mpipe_tune.cost._profile.estimate_collective_s` takes its size (the gathered buffer of an
    all-gather; a reduce-scatter costs the same on the same buffer, and is written as one). The backward runs its
    mirror on the gradients unless it is ``forward_only`` (an exchange of metadata, such as a MoE dispatcher's
    per-expert token counts, that has no gradient)."""

    kind: str
    group: int
    span: int
    elems: float
    forward_only: bool = False


def matmul(
    input_name: str,
    tokens: float,
    in_features: int,
    out_features: int,
    *,
    split: Split,
    tp_degree: int,
    bias: bool = False,
    copies: int = 1,
    copies_read: float = 1.0,
    copies_per_token: int = 1,
    routed: bool = False,
    input_shards: int = 1,
) -> Piece:
    """A linear layer applied to ``tokens`` rows of ``input_name``.

    ``copies`` weight matrices exist (MoE experts); the forward reads ``copies_read`` of them (those its
    tokens are routed to) and each token uses ``copies_per_token``. ``tokens`` counts rows over all
    copies (for routed experts: tokens times top-k). ``routed``: the copies are routed experts, whose
    parameters expert parallelism divides (``copies`` counts all of them, held on any rank).
    ``input_shards``: the saved input is ``1/input_shards`` of the rows (sequence parallelism keeps
    the sequence-sharded input and gathers it again in the backward, as Megatron-LM does).
    """
    in_rank, out_rank = in_features, out_features
    if split == "column":
        out_rank = out_features / tp_degree
    elif split == "row":
        in_rank = in_features / tp_degree
    weights_per_copy = in_features * out_features + (out_features if bias else 0)
    weight_rank_elems = copies_read * (in_rank * out_rank + (out_rank if bias else 0))
    flops = 2.0 * tokens * in_rank * out_rank
    input_elems = tokens * in_rank
    output_elems = tokens * out_rank
    gemms = copies_read  # one GEMM per weight copy its tokens hit (eager); a grouped GEMM when fused
    bias_grads = gemms if bias else 0.0  # the bias gradient's reduction
    accumulate = gemms  # eager: the weight gradient added into the accumulated one (fused into the GEMM when fused)
    return Piece(
        fwd_flops=flops,
        fwd_elems=weight_rank_elems + input_elems + output_elems,
        dgrad_flops=flops,
        dgrad_elems=weight_rank_elems + output_elems + input_elems,
        wgrad_flops=flops,
        wgrad_elems=input_elems + output_elems + weight_rank_elems,
        saved=((input_name, input_elems / input_shards),),
        params=copies * weights_per_copy,
        active_params=copies_per_token * weights_per_copy,
        expert_params=copies * weights_per_copy if routed else 0,
        linear=True,
        wgrad_grad_elems=output_elems,
        kernels=(gemms, gemms, gemms + bias_grads + accumulate),
        fused_kernels=(1.0, 1.0, 2.0 if bias else 1.0),
        gemm_shape=(tokens / maximum(copies_read, 1e-9), out_rank, in_rank),
        param_tensors=copies * (2 if bias else 1),
    )


def attention(
    seq_lens: Sequence[int],
    *,
    heads: float,
    kv_heads: float,
    qk_head_dim: int,
    v_head_dim: int,
    names: tuple[str, str, str, str] = ("q", "k", "v", "attn_out"),
    context_degree: int = 1,
) -> Piece:
    """Attention scores and values over independent sequences of ``seq_lens`` tokens.

    ``heads`` and ``kv_heads`` are per rank. Every sequence is charged its full square of scores:
    bidirectional attention needs it, and for causal attention this is the convention of Megatron-LM's
    FLOPs formula (a causal kernel skips about half, which the calibrated efficiency absorbs).

    With ``context_degree`` ``c > 1`` (ring attention, context parallelism) each rank holds ``1/c`` of
    every sequence's queries, keys and values and meets all the keys over ``c`` ring steps: ``1/c`` of
    the FLOPs, its own q, k, v and output as elements and saved tensors, and every other rank's k and v
    read once more as they pass (the exchange itself is :func:`ring_exchange_elems`).
    """
    c = context_degree
    tokens = sum(seq_lens) / c
    flops = sum(2.0 * s * s * heads * (qk_head_dim + v_head_dim) for s in seq_lens) / c
    q_elems = tokens * heads * qk_head_dim
    k_elems = tokens * kv_heads * qk_head_dim
    v_elems = tokens * kv_heads * v_head_dim
    out_elems = tokens * heads * v_head_dim
    qkv_elems = q_elems + k_elems + v_elems
    ring_elems = (c - 1) * (k_elems + v_elems)  # the other ranks' k and v, read as they arrive
    step_elems = ring_exchange_elems(seq_lens, kv_heads=kv_heads, qk_head_dim=qk_head_dim, v_head_dim=v_head_dim,
                                     context_degree=c) if c > 1 else 0.0
    q_name, k_name, v_name, out_name = names
    return Piece(
        fwd_flops=flops,
        fwd_elems=qkv_elems + out_elems + ring_elems,
        dgrad_flops=2.0 * flops,
        dgrad_elems=qkv_elems + 2.0 * out_elems + qkv_elems + 2.0 * ring_elems,  # read q,k,v,o,do; write dq,dk,dv
        saved=((q_name, q_elems), (k_name, k_elems), (v_name, v_elems), (out_name, out_elems)),
        attention_core=True,
        outputs=(out_name,),
        ring_step_elems=step_elems,
        ring_steps=c - 1,
        kernels=(1.0, ATTENTION_BWD_KERNELS, 0.0),
        seq_lens=tuple(s / c for s in seq_lens),
        head_dim=qk_head_dim,
    )


ATTENTION_BWD_KERNELS = 3.0
"""Kernels of a flash-attention backward: the preprocessing of ``rowsum(dO * O)``, the main kernel and the
conversion of the accumulated dQ (FlashAttention-2's ``_flash_attn_backward``)."""


def ring_exchange_elems(seq_lens: Sequence[int], *, kv_heads: float, qk_head_dim: int, v_head_dim: int,
                        context_degree: int) -> float:
    """Elements one rank sends in each of the ``c - 1`` forward ring steps of ring attention over
    ``c = context_degree`` ranks: its current ``1/c`` share of every sequence's k and v (``kv_heads`` per
    rank). The backward's steps each pass k, v and the accumulating dk, dv: twice this.

    >>> ring_exchange_elems([1024], kv_heads=2, qk_head_dim=64, v_head_dim=64, context_degree=4)
    65536.0
    """
    return sum(seq_lens) / context_degree * kv_heads * (qk_head_dim + v_head_dim)


def pointwise(
    read_elems: float,
    write_elems: float,
    flops: float,
    *,
    saved: tuple[tuple[str, float], ...] = (),
    params: int = 0,
    kernels: tuple = (1.0, 1.0, 0.0),
    fused_kernels: tuple | None = None,
    param_tensors: float = 0.0,
) -> Piece:
    """An elementwise or row-wise kernel (its few weights, e.g. a norm's gain, are in ``params``):
    ``kernels`` per pass eager, ``fused_kernels`` fused (None: the same)."""
    saved_elems = sum(elems for _, elems in saved)
    return Piece(
        fwd_flops=flops,
        fwd_elems=read_elems + write_elems + params,
        dgrad_flops=2.0 * flops,
        dgrad_elems=saved_elems + write_elems + read_elems + 2 * params,
        saved=saved,
        params=params,
        active_params=params,
        kernels=kernels,
        fused_kernels=fused_kernels,
        param_tensors=param_tensors,
    )


def lookup(tokens: float, rows: int, width: int, *, tp_degree: int) -> Piece:
    """Embedding lookup of ``tokens`` rows from a ``rows x width`` table split by rows over the ranks."""
    rows_read = minimum(tokens, rows) / tp_degree
    output_elems = tokens * width
    return Piece(
        fwd_elems=rows_read * width + output_elems,
        wgrad_flops=tokens * width / tp_degree,
        wgrad_elems=output_elems + 2.0 * rows_read * width,  # read the output gradient, add into the rows
        params=rows * width,
        active_params=rows * width,
        wgrad_grad_elems=output_elems,
        kernels=(1.0 + (VOCAB_MASK_KERNELS if tp_degree > 1 else 0.0), 0.0, EMBEDDING_BWD_KERNELS),
        param_tensors=1,
    )


VOCAB_MASK_KERNELS = 5.0
"""A vocab-parallel lookup's masking of the token ids outside the rank's rows (Megatron-LM's
``VocabParallelEmbedding.forward``: two comparisons, their ``or``, the shift and the zeroing of those rows)."""
EMBEDDING_BWD_KERNELS = 3.0
"""Kernels of an embedding's weight gradient (torch's ``embedding_dense_backward``: sort the ids, count, scatter-add)."""


def all_reduce(elems: float, *, tp_degree: int) -> Piece:
    """A tensor-parallel all-reduce of ``elems`` elements (nothing when there is one rank)."""
    return Piece(comm_elems=elems if tp_degree > 1 else 0.0, kernels=(1.0, 1.0, 0.0) if tp_degree > 1 else (0.0,) * 3)


def all_to_all(elems: float, *, ep_degree: int) -> Piece:
    """An expert-parallel all-to-all of a ``elems``-element buffer per rank (nothing with one rank):
    ``(ep-1)/ep`` of it leaves the rank, ``1/ep`` to each other rank of the group."""
    return Piece(all_to_all_elems=elems if ep_degree > 1 else 0.0,
                 kernels=(1.0, 1.0, 0.0) if ep_degree > 1 else (0.0,) * 3)


@dataclass(frozen=True)
class Layer:
    """The pieces of one layer and the elements of its output tensor (full, not split)."""

    pieces: tuple[Piece, ...]
    boundary_elems: float
