"""One plain torch module per model layer, built from the layer's architecture dimensions.

Every module is called as ``module(x, inputs)``: ``x`` is the previous layer's output (``None`` for
the first layer) and ``inputs`` the microbatch's :class:`~mpipe_tune.runtime._data.MicrobatchInputs`
(image sizes, pixels, token ids, targets). Shapes follow :mod:`mpipe_tune.runtime._blueprint`.

Modelling choices, kept simple because the runtime checks schedules, not model quality:
ViT blocks are pre-LayerNorm with full attention inside each image and no 2D RoPE; decoder blocks
are pre-RMSNorm with causal attention, grouped-query (``attention: gqa``) or DeepSeek's multi-head
latent attention (``attention: mla``), both without RoPE rotation; MoE blocks route each token to
its ``top_k`` experts by softmax scores (experts run one after another, or sharded over an
expert-parallel group with all-to-all dispatch and combine, :mod:`~mpipe_tune.runtime._experts`); the
LM head is a final RMSNorm, the vocabulary projection and the mean cross-entropy over the sequence.

Parameters are initialised from a generator seeded by (seed, layer index), so every rank and the
single-process reference hold identical weights for a layer. With a tensor-parallel mesh, each rank
builds the whole layer and :func:`~mpipe_tune.runtime._tensor_parallel.parallelize_layer` then keeps
its shards; modules read their local head counts from the local tensor shapes, so the same code
runs whole and split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mpipe_tune.runtime._blueprint import CONTEXT_PARALLEL_KINDS, LayerSpec
from mpipe_tune.runtime._data import MicrobatchInputs, seed_of
from mpipe_tune.runtime._experts import ExpertShard, route_local, route_parallel
from mpipe_tune.runtime._ring_attention import Ring, RingCall, ring_attention
from mpipe_tune.runtime._tensor_parallel import parallelize_layer
from mpipe_tune.runtime._variants import (
    DeepstackMerger, PixelShuffle, RMSNorm, SideCarry, is_variant_attention, variant_attention,
)


class MLP(nn.Module):
    def __init__(self, width: int, ffn: int, out: int, *, activation: str, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, ffn, bias=bias)
        self.gate = nn.Linear(width, ffn, bias=bias) if activation in ("swiglu", "geglu") else None
        self.activation = activation
        self.down = nn.Linear(ffn, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            gate = F.silu(self.gate(x)) if self.activation == "swiglu" else F.gelu(self.gate(x), approximate="tanh")
            return self.down(gate * self.up(x))
        return self.down(F.gelu(self.up(x)))


class RepeatHeads(nn.Module):
    """Key/value heads repeated for the query heads that share them: ``[tokens, kv_heads, dim]`` ->
    ``[tokens, kv_heads * group, dim]``, each head ``group`` times in a row (the grouped-query pairing).

    Weightless; it is a module so that a tensor-parallel plan can make it the point where a rank whose
    keys and values are replicated keeps the heads of its own query heads.
    """

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = x.shape
        return x.unsqueeze(2).expand(tokens, heads, self.group, dim).reshape(tokens, heads * self.group, dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, ring: RingCall | None = None,
            repeats: int = 1) -> torch.Tensor:
    """Scaled dot-product attention of ``[tokens, heads, dim]`` q, k, v; ``[tokens, heads * v_dim]``.

    With a ``ring`` (context parallelism) the rows are this rank's share of the sequence and the
    attention is causal ring attention (:mod:`~mpipe_tune.runtime._ring_attention`); k and v travel
    with one copy of each of their heads (``repeats``: consecutive copies of a head in k and v).

    The inputs go in as one batch of four dimensions: torch's fused CPU kernel (flash attention)
    takes only that shape; on three dimensions it falls back to the math path, which keeps the full
    ``tokens x tokens`` scores per head for the backward (3.3 GB for 8,192 tokens and 4 heads, against
    0.26 GB fused), and a ViT's long image sequences ran out of memory."""
    if ring is not None:
        assert causal, "context parallelism splits decoder sequences only"
        rows = ring.ring.split.rows(ring.num_tokens)  # beyond them: sequence parallelism's padding rows
        y = ring_attention(q[:rows], k[:rows, ::repeats], v[:rows, ::repeats], ring.ring, ring.num_tokens,
                           q.shape[-1] ** -0.5)
        return F.pad(y, (0, 0, 0, q.shape[0] - rows))
    y = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=causal)
    return y.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)


class Attention(nn.Module):
    """Multi-head or grouped-query attention over one sequence ``[tokens, width]``."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, *, qkv_bias: bool, out_bias: bool) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(width, heads * head_dim, bias=qkv_bias)
        self.k = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
        self.v = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
        self.kv_repeat = RepeatHeads(heads // kv_heads)
        self.out = nn.Linear(heads * head_dim, width, bias=out_bias)

    def forward(self, x: torch.Tensor, *, causal: bool, ring: RingCall | None = None) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q(x).view(tokens, -1, self.head_dim)
        k = self.kv_repeat(self.k(x).view(tokens, -1, self.head_dim))
        v = self.kv_repeat(self.v(x).view(tokens, -1, self.head_dim))
        # a rank's heads hold runs of kv_repeat.group copies of a key head (all copies of one when tp
        # splits fewer key heads than ranks)
        repeats = min(self.kv_repeat.group, q.shape[1])
        return self.out(_attend(q, k, v, causal=causal, ring=ring, repeats=repeats))


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA), causal, over one sequence ``[tokens, hidden]``.

    q: ``hidden`` -> (down-projection to ``q_lora_rank``, RMSNorm, if ``q_lora_rank`` is set) ->
    ``heads * (qk_nope_head_dim + qk_rope_head_dim)``. kv: ``hidden`` -> ``kv_lora_rank +
    qk_rope_head_dim``; the latent part is RMSNormed and up-projected to ``heads * (qk_nope_head_dim +
    v_head_dim)`` (each head's no-position key and value), the rope part is one key shared by every
    head. Scores are scaled by ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``; the output projection
    maps ``heads * v_head_dim`` back to ``hidden``. No biases, and no RoPE rotation of the rope parts
    (the runtime skips RoPE for GQA too): they are plain extra query/key features.
    """

    def __init__(self, d: dict) -> None:
        super().__init__()
        hidden, heads, q_lora, kv_lora = d["hidden"], d["heads"], d["q_lora_rank"], d["kv_lora_rank"]
        self.nope, self.rope, self.v_dim = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        self.kv_lora = kv_lora
        self.q_down = nn.Linear(hidden, q_lora, bias=False) if q_lora else None
        self.q_norm = RMSNorm(q_lora) if q_lora else None
        self.q_up = nn.Linear(q_lora or hidden, heads * (self.nope + self.rope), bias=False)
        self.kv_down = nn.Linear(hidden, kv_lora + self.rope, bias=False)
        self.kv_norm = RMSNorm(kv_lora)
        self.kv_up = nn.Linear(kv_lora, heads * (self.nope + self.v_dim), bias=False)
        self.rope_repeat = RepeatHeads(heads)
        self.out = nn.Linear(heads * self.v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, *, causal: bool, ring: RingCall | None = None) -> torch.Tensor:
        tokens = x.shape[0]
        q_in = x if self.q_down is None else self.q_norm(self.q_down(x))
        q = self.q_up(q_in).view(tokens, -1, self.nope + self.rope)
        latent, k_rope = self.kv_down(x).split([self.kv_lora, self.rope], dim=-1)
        k_nope, v = self.kv_up(self.kv_norm(latent)).view(tokens, -1, self.nope + self.v_dim).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, self.rope_repeat(k_rope.unsqueeze(1))], dim=-1)
        return self.out(_attend(q, k, v, causal=causal, ring=ring))


class Rows(nn.Module):
    """Weightless identity: the point where a sequence-parallel plan gathers a layer's rows into the
    whole sequence (``gather``) or keeps a rank's rows of it (``keep_rows``); nothing without one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PatchEmbed(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merge = d["merge_factor"]
        self.patch_elems = d["in_channels"] * d["patch_size"] ** 2 * d["temporal_patch"]
        self.proj = nn.Linear(self.patch_elems, d["hidden"], bias=d["bias"])
        self.positions = nn.Parameter(torch.randn(d["positions"], d["hidden"]) * 0.02) if d["positions"] else None
        self.pad_to = 1
        """Sequence parallelism's tp degree: the patches are padded to a multiple of it (:func:`pad_rows`)."""

    def forward(self, x: None, inputs: MicrobatchInputs) -> torch.Tensor:
        y = self.proj(inputs.pixels(self.patch_elems, self.merge))
        if self.positions is not None:
            index = torch.cat([torch.arange(n * self.merge) for n in inputs.image_sizes] or [torch.zeros(0, dtype=torch.long)])
            y = y + self.positions[index.to(y.device) % self.positions.shape[0]]
        return pad_rows(y, self.pad_to)


class VitBlock(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merge = d["merge_factor"]
        self.norm1 = nn.LayerNorm(d["hidden"])
        self.attn = Attention(d["hidden"], d["heads"], d["heads"], d["head_dim"], qkv_bias=d["bias"], out_bias=d["bias"])
        self.norm2 = nn.LayerNorm(d["hidden"])
        self.mlp = MLP(d["hidden"], d["ffn"], d["hidden"], activation=d["activation"], bias=d["bias"])
        self.window = d["window"]
        self.scale1 = nn.Parameter(torch.full((d["hidden"],), 0.1)) if d["layer_scale"] else None
        self.scale2 = nn.Parameter(torch.full((d["hidden"],), 0.1)) if d["layer_scale"] else None
        self.gather, self.keep_rows = Rows(), Rows()
        self.pad_to = 1
        """Sequence parallelism's tp degree: the patches arrive padded to a multiple of it."""

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        """Attention inside each image (one call per image), then the MLP. With sequence parallelism
        ``x`` is this rank's rows: they are gathered for the attention (the padding rows left out)
        and the rank keeps its rows of the result."""
        h = self.gather(self.norm1(x))
        sizes = [n * self.merge for n in inputs.image_sizes]
        if self.window is not None:  # consecutive windows of `window` patches inside each image
            sizes = [min(self.window, n - start) for n in sizes for start in range(0, n, self.window)]
        patches = h[:sum(sizes)]
        attended = [self.attn(part, causal=False) for part in torch.split(patches, sizes)] if sizes else [patches]
        branch = self.keep_rows(pad_rows(torch.cat(attended), self.pad_to))
        x = x + (branch if self.scale1 is None else branch * self.scale1)
        branch = self.mlp(self.norm2(x))
        return x + (branch if self.scale2 is None else branch * self.scale2)


class Merger(nn.Module):
    """LayerNorm per patch, then ``merge_factor`` neighbouring patches concatenated into one token."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merge = d["merge_factor"]
        self.merged = d["hidden"] * d["merge_factor"]
        self.norm = nn.LayerNorm(d["hidden"])
        self.mlp = MLP(self.merged, self.merged, d["out_hidden"], activation="gelu", bias=True)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        patches = sum(inputs.image_sizes) * self.merge  # less sequence parallelism's padding rows, if any
        return self.mlp(self.norm(x[:patches]).reshape(-1, self.merged))


class Projector(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d["in_hidden"]) if d["norm"] else nn.Identity()
        if d["depth"] == 1:
            self.net = nn.Linear(d["in_hidden"], d["hidden"])
        else:
            self.net = MLP(d["in_hidden"], d["ffn"] or d["hidden"], d["hidden"], activation=d["activation"], bias=True)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        return self.net(self.norm(x))


class Embedding(nn.Module):
    """Token embedding of the text, with the image tokens (if any) in front of the sequence; with a
    ring (context parallelism) only this rank's positions of it."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        self.vocab = d["vocab"]
        self.table = nn.Embedding(d["vocab"], d["hidden"])
        self.ring: Ring | None = None
        self.pad_to = 1
        """Sequence parallelism's tp degree: the rows are padded to a multiple of it (see :func:`pad_rows`)."""

    def forward(self, x: torch.Tensor | None, inputs: MicrobatchInputs) -> torch.Tensor:
        ids = inputs.token_ids(self.vocab)
        if self.ring is not None:
            y = self._own_positions(x, ids)
        elif x is None or x.shape[0] == 0:
            y = self.table(ids)
        else:
            y = torch.cat([x, self.table(ids[x.shape[0]:])])
        return pad_rows(y, self.pad_to)

    def _own_positions(self, x: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sequence: an image token's features where its position is one, the
        text embedding elsewhere (the text table is looked up at the image positions too, and their
        rows discarded: their gradient there is zero)."""
        positions = torch.tensor(self.ring.split.positions(ids.shape[0]), dtype=torch.long, device=ids.device)
        y = self.table(ids[positions])
        if x is None or x.shape[0] == 0:
            return y
        image = (positions < x.shape[0]).unsqueeze(-1)
        return torch.where(image, x[positions.clamp(max=x.shape[0] - 1)], y)


class DecoderBlock(nn.Module):
    """Pre-RMSNorm causal attention (GQA or MLA) and a dense MLP (``dense_block``) or routed experts
    (``moe_block``)."""

    def __init__(self, d: dict, *, moe: bool) -> None:
        super().__init__()
        hidden = d["hidden"]
        self.norm1 = RMSNorm(hidden)
        if d["attention"] == "mla":
            self.attn = LatentAttention(d)
        elif is_variant_attention(d):
            self.attn = variant_attention(d)
        else:
            self.attn = Attention(hidden, d["heads"], d["kv_heads"], d["head_dim"], qkv_bias=d["qkv_bias"], out_bias=False)
        self.norm2 = RMSNorm(hidden)
        self.post_attn = RMSNorm(hidden) if d["post_norms"] else nn.Identity()
        self.post_mlp = RMSNorm(hidden) if d["post_norms"] else nn.Identity()
        self.ring: Ring | None = None
        if moe:
            self.mlp = MoE(d)
        else:
            self.mlp = MLP(hidden, d["ffn"], hidden, activation=d["activation"], bias=False)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        ring = None if self.ring is None else RingCall(self.ring, inputs.mb.text_tokens)
        x = x + self.post_attn(self.attn(self.norm1(x), causal=True, ring=ring))
        return x + self.post_mlp(self.mlp(self.norm2(x)))


class MoE(nn.Module):
    """The router, the routed experts (keyed by expert number: ``experts.<e>``) and the shared experts."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        hidden, ffn = d["hidden"], d["moe_ffn"]
        self.top_k = d["top_k"]
        self.num_experts = d["experts"]
        self.router = nn.Linear(hidden, d["experts"], bias=False)
        self.experts = RoutedExperts(
            {str(e): MLP(hidden, ffn, hidden, activation=d["activation"], bias=False) for e in range(d["experts"])}
        )
        shared = d["shared_experts"]
        self.shared = MLP(hidden, shared * ffn, hidden, activation=d["activation"], bias=False) if shared else None
        self.shard: ExpertShard | None = None

    def keep_experts(self, shard: ExpertShard) -> None:
        """Keep only the experts ``shard`` holds; the forward then dispatches over its group."""
        mine = {str(e) for e in shard.experts(self.num_experts)}
        for key in [k for k in self.experts if k not in mine]:
            del self.experts[key]
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        out = self.experts(x, weights, chosen, self.num_experts, self.shard)
        return out if self.shared is None else out + self.shared(x)


class RoutedExperts(nn.ModuleDict):
    """A MoE layer's routed experts, keyed by expert number; called with the router's choices it runs
    them (:mod:`~mpipe_tune.runtime._experts`). One module call per layer call, so that the experts can
    be one FSDP unit of their own (:mod:`~mpipe_tune.runtime._full_shard`)."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, num_experts: int,
                shard: ExpertShard | None) -> torch.Tensor:
        if shard is None:
            return route_local(x, weights, chosen, self)
        return route_parallel(x, weights, chosen, self, num_experts, shard)


class LMHead(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.vocab = d["vocab"]
        self.norm = RMSNorm(d["hidden"])
        self.proj = nn.Linear(d["hidden"], d["vocab"], bias=False)
        self.ring: Ring | None = None
        self.pad_to = 1
        """Sequence parallelism's tp degree: the rows arrive padded to a multiple of it."""

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        """The mean cross-entropy over the sequence (a scalar). Split by vocabulary, the logits are a
        DTensor and the loss is vocab-parallel: see :func:`~mpipe_tune.runtime._tensor_parallel.tp_context`.
        With a ring (context parallelism) this rank's share of it: the sum over its positions divided
        by the whole sequence's length, so that the ring's shares add up to the mean. Padding rows
        (sequence parallelism) have the ignored target: they add nothing to the loss or its count."""
        logits = self.proj(self.norm(x))
        targets = inputs.targets(self.vocab)
        if self.ring is None:
            return F.cross_entropy(logits, _pad_targets(targets, self.pad_to))
        positions = torch.tensor(self.ring.split.positions(targets.shape[0]), dtype=torch.long, device=targets.device)
        own = _pad_targets(targets[positions], self.pad_to)
        return F.cross_entropy(logits, own, reduction="sum") / targets.shape[0]


_IGNORED = -100
"""The target cross-entropy skips (torch's default ``ignore_index``)."""


def pad_rows(y: torch.Tensor, multiple: int) -> torch.Tensor:
    """``y`` with zero rows appended up to a multiple of ``multiple`` (sequence parallelism's even
    shards). The padding sits after the sequence's last token, so causal attention never shows it to
    a real token, the loss ignores it (:class:`LMHead`), and every row-wise layer computes it apart:
    its rows' output gradient is zero, so it adds exactly nothing to any gradient."""
    extra = -y.shape[0] % multiple
    return F.pad(y, (0, 0, 0, extra)) if extra else y


def _pad_targets(targets: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -targets.shape[0] % multiple
    return F.pad(targets, (0, extra), value=_IGNORED) if extra else targets


_MODULES = {
    "patch_embed": PatchEmbed,
    "vit_block": VitBlock,
    "merger": Merger,
    "projector": Projector,
    "pixel_shuffle": PixelShuffle,
    "embedding": Embedding,
    "dense_block": lambda d: DecoderBlock(d, moe=False),
    "moe_block": lambda d: DecoderBlock(d, moe=True),
    "lm_head": LMHead,
}


def _with_side_features(module: nn.Module, spec: LayerSpec) -> nn.Module:
    """``module`` inside a :class:`~mpipe_tune.runtime._variants.SideCarry` where it takes, makes, adds or passes on
    DeepStack features (Qwen3-VL), else ``module`` itself."""
    d = dict(spec.dims)
    tap_width, inject = d.get("deepstack_out"), d["hidden"] if d.get("deepstack_in") else 0
    if not (spec.side_in or d.get("side_width") or tap_width or inject):
        return module
    tap = DeepstackMerger(d["hidden"] * d["merge_factor"], tap_width) if tap_width else None
    in_width = d["in_hidden"] if spec.kind == "projector" else d["hidden"]
    if spec.kind == "embedding":
        in_width = d["hidden"]  # the image tokens it receives are as wide as the sequence
    return SideCarry(module, in_width=in_width, side_in=spec.side_in, side_out=d.get("side_width", 0), tap=tap,
                     inject=inject)


def build_layer(spec: LayerSpec, *, seed: int, dtype: torch.dtype, device: torch.device,
                tp_mesh: DeviceMesh | None = None, expert_shard: ExpertShard | None = None,
                ring: Ring | None = None, sequence_parallel: bool = False) -> nn.Module:
    """The module of one model layer, initialised deterministically from (seed, layer index).

    With a ``tp_mesh`` of more than one rank the whole layer is built (the same weights on every rank)
    and then split over the mesh by :func:`~mpipe_tune.runtime._tensor_parallel.parallelize_layer`;
    with an ``expert_shard`` a MoE layer keeps only that rank's routed experts; with a ``ring`` a
    decoder layer (:data:`CONTEXT_PARALLEL_KINDS`) holds this rank's share of the sequence; with
    ``sequence_parallel`` (and a ``tp_mesh``) a decoder layer takes and gives its tensor-parallel
    rank's rows of the sequence, padded to a multiple of the tp degree (:func:`pad_rows`).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_of("layer", seed, spec.index))
        module = _with_side_features(_MODULES[spec.kind](dict(spec.dims)), spec)
    if expert_shard is not None and spec.kind == "moe_block":
        module.mlp.keep_experts(expert_shard)
    if ring is not None and spec.kind in CONTEXT_PARALLEL_KINDS:
        module.ring = ring
    module.to(dtype=dtype, device=device)
    module.requires_grad_(spec.trainable)
    if tp_mesh is not None and tp_mesh.size() > 1:
        if sequence_parallel and spec.kind in ("patch_embed", "vit_block", "embedding", "lm_head"):
            module.pad_to = tp_mesh.size()
        parallelize_layer(module, spec, tp_mesh, sequence_parallel=sequence_parallel)
    return module
