"""Multi-head latent attention, and tensor parallelism of every layer kind on torch's own API.

The split layers run on a 2-rank gloo mesh in one launch: each layer's output, input gradient and
every parameter's full gradient equal those of the same layer built whole, and a whole-model step
of the split layers equals the single-process reference (float64, atol 1e-12: the splits only
reorder sums).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tp_layers_check import MICROBATCH, TP_MODEL, compare_split_layers  # noqa: E402

from mpipe_tune.cost._arch import param_count  # noqa: E402
from mpipe_tune.inputs import resolve_dims  # noqa: E402
from mpipe_tune.errors import MpipeError  # noqa: E402
from mpipe_tune.runtime._blueprint import LayerSpec, blueprint, validate_tensor_parallel  # noqa: E402
from mpipe_tune.runtime import MicrobatchInputs  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime import build_layer  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402

F64, CPU = torch.float64, torch.device("cpu")
ATOL = 1e-12
REPLICATED = {"patch_embed", "projector_linear"}
"""Layers of the test model that tensor parallelism leaves whole on every rank."""


def _specs():
    return blueprint(load_model(TP_MODEL))


def test_blueprint_accepts_mla_in_dense_and_moe_blocks():
    mla = {s.kind for s in _specs() if dict(s.dims).get("attention") == "mla"}
    assert mla == {"dense_block", "moe_block"}


@pytest.mark.parametrize("name", ["dec_mla", "moe_mla"])
def test_mla_block_runs_causally_and_has_the_cost_models_parameters(name):
    spec = next(s for s in _specs() if s.name == name)
    block = build_layer(spec, seed=0, dtype=F64, device=CPU)
    assert sum(p.numel() for p in block.parameters()) == param_count(spec.kind, dict(spec.dims))
    inputs = MicrobatchInputs(MICROBATCH, 0, 0, F64, CPU)
    x = torch.randn(8, spec.dim("hidden"), dtype=F64, requires_grad=True)
    y = block(x, inputs)
    assert y.shape == x.shape
    later = x.detach().clone()
    later[-1] += 1.0
    changed = block(later, inputs).detach()
    torch.testing.assert_close(changed[:-1], y.detach()[:-1], rtol=0, atol=ATOL)  # no token sees a later one
    assert not torch.allclose(changed[-1], y.detach()[-1])
    y.pow(2).sum().backward()
    attention = dict(block.attn.named_parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attention.values()), "an MLA weight got no gradient"
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_every_kind_split_over_two_ranks_equals_the_whole_layer():
    ranks = launch_local(compare_split_layers, (TP_MODEL, MICROBATCH), 2, timeout_s=300, deadline_s=120)
    specs = _specs()
    assert {s.kind for s in specs} == {"patch_embed", "vit_block", "merger", "projector", "embedding",
                                       "dense_block", "moe_block", "lm_head"}
    for rank, report in enumerate(ranks):
        assert set(report) == {s.name for s in specs} | {"step"}
        for name, result in report.items():
            assert result["error"] <= ATOL, f"rank {rank}, {name}: max |split - whole| = {result['error']:.3g}"
        for spec in specs:
            sharded = report[spec.name]["sharded"]
            assert (sharded == 0) == (spec.name in REPLICATED), f"{spec.name}: {sharded} sharded parameters"


def _decoder(heads: int, kv_heads: int, ffn: int = 24) -> LayerSpec:
    dims = resolve_dims("dense_block", {"hidden": 48, "heads": heads, "kv_heads": kv_heads, "ffn": ffn})
    return LayerSpec(5, "dec", "dense_block", tuple(sorted(dims.items())), True)


@pytest.mark.parametrize("heads, kv_heads, tp, message", [
    (4, 4, 3, "tp 3 must divide heads 4 of layer 5 ('dec', dense_block); plan with a tp degree that fits every layer "
              "(for this model, up to 64: 1, 2, 4)"),
    (6, 3, 2, "tp 2 must divide kv_heads 3 of layer 5 ('dec', dense_block), which are split"),
    (12, 4, 6, "tp 6 must be a multiple of kv_heads 4 of layer 5 ('dec', dense_block), since with fewer"),
])
def test_validate_tensor_parallel_names_the_layer_and_the_rule(heads, kv_heads, tp, message):
    with pytest.raises(MpipeError) as error:
        validate_tensor_parallel([_decoder(heads, kv_heads)], tp)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_validate_tensor_parallel_accepts_degrees_that_fit():
    validate_tensor_parallel(_specs(), 1)
    validate_tensor_parallel(_specs(), 2)
    validate_tensor_parallel([_decoder(heads=8, kv_heads=2)], 8)  # two kv heads, each kept by 4 ranks
    with pytest.raises(MpipeError, match=r"tp 4 must divide heads 2 of layer 1 \('vit', vit_block\)"):
        validate_tensor_parallel(_specs(), 4)
