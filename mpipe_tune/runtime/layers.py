"""One plain torch module per model layer, built from the layer's architecture dimensions.

Every module is called as ``module(x, inputs)``: ``x`` is the previous layer's output (``None`` for
the first layer) and ``inputs`` the microbatch's :class:`~mpipe_tune.runtime.data.MicrobatchInputs`
(image sizes, pixels, token ids, targets). Shapes follow :mod:`mpipe_tune.runtime.blueprint`.

Modelling choices, kept simple because the runtime checks schedules, not model quality:
ViT blocks are pre-LayerNorm with full attention inside each image and no 2D RoPE; decoder blocks
are pre-RMSNorm with causal grouped-query attention and no RoPE; MoE blocks route each token to its
``top_k`` experts by softmax scores (experts run one after another, no expert parallelism); the LM
head is a final RMSNorm, the vocabulary projection and the mean cross-entropy over the sequence.

Parameters are initialised from a generator seeded by (seed, layer index), so every rank and the
single-process reference hold identical weights for a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpipe_tune.runtime.blueprint import LayerSpec
from mpipe_tune.runtime.data import MicrobatchInputs, seed_of


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, width: int, ffn: int, out: int, *, activation: str, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, ffn, bias=bias)
        self.gate = nn.Linear(width, ffn, bias=bias) if activation == "swiglu" else None
        self.down = nn.Linear(ffn, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Multi-head or grouped-query attention over one sequence ``[tokens, width]``."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, *, qkv_bias: bool, out_bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(width, heads * head_dim, bias=qkv_bias)
        self.k = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
        self.v = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
        self.out = nn.Linear(heads * head_dim, width, bias=out_bias)

    def forward(self, x: torch.Tensor, *, causal: bool) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q(x).view(tokens, self.heads, self.head_dim).transpose(0, 1)
        k = self.k(x).view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v(x).view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=0)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(0, 1).reshape(tokens, self.heads * self.head_dim))


class PatchEmbed(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merge = d["merge_factor"]
        self.patch_elems = d["in_channels"] * d["patch_size"] ** 2 * d["temporal_patch"]
        self.proj = nn.Linear(self.patch_elems, d["hidden"], bias=d["bias"])
        self.positions = nn.Parameter(torch.randn(d["positions"], d["hidden"]) * 0.02) if d["positions"] else None

    def forward(self, x: None, inputs: MicrobatchInputs) -> torch.Tensor:
        y = self.proj(inputs.pixels(self.patch_elems, self.merge))
        if self.positions is not None:
            index = torch.cat([torch.arange(n * self.merge) for n in inputs.image_sizes] or [torch.zeros(0, dtype=torch.long)])
            y = y + self.positions[index.to(y.device) % self.positions.shape[0]]
        return y


class VitBlock(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merge = d["merge_factor"]
        self.norm1 = nn.LayerNorm(d["hidden"])
        self.attn = Attention(d["hidden"], d["heads"], d["heads"], d["head_dim"], qkv_bias=d["bias"], out_bias=d["bias"])
        self.norm2 = nn.LayerNorm(d["hidden"])
        self.mlp = MLP(d["hidden"], d["ffn"], d["hidden"], activation=d["activation"], bias=d["bias"])

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        h = self.norm1(x)
        sizes = [n * self.merge for n in inputs.image_sizes]
        attended = [self.attn(part, causal=False) for part in torch.split(h, sizes)] if sizes else [h]
        x = x + torch.cat(attended)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """LayerNorm per patch, then ``merge_factor`` neighbouring patches concatenated into one token."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merged = d["hidden"] * d["merge_factor"]
        self.norm = nn.LayerNorm(d["hidden"])
        self.mlp = MLP(self.merged, self.merged, d["out_hidden"], activation="gelu", bias=True)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        return self.mlp(self.norm(x).reshape(-1, self.merged))


class Projector(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        if d["depth"] == 1:
            self.net = nn.Linear(d["in_hidden"], d["hidden"])
        else:
            self.net = MLP(d["in_hidden"], d["ffn"] or d["hidden"], d["hidden"], activation="gelu", bias=True)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        return self.net(x)


class Embedding(nn.Module):
    """Token embedding of the text, with the image tokens (if any) in front of the sequence."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        self.vocab = d["vocab"]
        self.table = nn.Embedding(d["vocab"], d["hidden"])

    def forward(self, x: torch.Tensor | None, inputs: MicrobatchInputs) -> torch.Tensor:
        ids = inputs.token_ids(self.vocab)
        if x is None or x.shape[0] == 0:
            return self.table(ids)
        return torch.cat([x, self.table(ids[x.shape[0]:])])


class DecoderBlock(nn.Module):
    """Pre-RMSNorm causal attention and a dense MLP (``dense_block``) or routed experts (``moe_block``)."""

    def __init__(self, d: dict, *, moe: bool) -> None:
        super().__init__()
        hidden = d["hidden"]
        self.norm1 = RMSNorm(hidden)
        self.attn = Attention(hidden, d["heads"], d["kv_heads"], d["head_dim"], qkv_bias=d["qkv_bias"], out_bias=False)
        self.norm2 = RMSNorm(hidden)
        if moe:
            self.mlp = MoE(d)
        else:
            self.mlp = MLP(hidden, d["ffn"], hidden, activation=d["activation"], bias=False)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), causal=True)
        return x + self.mlp(self.norm2(x))


class MoE(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        hidden, ffn = d["hidden"], d["moe_ffn"]
        self.top_k = d["top_k"]
        self.router = nn.Linear(hidden, d["experts"], bias=False)
        self.experts = nn.ModuleList(
            MLP(hidden, ffn, hidden, activation=d["activation"], bias=False) for _ in range(d["experts"])
        )
        shared = d["shared_experts"]
        self.shared = MLP(hidden, shared * ffn, hidden, activation=d["activation"], bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * weights[token, slot].unsqueeze(-1))
        return out if self.shared is None else out + self.shared(x)


class LMHead(nn.Module):
    def __init__(self, d: dict) -> None:
        super().__init__()
        self.vocab = d["vocab"]
        self.norm = RMSNorm(d["hidden"])
        self.proj = nn.Linear(d["hidden"], d["vocab"], bias=False)

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        logits = self.proj(self.norm(x))
        return F.cross_entropy(logits, inputs.targets(self.vocab))


_MODULES = {
    "patch_embed": PatchEmbed,
    "vit_block": VitBlock,
    "merger": Merger,
    "projector": Projector,
    "embedding": Embedding,
    "dense_block": lambda d: DecoderBlock(d, moe=False),
    "moe_block": lambda d: DecoderBlock(d, moe=True),
    "lm_head": LMHead,
}


def build_layer(spec: LayerSpec, *, seed: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The module of one model layer, initialised deterministically from (seed, layer index)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_of("layer", seed, spec.index))
        module = _MODULES[spec.kind](dict(spec.dims))
    module.to(dtype=dtype, device=device)
    module.requires_grad_(spec.trainable)
    return module
