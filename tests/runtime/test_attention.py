"""The runtime's attention uses torch's fused CPU kernel, whose backward keeps no tokens x tokens scores."""

import pytest
import torch

from mpipe_tune.runtime._layers import Attention


def _backward_nodes(y: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_runs_the_fused_kernel_and_matches_the_math_path(causal, dtype):
    torch.manual_seed(0)
    attention = Attention(64, 4, 2, 16, qkv_bias=True, out_bias=False).to(dtype)
    x = torch.randn(96, 64, dtype=dtype, requires_grad=True)
    y = attention(x, causal=causal)
    assert any("FlashAttention" in name for name in _backward_nodes(y)), _backward_nodes(y)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        reference = attention(x, causal=causal)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, reference, rtol=tolerance, atol=tolerance)
