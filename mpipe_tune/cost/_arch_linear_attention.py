"""Gated DeltaNet (``attention: gated_deltanet``): linear attention as the kernels it runs, per tensor-parallel rank.

Qwen3.5's and Qwen3-Next's linear-attention layers (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR 2025; the chunked kernels of flash-linear-attention's ``chunk_gated_delta_rule``,
which transformers and Megatron-LM call). A layer of ``heads`` value heads (one recurrent state of
``head_dim x value_head_dim`` each) and ``kv_heads`` query/key heads of width ``head_dim``:

- projections from the normed input: q and k (``2 * kv_heads * head_dim``), v and the output gate z (``heads *
  value_head_dim`` each), and per value head a write strength ``beta`` and a decay ``a`` (``2 * heads``);
- a causal depthwise convolution of ``conv_kernel`` taps over q, k and v, with SiLU;
- the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, per token and value head;
- the delta rule ``S_t = exp(g_t) S_(t-1) (I - beta_t k_t k_t^T) + beta_t k_t v_t^T``, ``o_t = S_t^T q_t``, run in
  chunks of :data:`CHUNK_TOKENS` tokens: q and k are L2-normed inside the kernels and repeated to the value heads;
  the forward launches the cumulative decay, ``beta K K^T`` in each chunk, its triangular inverse, the WY factors
  ``w`` and ``u``, the state recurrence over the chunks (writing each chunk's state) and the output. Its work is
  linear in the sequence: ``6 * dk * dv`` FLOPs a token and head for the state and output products, plus
  ``O(chunk)`` ones inside each chunk, against softmax attention's ``O(sequence)``;
- an RMSNorm of the output gated by ``silu(z)`` (weights ``value_head_dim``), and the output projection.

The backward (flash-linear-attention's ``chunk_gated_delta_rule_bwd``) recomputes ``w``, ``u`` and the chunk
states, then runs the gradients of the output, the states, q/k/w/g and the WY factors: twice the forward's
products plus the recomputation. It keeps q, k, v, g, beta and the chunk-local inverse ``A`` (``chunk`` values a
token and head), and one recurrent state per sequence and value head. The core kernels count as the attention
core (fused tensor-core kernels, what selective recomputation re-runs). With context parallelism each rank runs
the recurrence over its share of the sequence; the hand-off of one state per value head from rank to rank is not
charged (it is ``heads * dk * dv`` elements, against the share's activations), and the executor refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpipe_tune.cost._arch_pieces import Piece, matmul, pointwise

CHUNK_TOKENS = 64
"""Tokens a chunk of the chunked delta rule holds (flash-linear-attention's ``chunk_gated_delta_rule`` block size)."""
_SILU_FLOPS_PER_ELEM = 4.0
_GATE_FLOPS_PER_ELEM = 10.0  # softplus, exp, product (decay); sigmoid (beta)
_NORM_FLOPS_PER_ELEM = 4.0
GATES_KERNELS = (6.0, 6.0, 0.0)
"""The decay and strength eager (``a + dt_bias``, softplus, ``exp(A_log)``, the product, its negation, ``sigmoid(b)``;
their backwards with the two parameters' reductions); fused (flash-linear-attention's gate kernel): one each."""
GATED_NORM_KERNELS = (10.0, 12.0, 0.0)
"""The output's RMSNorm gated by ``silu(z)`` eager (the RMSNorm's kernels, SiLU, the product); fused
(flash-linear-attention's ``FusedRMSNormGated``): one each."""


def _chunks(seq_lens: Sequence) -> Any:
    """Chunks over all sequences (elementwise for microbatch arrays)."""
    return sum(np.ceil(np.asarray(s, dtype=float) / CHUNK_TOKENS) for s in seq_lens)


def delta_rule_core(seq_lens: Sequence, *, heads: float, key_dim: int, value_dim: int) -> list[Piece]:
    """The chunked gated delta rule over independent sequences of ``seq_lens`` tokens, ``heads`` value heads a
    rank (q and k already repeated to them), as its forward kernels, each with its backward.

    >>> core = delta_rule_core([128], heads=1, key_dim=64, value_dim=64)
    >>> len(core), round(sum(p.fwd_flops for p in core) / 128)  # a token and head: 1 + 6*dk*dv + c*(6dk+4dv) + c*c/3
    (6, 66902)
    """
    tokens = sum(seq_lens)
    c, dk, dv = CHUNK_TOKENS, key_dim, value_dim
    t = tokens * heads  # token-heads
    states = _chunks(seq_lens) * heads * dk * dv  # each chunk's state, written forward and read by the output
    kernels = [  # (forward FLOPs, forward elements read and written)
        (t, 2.0 * t),  # cumulative decay within each chunk
        (2.0 * t * c * dk, t * (dk + 1) + t * c),  # beta K K^T in each chunk
        (t * c * c / 3.0, 2.0 * t * c),  # its unit lower-triangular inverse
        (2.0 * t * c * (dk + dv), t * c + 2.0 * t * (dk + dv)),  # WY factors w = A beta K, u = A beta V
        (4.0 * t * dk * dv, t * (2 * dk + 2 * dv) + states),  # state recurrence over the chunks
        (2.0 * t * dk * dv + 2.0 * t * c * (dk + dv), t * (2 * dk + 2 * dv) + states),  # output
    ]
    recompute = {3, 4}  # the backward first recomputes the WY factors and the chunk states: a second kernel each
    saved = (("gdn_q", t * dk), ("gdn_k", t * dk), ("gdn_v", t * dv), ("gdn_g", t), ("gdn_beta", t),
             ("gdn_inverse", t * c), ("gdn_state", heads * dk * dv * len(seq_lens)), ("gdn_out", t * dv))
    pieces = []
    for index, (flops, elems) in enumerate(kernels):
        again = index in recompute
        pieces.append(Piece(
            fwd_flops=flops, fwd_elems=elems,
            dgrad_flops=(3.0 if again else 2.0) * flops, dgrad_elems=(3.0 if again else 2.0) * elems,
            saved=saved if index == len(kernels) - 1 else (), attention_core=True,
            outputs=("gdn_out",) if index == len(kernels) - 1 else (),
            kernels=(1.0, 2.0 if again else 1.0, 0.0),
        ))
    return pieces


def gated_deltanet(dims: Mapping[str, Any], tokens: float, seq_lens: list, tp_degree: int, *,
                   input_shards: int = 1) -> list[Piece]:
    """The token mixer of a ``gated_deltanet`` decoder layer on one tensor-parallel rank: projections,
    convolution, gates, the chunked delta rule, the gated norm and the output projection (the pre-norm, the
    all-reduce and the residual add are the decoder block's). Value heads are split over the ranks, key heads
    too while there are enough (with fewer, each rank keeps one, as in grouped-query attention)."""
    hidden, heads, kv_heads = dims["hidden"], dims["heads"], dims["kv_heads"]
    dk, dv, kernel = dims["head_dim"], dims["value_head_dim"], dims["conv_kernel"]
    kv_degree = min(tp_degree, kv_heads)
    local_heads, local_kv = heads / tp_degree, kv_heads / kv_degree
    channels = tokens * (2 * local_kv * dk + local_heads * dv)  # q, k, v through the convolution
    value_elems = tokens * local_heads * dv
    gate_elems = 2.0 * tokens * local_heads

    def projection(width: int, degree: int) -> Piece:
        return matmul("x_norm1", tokens, hidden, width, split="column", tp_degree=degree, input_shards=input_shards)

    return [
        projection(2 * kv_heads * dk, kv_degree),  # q, k
        projection(heads * dv, tp_degree),  # v
        projection(heads * dv, tp_degree),  # z, the output gate
        projection(2 * heads, tp_degree),  # b, a
        pointwise(channels, channels, (2.0 * kernel + _SILU_FLOPS_PER_ELEM) * channels,  # one causal_conv1d kernel
                  saved=(("gdn_qkv_in", channels),), params=(2 * kv_heads * dk + heads * dv) * kernel,
                  kernels=(1.0, 2.0, 0.0), param_tensors=1),  # its backward: the input's and the weight's gradients
        pointwise(gate_elems, gate_elems, _GATE_FLOPS_PER_ELEM * gate_elems, saved=(("gdn_ba", gate_elems),),
                  params=2 * heads, kernels=GATES_KERNELS, fused_kernels=(1.0, 1.0, 0.0),
                  param_tensors=2),  # A_log and dt_bias
        *delta_rule_core(seq_lens, heads=local_heads, key_dim=dk, value_dim=dv),
        pointwise(2.0 * value_elems, value_elems, (_NORM_FLOPS_PER_ELEM + _SILU_FLOPS_PER_ELEM) * value_elems,
                  saved=(("gdn_out", value_elems), ("gdn_z", value_elems)), params=dv, kernels=GATED_NORM_KERNELS,
                  fused_kernels=(1.0, 1.0, 0.0), param_tensors=1),
        matmul("gdn_normed", tokens, heads * dv, hidden, split="row", tp_degree=tp_degree),
    ]
