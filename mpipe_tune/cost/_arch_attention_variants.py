"""The decoder variants of today's families, as kernels added to (or adjusting) a decoder block's pieces.

- ``qk_norm`` (Qwen3, Qwen3.5, Gemma 3): an RMSNorm over each q and each k head before RoPE, weights
  ``head_dim`` each for q and k.
- ``attention_gate`` (Qwen3.5's gated attention, Qiu et al., "Gated Attention for Large Language Models",
  2025): the query projection also gives a gate per head and dimension, and the attention output is multiplied
  by its sigmoid before the output projection: one more column-split projection and one pointwise kernel.
- ``sliding_window`` (Gemma 3's local layers): each token attends to the last ``w`` tokens. Full causal
  attention is charged the full square of scores (Megatron-LM's convention, :func:`arch_pieces.attention`);
  a sliding window is charged twice the pairs it sees, ``2*w*s - w*w`` for a sequence of ``s > w``.
- ``post_norms`` (Gemma 3, GLM-4): an RMSNorm on the attention's and on the MLP's output before each residual add.
- ``deepstack_in`` (Qwen3-VL's DeepStack): one DeepStack feature, ``[image_tokens, hidden]``, added to the
  image tokens' rows of the block's output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mpipe_tune.cost._arch_pieces import Piece, matmul, pointwise

_SIGMOID_GATE_FLOPS_PER_ELEM = 5.0  # sigmoid and product
GATE_KERNELS = (2.0, 3.0, 0.0)
"""The output gate's kernels eager (sigmoid, product; backward: two products and the sigmoid's); fused: one each."""

Norm = Callable[..., Piece]
"""The decoder's norm builder (``arch_layers._norm``: ``norm(kept tensor, tokens, width, layernorm=..., shards=...)``),
passed in so that the variants' norms count the same kernels, parameters and saved tensors as the block's own."""


def window_pairs(seq_len, window: int):
    """Scores charged to a causal sequence of ``seq_len`` tokens with a sliding window of ``window``, in the
    full-square convention (``seq_len ** 2`` when it fits in the window).

    >>> window_pairs(100, 1000), window_pairs(4096, 1024)
    (10000, 7340032)
    """
    s = np.asarray(seq_len)
    pairs = np.where(s > window, 2 * window * s - window * window, s * s)
    return pairs.item() if pairs.ndim == 0 else pairs


def scale_core(pieces: Sequence[Piece], seq_lens: Sequence, pairs: Sequence) -> list[Piece]:
    """``pieces`` with the attention core's FLOPs scaled from the full square of each of ``seq_lens`` to
    ``pairs`` scores (its bytes do not change: every token is still read and written once). The core no longer
    gives its sequence lengths: a profile's attention curve is per whole sequence, so a windowed core runs at the
    profile's attention-core efficiency."""
    full = sum(np.asarray(s, dtype=float) ** 2 for s in seq_lens)
    kept = sum(np.asarray(p, dtype=float) for p in pairs)
    ratio = np.where(full > 0, kept / np.where(full > 0, full, 1.0), 1.0)
    ratio = ratio.item() if np.ndim(ratio) == 0 else ratio
    return [replace(p, fwd_flops=p.fwd_flops * ratio, dgrad_flops=p.dgrad_flops * ratio, seq_lens=())
            if p.attention_core else p for p in pieces]


def attention_variants(dims: Mapping[str, Any], pieces: list[Piece], tokens, seq_lens: Sequence, tp_degree: int, *,
                       norm: Norm, input_shards: int = 1) -> list[Piece]:
    """A grouped-query attention's ``pieces`` with the variants ``dims`` turns on: q/k norms before the core,
    the sliding window's core, the output gate after it."""
    if dims["attention"] != "gqa":
        return pieces
    heads, kv_heads, head_dim = dims["heads"], dims["kv_heads"], dims["head_dim"]
    kv_degree = min(tp_degree, kv_heads)
    if dims["sliding_window"] is not None:
        pieces = scale_core(pieces, seq_lens, [window_pairs(s, dims["sliding_window"]) for s in seq_lens])
    core = next(i for i, p in enumerate(pieces) if p.attention_core)
    before, after = list(pieces[:core]), list(pieces[core:])
    if dims["qk_norm"]:  # one RMSNorm of head_dim over the rank's q heads, one over its k heads
        before += [norm("q", tokens * heads / tp_degree, head_dim, layernorm=False),
                   norm("k", tokens * kv_heads / kv_degree, head_dim, layernorm=False)]
    if dims["attention_gate"]:
        gated = tokens * heads * head_dim / tp_degree
        before.append(matmul("x_norm1", tokens, dims["hidden"], heads * head_dim, split="column", tp_degree=tp_degree,
                             input_shards=input_shards))
        after.insert(1, pointwise(2.0 * gated, gated, _SIGMOID_GATE_FLOPS_PER_ELEM * gated,
                                  saved=(("attn_gate", gated),), kernels=GATE_KERNELS, fused_kernels=(1.0, 1.0, 0.0)))
    return before + after


def block_variants(dims: Mapping[str, Any], mb, tokens, *, norm: Norm, shards: int = 1) -> tuple[
        list[Piece], list[Piece], list[Piece]]:
    """Kernels a decoder block adds: after its attention and after its MLP (``post_norms``, each before its
    residual add), and after the block (the DeepStack feature added to the image tokens' rows, ``deepstack_in``)."""
    hidden = dims["hidden"]
    after_attention, after_mlp, injected = [], [], []
    if dims["post_norms"]:
        after_attention.append(norm("attn_proj", tokens, hidden, layernorm=False, shards=shards))
        after_mlp.append(norm("mlp_out", tokens, hidden, layernorm=False, shards=shards))
    if dims["deepstack_in"]:
        added = mb.image_tokens * hidden
        injected.append(pointwise(2.0 * added, added, added))
    return after_attention, after_mlp, injected
