"""The executor's modules of today's variants do what their architectures do: the delta rule stores and retrieves
associations, Gated DeltaNet and sliding-window attention are causal, a window bounds what a token sees, and the
DeepStack carrier hands its feature to the injection intact."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpipe_tune.inputs import resolve_dims  # noqa: E402
from mpipe_tune.runtime._variants import GatedDeltaNet, VariantAttention, delta_rule  # noqa: E402

F64 = torch.float64


def test_the_delta_rule_retrieves_the_value_written_under_an_orthonormal_key():
    keys = torch.eye(4, dtype=F64).unsqueeze(1)  # 4 tokens, 1 head, orthonormal keys
    values = torch.randn(4, 1, 3, dtype=F64)
    no_decay, full_write = torch.zeros(4, 1, dtype=F64), torch.ones(4, 1, dtype=F64)
    out = delta_rule(keys, keys, values, no_decay, full_write)  # each query is its own token's key
    assert torch.allclose(out, values)
    # rewriting key 0 with beta 1 replaces its value (the delta rule), rather than adding to it
    keys2, values2 = torch.cat([keys, keys[:1]]), torch.cat([values, values[:1] * 5])
    out2 = delta_rule(keys2, keys2, values2, torch.zeros(5, 1, dtype=F64), torch.ones(5, 1, dtype=F64))
    assert torch.allclose(out2[-1], values[0] * 5)


def perturbed_future_leaves_the_past(module, tokens=12, cut=5, width=16):
    x = torch.randn(tokens, width, dtype=F64)
    y = module(x, causal=True)
    x2 = x.clone()
    x2[cut + 1:] += torch.randn(tokens - cut - 1, width, dtype=F64)
    return torch.allclose(module(x2, causal=True)[:cut + 1], y[:cut + 1])


def test_gated_deltanet_and_gated_sliding_attention_are_causal():
    torch.manual_seed(0)
    deltanet = GatedDeltaNet(resolve_dims("dense_block", {"hidden": 16, "heads": 4, "kv_heads": 2, "head_dim": 4,
                                                          "ffn": 8, "attention": "gated_deltanet"})).to(F64)
    gated = VariantAttention(resolve_dims("dense_block", {"hidden": 16, "heads": 4, "kv_heads": 2, "ffn": 8,
                                                          "attention_gate": True, "qk_norm": True,
                                                          "sliding_window": 3})).to(F64)
    assert perturbed_future_leaves_the_past(deltanet) and perturbed_future_leaves_the_past(gated)


def test_a_sliding_window_hides_tokens_older_than_the_window():
    torch.manual_seed(0)
    attention = VariantAttention(resolve_dims("dense_block", {"hidden": 16, "heads": 2, "ffn": 8,
                                                              "sliding_window": 3})).to(F64)
    x = torch.randn(10, 16, dtype=F64)
    y = attention(x, causal=True)
    x2 = x.clone()
    x2[:6] += 1.0  # tokens 0..5 changed: token 8 sees 6, 7, 8 only, token 7 sees 5, 6, 7
    y2 = attention(x2, causal=True)
    assert torch.allclose(y2[8:], y[8:])
    assert not torch.allclose(y2[7], y[7])
