"""Each architecture kind as the list of kernels (:class:`~mpipe_tune.cost._arch_pieces.Piece`) it runs.

One builder per kind turns resolved dimensions, a microbatch and a tensor-parallel degree into a
:class:`~mpipe_tune.cost._arch_pieces.Layer`. Modelling choices, beyond those of ``arch_pieces``:

- Decoder kinds see one sequence of ``text_tokens`` with causal attention (or the microbatch's ``texts``, each
  attending to itself); image-stream kinds see
  ``image_tokens * merge_factor`` ViT patches, with full attention inside each image only.
- Norms, residual adds and routing run whole on every rank (no sequence parallelism), so their
  tensors count in full per rank. RoPE runs as its own kernels on q and k (:func:`rotary_embedding`).
- Key/value heads are split over the ranks while there are enough; with fewer key/value heads than
  ranks each rank keeps one (Megatron-LM's replication).
- MLA's down-projections (to the q and kv latents) are replicated, its up-projections column-split.
- Routed experts are tensor-parallel like a dense MLP (expert tensor parallelism equals tp, as
  torchtitan's ``etp = tp`` and Megatron-LM's default). The forward reads the weights of the experts
  its tokens hit: expected ``E * (1 - (1 - k/E)**tokens)``.
- Expert parallelism over ``ep`` ranks: each rank holds ``E/ep`` experts; the router's output is
  permuted into ``tokens * top_k`` rows (one copy per chosen expert, no de-duplication), and the
  trainer's token dispatcher (:mod:`mpipe_tune.cost._moe`: Megatron-Core's ``alltoall``, with its
  tensor-parallel gather, or ``allgather``) moves them to their experts and back, each collective's mirror
  in the backward. With the ``ep`` ranks' microbatches alike, a rank's experts receive as many rows as it
  sends, times ``moe_imbalance`` on the busiest rank (what the step waits for), or capped or padded by a
  capacity factor; its local experts are hit by the rows of all ``ep`` ranks. The router's scores, top-k and
  auxiliary load-balancing loss are memory-bound passes over ``tokens x E``.
- The patch embedding, the router and a one-layer projector are small and replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mpipe_tune.cost import _moe as moe
from mpipe_tune.cost._arch_attention_variants import attention_variants, block_variants
from mpipe_tune.cost._arch_linear_attention import gated_deltanet
from mpipe_tune.cost._arch_pieces import (
    Layer, Piece, Split, all_reduce, all_to_all, attention, lookup, matmul, pointwise,
)
from mpipe_tune.cost._arch_vision import pixel_shuffle, projector_norm, vit_variants, with_side_features
from mpipe_tune.inputs import Microbatch

_NORM_FLOPS_PER_ELEM = 4.0  # mean/variance, scale, gain
_SWIGLU_FLOPS_PER_ELEM = 4.0  # sigmoid, two products
_GELU_FLOPS_PER_ELEM = 8.0  # tanh or sigmoid approximation
_SOFTMAX_FLOPS_PER_ELEM = 5.0  # max, subtract, exp, sum, divide
_CROSS_ENTROPY_REDUCTIONS = 3  # per-token max, sum of exponentials, target logit (vocab-parallel loss)
RMSNORM_KERNELS = (8.0, 10.0, 0.0)
"""An eager RMSNorm's kernels (a Hugging Face ``LlamaRMSNorm``: the cast to fp32, the square, the mean, the
epsilon, the reciprocal square root, the scaling, the cast back and the gain; its backward as autograd runs
those, with the gain's gradient reduction). Fused (Transformer Engine, Apex): :data:`FUSED_NORM_KERNELS`."""
RMSNORM_EAGER_TRAFFIC = ((4.0, 7.0), (8.0, 15.0), (0.0, 0.0))
"""Per element of the normed tensor, (elements in the step's dtype, fp32 elements) an eager RMSNorm's kernels
read and write, forward, input gradient, weight gradient: torchtitan's ``RMSNorm`` (``norm_type = "rmsnorm"``,
torchtitan/models/norms.py at 026e23a9: ``x.float()``, ``pow(2)``, ``mean``, the scaling, ``type_as`` and the
gain), which Hugging Face's ``LlamaRMSNorm`` matches. Forward: the cast (dtype read, fp32 write), the square
(fp32 read, write), the mean (fp32 read), the scaling (fp32 read, write), the cast back (fp32 read, dtype
write), the gain (dtype read, write). Backward, as autograd runs those: the gain's product and its gradient's
product and sum (dtype: 2 + 3 + 1 elements), the cast's backward (dtype read, fp32 write), the scaling's two
products and the sum over the row (fp32: 2 + 3 + 1), the mean's expansion (fp32 write), the square's backward
(fp32: 2 read, 1 write), the sum of the two gradients (2 read, 1 write), the first cast's backward (fp32 read,
dtype write). A fused norm kernel reads and writes each element once (:func:`pointwise`)."""
LAYERNORM_KERNELS = (1.0, 2.0, 0.0)
"""A LayerNorm's kernels, eager (torch's native ``layer_norm``: one forward; the input gradient and the gain
and bias gradients) and fused alike."""
FUSED_NORM_KERNELS = (1.0, 2.0, 0.0)
SWIGLU_KERNELS = (2.0, 3.0, 0.0)
"""Eager SwiGLU (``silu(gate) * up``; backward: two products and ``silu``'s backward); fused: one each."""
SWIGLU_EAGER_TRAFFIC = (5.0, 9.0, 0.0)
"""Per element of the gate, elements in the step's dtype an eager gated activation's kernels read and write
(``act(gate) * up``, torchtitan's ``FeedForward``: ``w2(F.silu(w1(x)) * w3(x))``), forward, input gradient,
weight gradient: the activation (read the gate, write its output) and the product (read both, write);
backward, the product's two gradients (each reads the output gradient and the other factor and writes) and the
activation's backward (reads the gradient and the gate, writes). Fused: :func:`pointwise`'s 3 and 5."""
ROUTER_KERNELS = (4.0, 4.0, 0.0)
"""An eager router after its GEMM: softmax, top-k, the gather of the chosen scores and their normalisation
(their backwards); fused (Megatron-Core's fused top-k softmax): one each."""
AUX_LOSS_KERNELS = (5.0, 4.0, 0.0)
"""The auxiliary load-balancing loss over the router's scores, eager and fused alike (Megatron-Core's
``switch_load_balancing_loss_func``: the scores summed over tokens, the tokens per expert, their product, its sum
and the scaling; their backwards)."""
PERMUTE_KERNELS = (3.0, 2.0, 0.0)
"""Eager token permutation into expert order (argsort of the expert ids, the index, the gather); fused: one."""
UNPERMUTE_KERNELS = (3.0, 3.0, 0.0)
"""Eager weighted sum back into token order (the scaling by the router's weights, the scatter-add, the
reshape's copy; their backwards); fused: one."""
ONE_EACH = (1.0, 1.0, 0.0)
ROPE_TABLE_KERNELS = 6.0
"""Kernels making RoPE's tables in each call of the unfused forms: ``cos``, ``sin``, the two scalings and the two
casts to the dtype (:data:`ROPE_TABLE_BYTES`)."""
LOSS_BYTES = 4
"""Width of the loss's tensors: Megatron-LM casts the logits to fp32 for its vocab-parallel
cross-entropy whatever the step's dtype (:func:`vocab_parallel_loss`)."""
LOSS_FWD_PASSES = (1, 2, 2, 1, 2)
"""fp32 elements per logit the loss's forward kernels read and write after the cast, in Megatron-LM
core_r0.6.0's ``_VocabParallelCrossEntropy.forward`` (megatron/core/tensor_parallel/cross_entropy.py at
tag core_v0.6.0, cac60ce4, lines 19, 24, 57, 58, 69; MindSpeed 1.0.RC3's patch of it, which
MindSpeed-LLM 1.0.RC3 applies, mindspeed/core/tensor_parallel/cross_entropy.py at e2f87dc9 lines 14, 19,
52, 53, 61, runs the same kernels): the max over the vocabulary (read), the subtraction of the max
(read, write a new tensor), the exponential in place (read, write), its sum (read) and the division
by it in place (read, write), which leaves the softmax the backward keeps."""
LOSS_BWD_PASSES = (2,)
"""fp32 elements per logit the unfused loss's backward reads and writes before the cast back (lines
105-124 there): the one-hot subtraction touches one element per token, the multiplication by the
output gradient in place (line 124) reads and writes every logit."""
FUSED_LOSS_FWD_PASSES = (2, 2)
"""The same for Megatron-LM's fused loss (``cross_entropy_loss_fusion``, core_v0.9.0, 1afee592,
megatron/core/fusions/fused_cross_entropy.py), each ``jit_fuser`` function one kernel: after the cast
(fused with the max, lines 17-24), the subtraction, exponential and sum (read, write, lines 27-44) and
the division (read, write, lines 47-59)."""
FUSED_LOSS_BWD_PASSES = (1,)
"""Its backward (lines 62-80): one kernel reads the softmax and writes the gradient in the dtype."""
ROPE_FWD_PASSES = (2, 1, 2, 2, 3)
"""Elements of the rotated part of q or k each unfused RoPE forward kernel reads and writes, per element, in
Megatron-LM core_v0.6.0's ``apply_rotary_pos_emb_bshd`` (megatron/core/models/common/embeddings/
rotary_pos_embedding.py at tag core_v0.6.0, cac60ce4, lines 164-165 and 195; MindSpeed's patch of it at
e2f87dc9, mindspeed/core/models/common/embeddings/rotary_pos_embedding.py line 73, runs the same
kernels): ``t * cos`` (read, write), the negation of one half (half read, half written), ``cat`` of the
halves (read, write), ``* sin`` (read, write) and the sum (two read, one written). Then ``cat`` with the
unrotated part (line 196 there; line 75 in MindSpeed) reads and writes every element of the head."""
ROPE_BWD_PASSES = (2, 1, 2, 2, 3)
"""The same for its backward as autograd runs it (checked with torch's profiler): the gradient times
``sin`` (read, write), the negation's backward (half, half), the ``chunk``'s backward concatenating the
halves (read, write), the gradient times ``cos`` (read, write) and the sum of the two gradients (two
read, one written). Besides: the unrotated slice's backward writes a zero tensor of the whole head and
its gradient is added to the rest (two read, one written); with part of each head rotated, the rotated
slice's too (zeros, and a copy of the rotated part)."""
FUSED_ROPE_PASSES = (2,)
"""A fused RoPE kernel reads the rotated part and writes it, forward and backward alike: MindSpeed's
``npu_rotary_position_embedding`` (``--use-fused-rotary-pos-emb``, line 71 at e2f87dc9), which runs inside
the unfused function's slicing, concatenation and tables, and Transformer Engine's
``fused_apply_rotary_pos_emb`` in Megatron-LM (``apply_rope_fusion``, line 242 at core_v0.6.0), which
Megatron calls instead of that function, on the whole head (the unrotated part copied through) with its
angles computed from ``freqs`` inside the kernel."""
ROPE_FORMS = ("unfused", "fused", "mindspeed_fused", "none")
"""How a trainer runs RoPE (:func:`rotary_embedding`): Megatron-LM's (or MindSpeed's) separate kernels,
Megatron-LM's fused Transformer Engine kernel, MindSpeed's fused NPU kernel, or not at all (the tool's own
runtime, whose decoder blocks apply none: what ``mpipe-tune profile`` times)."""
ROPE_TABLE_BYTES = 16
"""fp32 bytes per token and rotated dimension MindSpeed moves making ``cos`` and ``sin`` in each call (one
for q, one for k), before the cast to the step's dtype: ``torch.cos(freqs)`` (read, write) and its
``* _mscale`` (read, write), and the same for ``sin`` (lines 66-67 at e2f87dc9; Megatron-LM's lines
192-193 skip the multiply). They are kept, in the dtype, for the backward."""


@dataclass(frozen=True)
class LayerDegrees:
    """The parallel degrees that change one layer's own work on a rank (the others, pp and dp, do not)."""

    tp_degree: int = 1
    ep_degree: int = 1
    """Expert-parallel ranks the routed experts are divided over (MoE layers only)."""
    moe_imbalance: float = 1.0
    """Routed rows on the busiest expert-parallel rank over the mean (>= 1); read only when ep > 1."""
    cp_degree: int = 1
    """Context-parallel ranks a decoder's sequence is divided over (ring attention)."""
    sequence_parallel: bool = False
    """Megatron-LM's sequence parallelism with tp: what runs outside the tensor-parallel regions (norms,
    residual adds, the layer's input and output) holds ``1/tp`` of the tokens on each rank."""
    moe: moe.MoeSettings = moe.MoeSettings()
    """How the trainer dispatches a MoE layer's tokens (MoE layers only)."""

    @property
    def sequence_shards(self) -> int:
        """What sequence parallelism divides the tensors outside the tensor-parallel regions by."""
        return self.tp_degree if self.sequence_parallel else 1


def build_layer(kind: str, dims: Mapping[str, Any], mb: Microbatch, tp_degree: int | LayerDegrees, *,
                dtype_bytes: int = 2, fused_loss: bool = False, rope: str = "fused") -> Layer:
    """The kernels of one layer of ``kind`` on microbatch ``mb``; ``dims`` have their defaults filled in.
    ``tp_degree``: the tensor-parallel degree, or all of a layer's degrees. Only the loss and the decoder
    blocks read the last three: ``dtype_bytes``, the step's element width (the loss runs in fp32
    whatever the dtype), ``fused_loss``, the trainer's fused loss kernels (:func:`vocab_parallel_loss`),
    and ``rope``, how it runs RoPE (:data:`ROPE_FORMS`, :func:`rotary_embedding`)."""
    degrees = tp_degree if isinstance(tp_degree, LayerDegrees) else LayerDegrees(tp_degree)
    if kind in _TRAINER_BUILDERS:
        layer = _TRAINER_BUILDERS[kind](dims, mb, degrees, _Trainer(dtype_bytes, fused_loss, rope))
    else:
        layer = _BUILDERS[kind](dims, mb, degrees)
    return with_side_features(layer, dims, mb)


def _local_text_tokens(mb: Microbatch, degrees: LayerDegrees) -> float:
    """A context-parallel rank's share of the microbatch's text tokens."""
    return mb.text_tokens if degrees.cp_degree == 1 else mb.text_tokens / degrees.cp_degree


def _norm(name: str, tokens: float, width: int, *, layernorm: bool, shards: int = 1) -> Piece:
    """RMSNorm or LayerNorm of tensor ``name``, which it keeps for the backward (its output is the
    input the next matmuls name, e.g. ``x`` -> ``x_norm1``, ``x_mid`` -> ``x_norm2``); ``shards``:
    sequence parallelism's divisor of its tokens."""
    elems = tokens * width / shards
    piece = pointwise(
        elems, elems, _NORM_FLOPS_PER_ELEM * elems, saved=((name, elems),), params=(2 if layernorm else 1) * width,
        kernels=LAYERNORM_KERNELS if layernorm else RMSNORM_KERNELS, fused_kernels=FUSED_NORM_KERNELS,
        param_tensors=2 if layernorm else 1,
    )
    if layernorm:
        return piece
    return replace(piece, eager_traffic=tuple((a * elems, b * elems) for a, b in RMSNORM_EAGER_TRAFFIC))


def _residual_add(tokens: float, width: int, *, shards: int = 1) -> Piece:
    elems = tokens * width / shards
    return pointwise(2.0 * elems, elems, elems)


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
    routed: bool = False,
    input_shards: int = 1,
) -> list[Piece]:
    """Column-split up (and gate) projection, activation, row-split down projection (no all-reduce).
    ``input_shards``: sequence parallelism's divisor of the saved input."""
    experts = {"copies": copies, "copies_read": copies_read, "copies_per_token": copies_per_token, "routed": routed}

    def linear(name: str, width_in: int, width_out: int, split: Split, shards: int = 1) -> Piece:
        return matmul(name, tokens, width_in, width_out, split=split, tp_degree=tp_degree, bias=bias,
                      input_shards=shards, **experts)

    ffn_elems = tokens * ffn / tp_degree
    if activation in ("swiglu", "geglu"):  # gated: SiLU (SwiGLU) or GELU (GeGLU, Gemma's) of the gate
        up = [linear(input_name, in_width, ffn, "column", input_shards),
              linear(input_name, in_width, ffn, "column", input_shards)]
        saved = ((f"{prefix}gate", ffn_elems), (f"{prefix}up", ffn_elems))
        act = pointwise(2.0 * ffn_elems, ffn_elems, _SWIGLU_FLOPS_PER_ELEM * ffn_elems, saved=saved,
                        kernels=SWIGLU_KERNELS, fused_kernels=ONE_EACH)
        act = replace(act, eager_traffic=tuple((n * ffn_elems, 0.0) for n in SWIGLU_EAGER_TRAFFIC))
    else:
        up = [linear(input_name, in_width, ffn, "column", input_shards)]
        saved = ((f"{prefix}up", ffn_elems),)
        act = pointwise(ffn_elems, ffn_elems, _GELU_FLOPS_PER_ELEM * ffn_elems, saved=saved)
    return [*up, act, linear(f"{prefix}act", ffn, out_width, "row")]


@dataclass(frozen=True)
class _Trainer:
    """What the kinds of :data:`_TRAINER_BUILDERS` read beyond their dimensions: the step's element width and
    how the trainer runs the loss (``fused_loss``) and RoPE (``rope``, :data:`ROPE_FORMS`)."""

    dtype_bytes: int
    fused_loss: bool
    rope: str


def rotary_embedding(tokens: float, heads: float, head_dim: int, rope_dim: int, *, dtype_bytes: int,
                     form: str) -> Piece:
    """RoPE applied to ``heads`` heads (a rank's q heads and k heads together) of ``tokens`` tokens, the
    first ``rope_dim`` of each head's ``head_dim`` dimensions rotated, forward and backward, in the step's
    elements (``dtype_bytes`` wide), run in ``form`` (:data:`ROPE_FORMS`).

    ``unfused``: the separate kernels of :data:`ROPE_FWD_PASSES` and :data:`ROPE_BWD_PASSES`;
    ``mindspeed_fused``: one kernel (:data:`FUSED_ROPE_PASSES`) in their place. Both then concatenate the
    rotated part with the rest (a copy of every element; its backward: a zero tensor and a sum, and with
    part of the head rotated the rotated slice's too), and make ``cos`` and ``sin`` twice
    (:data:`ROPE_TABLE_BYTES`), which they keep. ``fused``: Transformer Engine's kernel alone, over the
    whole head, reading the fp32 angles. Per element of a fully rotated bf16 head: 24 bytes forward and 28
    backward unfused, 8 and 12 in MindSpeed's fused form, 4 and 4 fused (each besides its per-token tables).

    >>> rotary_embedding(1, 1, 128, 128, dtype_bytes=2, form="unfused").fwd_elems
    7168.0
    """
    if rope_dim == 0 or form == "none":
        return Piece()
    rotated = tokens * heads * rope_dim
    whole = tokens * heads * head_dim
    angles = 2 * tokens * rope_dim * 4 / dtype_bytes  # fp32 freqs, read once per call (q, k)
    if form == "fused":  # one kernel for q, one for k
        return Piece(fwd_flops=3.0 * rotated, fwd_elems=sum(FUSED_ROPE_PASSES) * whole + angles,
                     dgrad_flops=3.0 * rotated, dgrad_elems=sum(FUSED_ROPE_PASSES) * whole + angles,
                     kernels=(2.0, 2.0, 0.0))
    fwd, bwd = (ROPE_FWD_PASSES, ROPE_BWD_PASSES) if form == "unfused" else (FUSED_ROPE_PASSES, FUSED_ROPE_PASSES)
    cat_back = 4.0 * whole  # the unrotated slice's zeros (write) and the sum of the two gradients (read 2, write 1)
    if rope_dim < head_dim:  # the rotated slice is a real slice too: its zeros, and the copy of its gradient
        cat_back += whole + 2.0 * (whole - rotated) + 2.0 * rotated
    cast_bytes = 0 if dtype_bytes == 4 else 4 + dtype_bytes  # the tables cast to the dtype
    tables = 2 * 2 * tokens * rope_dim  # cos and sin, for q and for k
    slices = 2.0 if rope_dim < head_dim else 0.0  # the rotated slice's zeros and copy
    per_tensor = (len(fwd) + 1.0, len(bwd) + 2.0 + slices)  # with the concatenation (its backward: zeros and a sum)
    return Piece(
        fwd_flops=3.0 * rotated,
        fwd_elems=sum(fwd) * rotated + 2.0 * whole + tables * (ROPE_TABLE_BYTES + cast_bytes) / dtype_bytes,
        dgrad_flops=4.0 * rotated,
        dgrad_elems=sum(bwd) * rotated + cat_back + tables,
        saved=(("rope_cos_sin", tables),),
        kernels=(2.0 * per_tensor[0] + 2.0 * ROPE_TABLE_KERNELS, 2.0 * per_tensor[1], 0.0),  # q and k, each call
    )


def _gqa(
    dims: Mapping[str, Any], tokens: float, seq_lens: list[int], degrees: LayerDegrees, *, qkv_bias: bool,
    out_bias: bool, trainer: _Trainer | None = None,
) -> list[Piece]:
    """q, k, v projections, RoPE on q and k (with ``trainer``: a decoder's), attention core and output
    projection (grouped-query or multi-head)."""
    hidden, heads, kv_heads, head_dim = dims["hidden"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    tp_degree, shards = degrees.tp_degree, degrees.sequence_shards
    kv_degree = min(tp_degree, kv_heads)  # fewer kv heads than ranks: each rank keeps one
    rotary = []
    if trainer is not None:
        rope_dim = head_dim if dims.get("rope_dim") is None else min(dims["rope_dim"], head_dim)
        rotary = [rotary_embedding(tokens, heads / tp_degree + kv_heads / kv_degree, head_dim, rope_dim,
                                   dtype_bytes=trainer.dtype_bytes, form=trainer.rope)]
    return [
        matmul("x_norm1", tokens, hidden, heads * head_dim, split="column", tp_degree=tp_degree, bias=qkv_bias,
               input_shards=shards),
        matmul("x_norm1", tokens, hidden, kv_heads * head_dim, split="column", tp_degree=kv_degree, bias=qkv_bias,
               input_shards=shards),
        matmul("x_norm1", tokens, hidden, kv_heads * head_dim, split="column", tp_degree=kv_degree, bias=qkv_bias,
               input_shards=shards),
        *rotary,
        attention(
            seq_lens,
            heads=heads / tp_degree,
            kv_heads=kv_heads / kv_degree,
            qk_head_dim=head_dim,
            v_head_dim=head_dim,
            context_degree=degrees.cp_degree,
        ),
        matmul("attn_out", tokens, heads * head_dim, hidden, split="row", tp_degree=tp_degree, bias=out_bias),
    ]


def _mla(dims: Mapping[str, Any], tokens: float, seq_lens: list[int], degrees: LayerDegrees,
         trainer: _Trainer) -> list[Piece]:
    """DeepSeek's multi-head latent attention: low-rank q and kv, decoupled RoPE key shared by heads
    (RoPE rotates each q head's and the shared key's ``qk_rope_head_dim`` part, counted as
    :func:`rotary_embedding` on heads of that width)."""
    hidden, heads = dims["hidden"], dims["heads"]
    q_lora, kv_lora = dims["q_lora_rank"], dims["kv_lora_rank"]
    nope, rope, v_dim = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"]
    qk_dim = nope + rope
    tp_degree, shards = degrees.tp_degree, degrees.sequence_shards
    split = {"tp_degree": tp_degree}
    if q_lora is None:
        q = [matmul("x_norm1", tokens, hidden, heads * qk_dim, split="column", input_shards=shards, **split)]
    else:
        q = [
            matmul("x_norm1", tokens, hidden, q_lora, split="replicated", input_shards=shards, **split),
            _norm("q_latent", tokens, q_lora, layernorm=False),
            matmul("q_latent_norm", tokens, q_lora, heads * qk_dim, split="column", **split),
        ]
    kv = [
        matmul("x_norm1", tokens, hidden, kv_lora + rope, split="replicated", input_shards=shards, **split),
        _norm("kv_latent", tokens, kv_lora, layernorm=False),
        matmul("kv_latent_norm", tokens, kv_lora, heads * (nope + v_dim), split="column", **split),
    ]
    core = attention(
        seq_lens, heads=heads / tp_degree, kv_heads=heads / tp_degree, qk_head_dim=qk_dim, v_head_dim=v_dim,
        context_degree=degrees.cp_degree,
    )
    out = matmul("attn_out", tokens, heads * v_dim, hidden, split="row", **split)
    rotary = rotary_embedding(tokens, heads / tp_degree + 1, rope, rope, dtype_bytes=trainer.dtype_bytes,
                              form=trainer.rope)
    return [*q, *kv, rotary, core, out]


def _decoder_attention(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees,
                       trainer: _Trainer) -> list[Piece]:
    """Pre-norm attention sub-block with its all-reduce and residual add."""
    tokens, hidden = _local_text_tokens(mb, degrees), dims["hidden"]
    tp_degree, shards = degrees.tp_degree, degrees.sequence_shards
    seq_lens = list(mb.text_sizes())  # a micro batch of several sequences: each attends to itself
    if dims["attention"] == "mla":
        core = _mla(dims, tokens, seq_lens, degrees, trainer)
    elif dims["attention"] == "gated_deltanet":
        core = gated_deltanet(dims, tokens, [tokens], tp_degree, input_shards=shards)  # a cp rank's share
    else:
        core = attention_variants(dims, _gqa(dims, tokens, seq_lens, degrees, qkv_bias=dims["qkv_bias"], out_bias=False,
                                             trainer=trainer), tokens, seq_lens, tp_degree, norm=_norm,
                                  input_shards=shards)
    return [
        _norm("x", tokens, hidden, layernorm=False, shards=shards),
        *core,
        all_reduce(tokens * hidden, tp_degree=tp_degree),
        *block_variants(dims, mb, tokens, norm=_norm, shards=shards)[0],
        _residual_add(tokens, hidden, shards=shards),
    ]


def _dense_block(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees, trainer: _Trainer) -> Layer:
    tp_degree, shards = degrees.tp_degree, degrees.sequence_shards
    tokens, hidden = _local_text_tokens(mb, degrees), dims["hidden"]
    mlp = _mlp("", "x_norm2", tokens, hidden, dims["ffn"], hidden, activation=dims["activation"], bias=False,
               tp_degree=tp_degree, input_shards=shards)
    pieces = [
        *_decoder_attention(dims, mb, degrees, trainer),
        _norm("x_mid", tokens, hidden, layernorm=False, shards=shards),
        *mlp,
        all_reduce(tokens * hidden, tp_degree=tp_degree),
        *_after_mlp(dims, mb, tokens, shards),
    ]
    return Layer(tuple(pieces), boundary_elems=tokens * hidden / shards)


def _after_mlp(dims: Mapping[str, Any], mb: Microbatch, tokens: float, shards: int) -> list[Piece]:
    """A decoder block's post-MLP norm (if any), residual add and DeepStack injection (if any)."""
    _, post_norm, injected = block_variants(dims, mb, tokens, norm=_norm, shards=shards)
    return [*post_norm, _residual_add(tokens, dims["hidden"], shards=shards), *injected]


def _moe_block(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees, trainer: _Trainer) -> Layer:
    tokens, hidden = _local_text_tokens(mb, degrees), dims["hidden"]
    experts, top_k, moe_ffn = dims["experts"], dims["top_k"], dims["moe_ffn"]
    tp_degree, ep, shards, settings = degrees.tp_degree, degrees.ep_degree, degrees.sequence_shards, degrees.moe
    routed_tokens = tokens * top_k
    imbalance = degrees.moe_imbalance if ep > 1 else 1.0
    if settings.dispatcher == "alltoall":  # each rank routes its sequence shard; the tp gather brings the group's
        expert_rows = moe.expert_rows(tokens / tp_degree, top_k, experts, settings, imbalance=imbalance,
                                      sources=tp_degree)
    else:
        expert_rows = moe.expert_rows(tokens, top_k, experts, settings, imbalance=imbalance)
    experts_hit = experts / ep * (1.0 - (1.0 - top_k / experts) ** (tokens * ep))
    common = {"activation": dims["activation"], "bias": False, "tp_degree": tp_degree}
    routed = _mlp("expert_", "dispatched", expert_rows, hidden, moe_ffn, hidden, copies=experts,
                  copies_read=experts_hit, copies_per_token=top_k, routed=True, **common)
    shared = []
    if dims["shared_experts"] > 0:  # a tensor-parallel MLP beside the experts, reduced as a dense block's
        shared = [*_mlp("shared_", "x_norm2", tokens, hidden, dims["shared_experts"] * moe_ffn, hidden,
                        input_shards=shards, **common), all_reduce(tokens * hidden, tp_degree=tp_degree)]
    exchange = moe.exchange_elems(expert_rows, hidden, dispatcher=settings.dispatcher, tp=tp_degree, ep=ep)
    gathers = moe.dispatcher_gathers(tokens, hidden, expert_rows, dispatcher=settings.dispatcher, tp=tp_degree, ep=ep)
    counts = moe.count_exchange(experts, settings, tp=tp_degree, ep=ep, dtype_bytes=trainer.dtype_bytes)
    scores = tokens * experts / shards
    permuted, unpermuted = moe.permutation_elems(tokens, top_k, hidden, dispatcher=settings.dispatcher, ep=ep,
                                                 shards=shards, rows=expert_rows)
    pieces = [
        *_decoder_attention(dims, mb, degrees, trainer),
        _norm("x_mid", tokens, hidden, layernorm=False, shards=shards),
        matmul("x_norm2", tokens, hidden, experts, split="replicated", tp_degree=tp_degree, input_shards=shards),
        pointwise(scores, 2.0 * routed_tokens / shards, _SOFTMAX_FLOPS_PER_ELEM * scores,  # scores and top-k
                  saved=(("router_scores", scores),), kernels=ROUTER_KERNELS, fused_kernels=ONE_EACH),
        pointwise(scores, experts, 2.0 * scores, kernels=AUX_LOSS_KERNELS),  # the load-balancing loss
        _index(pointwise(permuted.read, permuted.write, 0.0, kernels=PERMUTE_KERNELS, fused_kernels=ONE_EACH),
               permuted),  # into expert order
        Piece(group_collectives=counts),  # the per-expert token counts, exchanged before the dispatch
        all_to_all(exchange, ep_degree=ep),  # dispatch
        Piece(group_collectives=gathers),  # the dispatcher's gathers (and the combine's reduce-scatters)
        *routed,
        all_to_all(exchange, ep_degree=ep),  # combine
        _index(pointwise(unpermuted.read, unpermuted.write, 2.0 * routed_tokens * hidden / shards,
                         saved=(("expert_out", routed_tokens * hidden / shards),),  # weighted sum into token order
                         kernels=UNPERMUTE_KERNELS, fused_kernels=ONE_EACH), unpermuted),
        *shared,
        *_after_mlp(dims, mb, tokens, shards),
    ]
    return Layer(tuple(pieces), boundary_elems=tokens * hidden / shards)


def _index(piece: Piece, traffic: moe.Traffic) -> Piece:
    """A token-permutation piece as the index kernels it runs (:attr:`~mpipe_tune.cost._arch_pieces.Piece.index`),
    its backward traffic where ``traffic`` counts it."""
    if traffic.backward is None:
        return replace(piece, index=True)
    return replace(piece, index=True, dgrad_elems=traffic.backward)


def _patches(dims: Mapping[str, Any], mb: Microbatch) -> int:
    return mb.image_tokens * dims["merge_factor"]


def _vit_block(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees) -> Layer:
    tp_degree, shards = degrees.tp_degree, degrees.sequence_shards
    encoder = LayerDegrees(tp_degree, sequence_parallel=degrees.sequence_parallel)  # no context parallelism
    hidden, heads = dims["hidden"], dims["heads"]
    patches = _patches(dims, mb)
    seq_lens = [tokens * dims["merge_factor"] for tokens in mb.image_sizes()]
    bias = dims["bias"]
    attn = vit_variants(dims, _gqa({**dims, "kv_heads": heads}, patches, seq_lens, encoder, qkv_bias=bias,
                                   out_bias=bias), mb, seq_lens, tp_degree, norm=_norm)
    mlp = _mlp("", "x_norm2", patches, hidden, dims["ffn"], hidden, activation=dims["activation"], bias=bias,
               tp_degree=tp_degree, input_shards=shards)
    pieces = [
        _norm("x", patches, hidden, layernorm=True, shards=shards),
        *attn,
        all_reduce(patches * hidden, tp_degree=tp_degree),
        _residual_add(patches, hidden, shards=shards),
        _norm("x_mid", patches, hidden, layernorm=True, shards=shards),
        *mlp,
        all_reduce(patches * hidden, tp_degree=tp_degree),
        _residual_add(patches, hidden, shards=shards),
    ]
    return Layer(tuple(pieces), boundary_elems=patches * hidden / shards)


def _patch_embed(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees) -> Layer:
    tp_degree = degrees.tp_degree
    hidden, patches = dims["hidden"], _patches(dims, mb)
    patch_elems = dims["in_channels"] * dims["patch_size"] ** 2 * dims["temporal_patch"]
    pieces = [matmul("pixels", patches, patch_elems, hidden, split="replicated", tp_degree=tp_degree,
                     bias=dims["bias"])]
    if dims["positions"] > 0:  # learned absolute position table, added to every patch
        pieces.append(pointwise(2.0 * patches * hidden, patches * hidden, patches * hidden,
                                params=dims["positions"] * hidden, param_tensors=1))
    return Layer(tuple(pieces), boundary_elems=patches * hidden)


def _merger(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees) -> Layer:
    """Qwen2-VL's PatchMerger: LayerNorm per patch, concatenate ``merge_factor`` neighbours, 2-layer MLP."""
    tp_degree = degrees.tp_degree
    hidden, merge, out = dims["hidden"], dims["merge_factor"], dims["out_hidden"]
    tokens = mb.image_tokens
    mlp = _mlp("", "x_norm", tokens, hidden * merge, hidden * merge, out, activation="gelu", bias=True,
               tp_degree=tp_degree)
    pieces = [_norm("x", _patches(dims, mb), hidden, layernorm=True), *mlp,
              all_reduce(tokens * out, tp_degree=tp_degree)]
    return Layer(tuple(pieces), boundary_elems=tokens * out)


def _projector(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees) -> Layer:
    tp_degree = degrees.tp_degree
    tokens, in_hidden, hidden = mb.image_tokens, dims["in_hidden"], dims["hidden"]
    norm = projector_norm(dims, mb, norm=_norm)
    if dims["depth"] == 1:
        pieces = [*norm, matmul("x", tokens, in_hidden, hidden, split="replicated", tp_degree=tp_degree, bias=True)]
    else:
        ffn = dims["ffn"] or hidden
        pieces = [*norm, *_mlp("", "x", tokens, in_hidden, ffn, hidden, activation=dims["activation"], bias=True,
                               tp_degree=tp_degree),
                  all_reduce(tokens * hidden, tp_degree=tp_degree)]
    return Layer(tuple(pieces), boundary_elems=tokens * hidden)


def _embedding(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees) -> Layer:
    tp_degree = degrees.tp_degree
    tokens, hidden = _local_text_tokens(mb, degrees), dims["hidden"]
    pieces = [lookup(tokens, dims["vocab"], hidden, tp_degree=tp_degree),
              all_reduce(tokens * hidden, tp_degree=tp_degree)]  # vocab-parallel: each rank holds some rows
    return Layer(tuple(pieces), boundary_elems=tokens * hidden / degrees.sequence_shards)


def vocab_parallel_loss(tokens: float, logits_elems: float, *, dtype_bytes: int, tp_degree: int,
                        fused: bool = False) -> list[Piece]:
    """Megatron-LM's vocab-parallel cross-entropy over a rank's ``logits_elems`` logits of ``tokens``
    tokens, in the step's elements (``dtype_bytes`` wide) as every piece counts them; ``fused``: its
    fused form (``cross_entropy_loss_fusion``).

    The logits are cast to fp32 first (``logits.float()``, language_module.py line 36 at core_v0.6.0;
    no kernel for an fp32 step) and the loss runs in fp32: its passes over every logit are
    :data:`LOSS_FWD_PASSES` and :data:`LOSS_BWD_PASSES` (fused: :data:`FUSED_LOSS_FWD_PASSES`,
    :data:`FUSED_LOSS_BWD_PASSES`), and the gradient goes back to the dtype. It keeps the fp32 softmax
    for the backward, and its three per-token all-reduces (the max, the target logit, the sum of
    exponentials) move fp32. Per logit of a bf16 step: 38 bytes forward and 14 backward, fused 22 and 6.

    >>> [p.fwd_elems for p in vocab_parallel_loss(0, 1, dtype_bytes=2, tp_degree=1)][:1]
    [19.0]
    """
    cast_bytes = 0 if dtype_bytes == LOSS_BYTES else dtype_bytes + LOSS_BYTES  # read one width, write the other
    fwd_passes, bwd_passes = (FUSED_LOSS_FWD_PASSES, FUSED_LOSS_BWD_PASSES) if fused else (
        LOSS_FWD_PASSES, LOSS_BWD_PASSES)
    if fused:  # the cast and the max are one kernel (an fp32 step: the max reads); the backward writes the dtype
        fwd_bytes = (cast_bytes or LOSS_BYTES) + LOSS_BYTES * sum(fwd_passes)
        bwd_bytes = LOSS_BYTES * sum(bwd_passes) + dtype_bytes
    else:
        fwd_bytes = cast_bytes + LOSS_BYTES * sum(fwd_passes)
        bwd_bytes = LOSS_BYTES * sum(bwd_passes) + cast_bytes
    wide = LOSS_BYTES / dtype_bytes  # one fp32 element, in the dtype's elements
    cast = 0.0 if dtype_bytes == LOSS_BYTES else 1.0
    target = 2.0  # the target logit's gather and the per-token loss
    if fused:  # the cast runs inside the first kernel; the backward writes the dtype
        kernels = (len(fwd_passes) + target, len(bwd_passes) + 1.0, 0.0)
    else:  # the one-hot subtraction, then the cast back
        kernels = (cast + len(fwd_passes) + target, len(bwd_passes) + 1.0 + cast, 0.0)
    return [
        Piece(
            fwd_flops=_SOFTMAX_FLOPS_PER_ELEM * logits_elems,
            fwd_elems=logits_elems * fwd_bytes / dtype_bytes + tokens * wide,  # and the per-token loss
            dgrad_flops=logits_elems,
            dgrad_elems=logits_elems * bwd_bytes / dtype_bytes + tokens * wide,
            saved=(("softmax", logits_elems * wide),),
            kernels=kernels,
        ),
        all_reduce(_CROSS_ENTROPY_REDUCTIONS * tokens * wide, tp_degree=tp_degree),
    ]


def _lm_head(dims: Mapping[str, Any], mb: Microbatch, degrees: LayerDegrees, trainer: _Trainer) -> Layer:
    """Final norm, vocab-parallel logits and the fp32 cross-entropy; the loss goes nowhere, so no boundary."""
    tp_degree = degrees.tp_degree
    tokens, hidden, vocab = _local_text_tokens(mb, degrees), dims["hidden"], dims["vocab"]
    pieces = [
        _norm("x", tokens, hidden, layernorm=False, shards=degrees.sequence_shards),
        matmul("x_norm", tokens, hidden, vocab, split="column", tp_degree=tp_degree),
        *vocab_parallel_loss(tokens, tokens * vocab / tp_degree, dtype_bytes=trainer.dtype_bytes, tp_degree=tp_degree,
                             fused=trainer.fused_loss),
    ]
    return Layer(tuple(pieces), boundary_elems=0.0)


_BUILDERS: dict[str, Callable[[Mapping[str, Any], Microbatch, LayerDegrees], Layer]] = {
    "embedding": _embedding,
    "vit_block": _vit_block,
    "patch_embed": _patch_embed,
    "merger": _merger,
    "projector": _projector,
    "pixel_shuffle": pixel_shuffle,
}
_TRAINER_BUILDERS: dict[str, Callable[[Mapping[str, Any], Microbatch, LayerDegrees, _Trainer], Layer]] = {
    "dense_block": _dense_block,
    "moe_block": _moe_block,
    "lm_head": _lm_head,
}
"""The kinds whose kernels depend on the step's dtype and the trainer's fusions (RoPE, the loss)."""
