"""Each architecture kind as the list of kernels (:class:`~mpipe_tune.cost.arch_pieces.Piece`) it runs.

One builder per kind turns resolved dimensions, a microbatch and a tensor-parallel degree into a
:class:`~mpipe_tune.cost.arch_pieces.Layer`. Modelling choices, beyond those of ``arch_pieces``:

- Decoder kinds see one sequence of ``text_tokens`` with causal attention; image-stream kinds see
  ``image_tokens * merge_factor`` ViT patches, with full attention inside each image only.
- Norms, residual adds and routing run whole on every rank (no sequence parallelism), so their
  tensors count in full per rank; RoPE is taken as fused into the attention kernel.
- Key/value heads are split over the ranks while there are enough; with fewer key/value heads than
  ranks each rank keeps one (Megatron-LM's replication).
- MLA's down-projections (to the q and kv latents) are replicated, its up-projections column-split.
- Routed experts are tensor-parallel like a dense MLP (expert parallelism is not modelled). The
  forward reads the weights of the experts its tokens hit: expected ``E * (1 - (1 - k/E)**tokens)``.
- The patch embedding, the router and a one-layer projector are small and replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mpipe_tune.cost.arch_pieces import Layer, Piece, Split, all_reduce, attention, lookup, matmul, pointwise
from mpipe_tune.cost.workload import Microbatch

_NORM_FLOPS_PER_ELEM = 4.0  # mean/variance, scale, gain
_SWIGLU_FLOPS_PER_ELEM = 4.0  # sigmoid, two products
_GELU_FLOPS_PER_ELEM = 8.0  # tanh or sigmoid approximation
_SOFTMAX_FLOPS_PER_ELEM = 5.0  # max, subtract, exp, sum, divide
_CROSS_ENTROPY_REDUCTIONS = 3  # per-token max, sum of exponentials, target logit (vocab-parallel loss)


def build_layer(kind: str, dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    """The kernels of one layer of ``kind`` on microbatch ``mb``; ``dims`` have their defaults filled in."""
    return _BUILDERS[kind](dims, mb, tp_degree)


def _norm(name: str, tokens: float, width: int, *, layernorm: bool) -> Piece:
    """RMSNorm or LayerNorm of tensor ``name``, which it keeps for the backward (its output is the
    input the next matmuls name, e.g. ``x`` -> ``x_norm1``, ``x_mid`` -> ``x_norm2``)."""
    elems = tokens * width
    return pointwise(
        elems, elems, _NORM_FLOPS_PER_ELEM * elems, saved=((name, elems),), params=(2 if layernorm else 1) * width
    )


def _residual_add(tokens: float, width: int) -> Piece:
    return pointwise(2.0 * tokens * width, tokens * width, tokens * width)


def _mlp(
    prefix: str,
    input_name: str,
    tokens: float,
    in_width: int,
    ffn: int,
    out_width: int,
    *,
    activation: str,
    bias: bool,
    tp_degree: int,
    copies: int = 1,
    copies_read: float = 1.0,
    copies_per_token: int = 1,
) -> list[Piece]:
    """Column-split up (and gate) projection, activation, row-split down projection (no all-reduce)."""
    experts = {"copies": copies, "copies_read": copies_read, "copies_per_token": copies_per_token}

    def linear(name: str, width_in: int, width_out: int, split: Split) -> Piece:
        return matmul(name, tokens, width_in, width_out, split=split, tp_degree=tp_degree, bias=bias, **experts)

    ffn_elems = tokens * ffn / tp_degree
    if activation == "swiglu":
        up = [linear(input_name, in_width, ffn, "column"), linear(input_name, in_width, ffn, "column")]
        saved = ((f"{prefix}gate", ffn_elems), (f"{prefix}up", ffn_elems))
        act = pointwise(2.0 * ffn_elems, ffn_elems, _SWIGLU_FLOPS_PER_ELEM * ffn_elems, saved=saved)
    else:
        up = [linear(input_name, in_width, ffn, "column")]
        saved = ((f"{prefix}up", ffn_elems),)
        act = pointwise(ffn_elems, ffn_elems, _GELU_FLOPS_PER_ELEM * ffn_elems, saved=saved)
    return [*up, act, linear(f"{prefix}act", ffn, out_width, "row")]


def _gqa(
    dims: Mapping[str, Any], tokens: float, seq_lens: list[int], tp_degree: int, *, qkv_bias: bool, out_bias: bool
) -> list[Piece]:
    """q, k, v projections, attention core and output projection (grouped-query or multi-head)."""
    hidden, heads, kv_heads, head_dim = dims["hidden"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    kv_degree = min(tp_degree, kv_heads)  # fewer kv heads than ranks: each rank keeps one
    return [
        matmul("x_norm1", tokens, hidden, heads * head_dim, split="column", tp_degree=tp_degree, bias=qkv_bias),
        matmul("x_norm1", tokens, hidden, kv_heads * head_dim, split="column", tp_degree=kv_degree, bias=qkv_bias),
        matmul("x_norm1", tokens, hidden, kv_heads * head_dim, split="column", tp_degree=kv_degree, bias=qkv_bias),
        attention(
            seq_lens,
            heads=heads / tp_degree,
            kv_heads=kv_heads / kv_degree,
            qk_head_dim=head_dim,
            v_head_dim=head_dim,
        ),
        matmul("attn_out", tokens, heads * head_dim, hidden, split="row", tp_degree=tp_degree, bias=out_bias),
    ]


def _mla(dims: Mapping[str, Any], tokens: float, seq_lens: list[int], tp_degree: int) -> list[Piece]:
    """DeepSeek's multi-head latent attention: low-rank q and kv, decoupled RoPE key shared by heads."""
    hidden, heads = dims["hidden"], dims["heads"]
    q_lora, kv_lora = dims["q_lora_rank"], dims["kv_lora_rank"]
    nope, rope, v_dim = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"]
    qk_dim = nope + rope
    split = {"tp_degree": tp_degree}
    if q_lora is None:
        q = [matmul("x_norm1", tokens, hidden, heads * qk_dim, split="column", **split)]
    else:
        q = [
            matmul("x_norm1", tokens, hidden, q_lora, split="replicated", **split),
            _norm("q_latent", tokens, q_lora, layernorm=False),
            matmul("q_latent_norm", tokens, q_lora, heads * qk_dim, split="column", **split),
        ]
    kv = [
        matmul("x_norm1", tokens, hidden, kv_lora + rope, split="replicated", **split),
        _norm("kv_latent", tokens, kv_lora, layernorm=False),
        matmul("kv_latent_norm", tokens, kv_lora, heads * (nope + v_dim), split="column", **split),
    ]
    core = attention(
        seq_lens, heads=heads / tp_degree, kv_heads=heads / tp_degree, qk_head_dim=qk_dim, v_head_dim=v_dim
    )
    out = matmul("attn_out", tokens, heads * v_dim, hidden, split="row", **split)
    return [*q, *kv, core, out]


def _decoder_attention(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> list[Piece]:
    """Pre-norm attention sub-block with its all-reduce and residual add."""
    tokens, hidden = mb.text_tokens, dims["hidden"]
    seq_lens = [mb.text_tokens]
    if dims["attention"] == "mla":
        core = _mla(dims, tokens, seq_lens, tp_degree)
    else:
        core = _gqa(dims, tokens, seq_lens, tp_degree, qkv_bias=dims["qkv_bias"], out_bias=False)
    return [
        _norm("x", tokens, hidden, layernorm=False),
        *core,
        all_reduce(tokens * hidden, tp_degree=tp_degree),
        _residual_add(tokens, hidden),
    ]


def _dense_block(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    tokens, hidden = mb.text_tokens, dims["hidden"]
    mlp = _mlp("", "x_norm2", tokens, hidden, dims["ffn"], hidden, activation=dims["activation"], bias=False,
               tp_degree=tp_degree)
    pieces = [
        *_decoder_attention(dims, mb, tp_degree),
        _norm("x_mid", tokens, hidden, layernorm=False),
        *mlp,
        all_reduce(tokens * hidden, tp_degree=tp_degree),
        _residual_add(tokens, hidden),
    ]
    return Layer(tuple(pieces), boundary_elems=tokens * hidden)


def _moe_block(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    tokens, hidden = mb.text_tokens, dims["hidden"]
    experts, top_k, moe_ffn = dims["experts"], dims["top_k"], dims["moe_ffn"]
    routed_tokens = tokens * top_k
    experts_hit = experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    common = {"activation": dims["activation"], "bias": False, "tp_degree": tp_degree}
    routed = _mlp("expert_", "dispatched", routed_tokens, hidden, moe_ffn, hidden, copies=experts,
                  copies_read=experts_hit, copies_per_token=top_k, **common)
    shared = []
    if dims["shared_experts"] > 0:
        shared = _mlp("shared_", "x_norm2", tokens, hidden, dims["shared_experts"] * moe_ffn, hidden, **common)
    pieces = [
        *_decoder_attention(dims, mb, tp_degree),
        _norm("x_mid", tokens, hidden, layernorm=False),
        matmul("x_norm2", tokens, hidden, experts, split="replicated", tp_degree=tp_degree),
        pointwise(tokens * experts, 2.0 * routed_tokens, _SOFTMAX_FLOPS_PER_ELEM * tokens * experts,
                  saved=(("router_scores", tokens * experts),)),
        pointwise(tokens * hidden, routed_tokens * hidden, 0.0),  # permute tokens into expert order
        *routed,
        pointwise(routed_tokens * (hidden + 1), tokens * hidden, 2.0 * routed_tokens * hidden,
                  saved=(("expert_out", routed_tokens * hidden),)),  # weighted sum back into token order
        *shared,
        all_reduce(tokens * hidden, tp_degree=tp_degree),
        _residual_add(tokens, hidden),
    ]
    return Layer(tuple(pieces), boundary_elems=tokens * hidden)


def _patches(dims: Mapping[str, Any], mb: Microbatch) -> int:
    return mb.image_tokens * dims["merge_factor"]


def _vit_block(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    hidden, heads = dims["hidden"], dims["heads"]
    patches = _patches(dims, mb)
    seq_lens = [tokens * dims["merge_factor"] for tokens in mb.image_sizes()]
    bias = dims["bias"]
    attn = _gqa({**dims, "kv_heads": heads}, patches, seq_lens, tp_degree, qkv_bias=bias, out_bias=bias)
    mlp = _mlp("", "x_norm2", patches, hidden, dims["ffn"], hidden, activation=dims["activation"], bias=bias,
               tp_degree=tp_degree)
    pieces = [
        _norm("x", patches, hidden, layernorm=True),
        *attn,
        all_reduce(patches * hidden, tp_degree=tp_degree),
        _residual_add(patches, hidden),
        _norm("x_mid", patches, hidden, layernorm=True),
        *mlp,
        all_reduce(patches * hidden, tp_degree=tp_degree),
        _residual_add(patches, hidden),
    ]
    return Layer(tuple(pieces), boundary_elems=patches * hidden)


def _patch_embed(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    hidden, patches = dims["hidden"], _patches(dims, mb)
    patch_elems = dims["in_channels"] * dims["patch_size"] ** 2 * dims["temporal_patch"]
    pieces = [matmul("pixels", patches, patch_elems, hidden, split="replicated", tp_degree=tp_degree,
                     bias=dims["bias"])]
    if dims["positions"] > 0:  # learned absolute position table, added to every patch
        pieces.append(pointwise(2.0 * patches * hidden, patches * hidden, patches * hidden,
                                params=dims["positions"] * hidden))
    return Layer(tuple(pieces), boundary_elems=patches * hidden)


def _merger(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    """Qwen2-VL's PatchMerger: LayerNorm per patch, concatenate ``merge_factor`` neighbours, 2-layer MLP."""
    hidden, merge, out = dims["hidden"], dims["merge_factor"], dims["out_hidden"]
    tokens = mb.image_tokens
    mlp = _mlp("", "x_norm", tokens, hidden * merge, hidden * merge, out, activation="gelu", bias=True,
               tp_degree=tp_degree)
    pieces = [_norm("x", _patches(dims, mb), hidden, layernorm=True), *mlp,
              all_reduce(tokens * out, tp_degree=tp_degree)]
    return Layer(tuple(pieces), boundary_elems=tokens * out)


def _projector(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    tokens, in_hidden, hidden = mb.image_tokens, dims["in_hidden"], dims["hidden"]
    if dims["depth"] == 1:
        pieces = [matmul("x", tokens, in_hidden, hidden, split="replicated", tp_degree=tp_degree, bias=True)]
    else:
        ffn = dims["ffn"] or hidden
        pieces = [*_mlp("", "x", tokens, in_hidden, ffn, hidden, activation="gelu", bias=True, tp_degree=tp_degree),
                  all_reduce(tokens * hidden, tp_degree=tp_degree)]
    return Layer(tuple(pieces), boundary_elems=tokens * hidden)


def _embedding(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    tokens, hidden = mb.text_tokens, dims["hidden"]
    pieces = [lookup(tokens, dims["vocab"], hidden, tp_degree=tp_degree),
              all_reduce(tokens * hidden, tp_degree=tp_degree)]  # vocab-parallel: each rank holds some rows
    return Layer(tuple(pieces), boundary_elems=tokens * hidden)


def _lm_head(dims: Mapping[str, Any], mb: Microbatch, tp_degree: int) -> Layer:
    """Final norm, vocab-parallel logits and cross-entropy; the loss goes nowhere, so no boundary."""
    tokens, hidden, vocab = mb.text_tokens, dims["hidden"], dims["vocab"]
    logits_elems = tokens * vocab / tp_degree
    pieces = [
        _norm("x", tokens, hidden, layernorm=False),
        matmul("x_norm", tokens, hidden, vocab, split="column", tp_degree=tp_degree),
        pointwise(logits_elems, tokens, _SOFTMAX_FLOPS_PER_ELEM * logits_elems,
                  saved=(("softmax", logits_elems),)),
        all_reduce(_CROSS_ENTROPY_REDUCTIONS * tokens, tp_degree=tp_degree),
    ]
    return Layer(tuple(pieces), boundary_elems=0.0)


_BUILDERS: dict[str, Callable[[Mapping[str, Any], Microbatch, int], Layer]] = {
    "embedding": _embedding,
    "dense_block": _dense_block,
    "moe_block": _moe_block,
    "lm_head": _lm_head,
    "vit_block": _vit_block,
    "patch_embed": _patch_embed,
    "merger": _merger,
    "projector": _projector,
}
