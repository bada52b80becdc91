"""The torch modules of today's layer variants (the cost model's in :mod:`mpipe_tune.cost._arch_linear_attention`,
:mod:`~mpipe_tune.cost._arch_attention_variants` and :mod:`~mpipe_tune.cost._arch_vision`), plain torch.

- :class:`GatedDeltaNet`: Qwen3.5's linear attention, its delta rule run as the reference recurrence over the
  tokens (one state of ``head_dim x value_head_dim`` per value head), not the chunked kernels the cost model
  charges: the same function, computed token by token.
- :class:`VariantAttention`: grouped-query attention with q/k RMSNorms, a sliding window and Qwen3.5's sigmoid
  output gate.
- :class:`PixelShuffle`: InternVL's merge of ``merge_factor`` consecutive patches into one wider token.
- :class:`SideCarry`: DeepStack (Qwen3-VL). A layer that takes, adds or passes on DeepStack features
  carries them beside its output in one flat tensor (the output's elements, then the features' ``[image_tokens,
  side_width]``), so the executor sends one tensor across a stage boundary, of
  :func:`~mpipe_tune.runtime._blueprint.output_shape`'s size. A tap (``deepstack_out``) appends the DeepStack
  merger's output of the block's patches; an injection (``deepstack_in``) adds the oldest feature to the image
  tokens' rows (the first rows of the sequence) and drops it.

These layers run whole on a rank: a plan with tensor, sequence or context parallelism over them is refused
before the run (:func:`~mpipe_tune.runtime._blueprint.validate_variants`). A tied ``lm_head`` keeps its own table
here (the reference does the same, so the gradients compare one to one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpipe_tune.runtime._data import MicrobatchInputs


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over ``[tokens, heads, dk]`` q, k, ``[tokens, heads, dv]`` v and ``[tokens, heads]``
    decays ``g`` (log) and strengths ``beta``: ``S_t = exp(g_t) S_(t-1) + k_t (beta_t (v_t - S^T k_t))^T`` after the
    decay, ``o_t = S_t^T q_t``; ``[tokens, heads, dv]``."""
    tokens, heads, dk = q.shape
    state = q.new_zeros(heads, dk, v.shape[-1])
    outputs = []
    for t in range(tokens):
        state = state * g[t].exp()[:, None, None]
        remembered = (state * k[t][:, :, None]).sum(1)
        delta = (v[t] - remembered) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outputs.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(outputs) if outputs else v.new_zeros(0, heads, v.shape[-1])


class GatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet token mixer over one sequence ``[tokens, hidden]`` (causal by construction)."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        hidden, self.heads, self.key_heads = d["hidden"], d["heads"], d["kv_heads"]
        self.dk, self.dv = d["head_dim"], d["value_head_dim"]
        channels = 2 * self.key_heads * self.dk + self.heads * self.dv
        self.qk = nn.Linear(hidden, 2 * self.key_heads * self.dk, bias=False)
        self.v = nn.Linear(hidden, self.heads * self.dv, bias=False)
        self.z = nn.Linear(hidden, self.heads * self.dv, bias=False)
        self.ba = nn.Linear(hidden, 2 * self.heads, bias=False)
        self.conv = nn.Conv1d(channels, channels, d["conv_kernel"], groups=channels, padding=d["conv_kernel"] - 1,
                              bias=False)
        self.a_log = nn.Parameter(torch.empty(self.heads).uniform_(0.0, 2.0))
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.norm = RMSNorm(self.dv)
        self.out = nn.Linear(self.heads * self.dv, hidden, bias=False)

    def forward(self, x: torch.Tensor, *, causal: bool, ring=None) -> torch.Tensor:
        tokens = x.shape[0]
        mixed = torch.cat([self.qk(x), self.v(x)], dim=-1)
        mixed = F.silu(self.conv(mixed.t().unsqueeze(0))[..., :tokens]).squeeze(0).t()
        q, k, v = mixed.split([self.key_heads * self.dk, self.key_heads * self.dk, self.heads * self.dv], dim=-1)
        repeat = self.heads // self.key_heads
        q = F.normalize(q.view(tokens, self.key_heads, self.dk), dim=-1).repeat_interleave(repeat, dim=1)
        k = F.normalize(k.view(tokens, self.key_heads, self.dk), dim=-1).repeat_interleave(repeat, dim=1)
        b, a = self.ba(x).chunk(2, dim=-1)
        g = -self.a_log.exp() * F.softplus(a + self.dt_bias)
        o = delta_rule(q * self.dk ** -0.5, k, v.view(tokens, self.heads, self.dv), g, torch.sigmoid(b))
        o = self.norm(o) * F.silu(self.z(x).view(tokens, self.heads, self.dv))
        return self.out(o.reshape(tokens, -1))


class VariantAttention(nn.Module):
    """Grouped-query attention with the variants of :mod:`~mpipe_tune.cost._arch_attention_variants`."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        hidden, heads, kv_heads, self.head_dim = d["hidden"], d["heads"], d["kv_heads"], d["head_dim"]
        self.group = heads // kv_heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=d["qkv_bias"])
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=d["qkv_bias"])
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=d["qkv_bias"])
        self.gate = nn.Linear(hidden, heads * self.head_dim, bias=False) if d["attention_gate"] else None
        self.q_norm = RMSNorm(self.head_dim) if d["qk_norm"] else None
        self.k_norm = RMSNorm(self.head_dim) if d["qk_norm"] else None
        self.window = d["sliding_window"]
        self.out = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, *, causal: bool, ring=None) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = (proj(x).view(tokens, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k, v = (t.repeat_interleave(self.group, dim=1) for t in (k, v))
        position = torch.arange(tokens, device=x.device)
        behind = position[:, None] - position[None, :]
        mask = behind >= 0 if causal else torch.ones_like(behind, dtype=torch.bool)
        if self.window is not None:
            mask = mask & (behind < self.window)
        y = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                           v.transpose(0, 1).unsqueeze(0), attn_mask=mask)
        y = y.squeeze(0).transpose(0, 1).reshape(tokens, -1)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x))
        return self.out(y)


def is_variant_attention(d: dict) -> bool:
    """Whether a decoder layer's attention needs :class:`VariantAttention` (or :class:`GatedDeltaNet`)."""
    return d["attention"] == "gated_deltanet" or (d["attention"] == "gqa" and bool(
        d["qk_norm"] or d["attention_gate"] or d["sliding_window"]))


def variant_attention(d: dict) -> nn.Module:
    return GatedDeltaNet(d) if d["attention"] == "gated_deltanet" else VariantAttention(d)


class PixelShuffle(nn.Module):
    """``merge_factor`` consecutive patches of ``hidden`` as one token of ``hidden * merge_factor``."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        self.merge, self.width = d["merge_factor"], d["hidden"] * d["merge_factor"]

    def forward(self, x: torch.Tensor, inputs: MicrobatchInputs) -> torch.Tensor:
        return x[:sum(inputs.image_sizes) * self.merge].reshape(-1, self.width)


class DeepstackMerger(nn.Module):
    """Qwen3-VL's DeepStack merger: LayerNorm over ``merge_factor`` concatenated patches, GELU MLP to ``out``."""

    def __init__(self, merged: int, out: int) -> None:
        super().__init__()
        self.merged = merged
        self.norm = nn.LayerNorm(merged)
        self.up = nn.Linear(merged, merged)
        self.down = nn.Linear(merged, out)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(patches.reshape(-1, self.merged)))))


class SideCarry(nn.Module):
    """A layer ``inner`` with the DeepStack features it takes (``side_in`` wide per image token), appends
    (``tap``), adds into its output (``inject`` wide) and hands on, packed after its output in one flat tensor."""

    def __init__(self, inner: nn.Module, *, in_width: int, side_in: int, side_out: int,
                 tap: DeepstackMerger | None, inject: int) -> None:
        super().__init__()
        self.inner, self.tap = inner, tap
        self.in_width, self.side_in, self.side_out, self.inject = in_width, side_in, side_out, inject

    def forward(self, x: torch.Tensor | None, inputs: MicrobatchInputs) -> torch.Tensor:
        images = inputs.mb.image_tokens
        side = None
        if self.side_in:
            split = x.numel() - images * self.side_in
            x, side = x[:split].reshape(-1, self.in_width), x[split:].reshape(images, self.side_in)
        y = self.inner(x, inputs)
        if self.tap is not None:
            feature = self.tap(y[:images * self.tap.merged // y.shape[-1]])
            side = feature if side is None else torch.cat([side, feature], dim=-1)
        if self.inject:
            y = torch.cat([y[:images] + side[:, :self.inject], y[images:]])
            side = side[:, self.inject:]
        if not self.side_out:
            return y
        return torch.cat([y.reshape(-1), side.reshape(-1)])
