"""The layer table's roofline with a profile's per-phase efficiencies and per-call overheads."""

from __future__ import annotations

import numpy as np
import pytest

from mpipe_tune.cost import _arch as arch, CostOptions, build_layer_table, load_profile, parse_profile
from mpipe_tune.inputs import Microbatch, Workload, load_model

OPTIONS = CostOptions(dtype="fp32")
# One microbatch with an image, one text-only: the encoder has nothing to do in the second.
WORKLOAD = Workload((Microbatch(16, 64), Microbatch(0, 64)))


def cpu_like(**entries) -> object:
    """The ideal profile slowed to CPU-like figures, with the given efficiency entries."""
    data = load_profile("ideal").to_dict()
    data["peak_flops_per_s"]["fp32"]["value"] = 1e11
    data["memory_bytes_per_s"]["value"] = 1e10
    data["efficiency"].update({k: {"source": "measured", **v} for k, v in entries.items()})
    return parse_profile(data, where="test")


def work(model, index: int, m: int) -> arch.ArchWork:
    cost = model.layers[index].cost
    return arch.estimate_arch_work(cost.kind, cost.dims_dict(), WORKLOAD.microbatches[m], dtype_bytes=4)


def roofline(flops: float, size_bytes: float, eff: float) -> float:
    return max(flops / (eff * 1e11), size_bytes / 1e10)


def test_without_the_optional_fields_one_efficiency_serves_both_phases():
    model = load_model("tiny-vit-llm")
    table = build_layer_table(model, WORKLOAD, cpu_like(dense_block={"value": 0.25}), OPTIONS)
    i = next(i for i, u in enumerate(model.layers) if u.cost.kind == "dense_block")
    w = work(model, i, 0)
    assert table.fwd_s[i, 0] == pytest.approx(roofline(w.fwd_flops, w.fwd_bytes, 0.25))
    assert table.dgrad_s[i, 0] == pytest.approx(roofline(w.dgrad_flops, w.dgrad_bytes, 0.25))
    assert table.wgrad_s[i, 0] == pytest.approx(roofline(w.wgrad_flops, w.wgrad_bytes, 0.25))
    assert not table.bwd_overhead_s.any()


def test_backward_efficiency_and_call_overheads_apply_per_phase():
    model = load_model("tiny-vit-llm")
    entry = {"value": 0.25, "backward_value": 0.5, "forward_overhead_s": 1e-3, "backward_overhead_s": 2e-3}
    table = build_layer_table(model, WORKLOAD, cpu_like(dense_block=entry), OPTIONS)
    i = next(i for i, u in enumerate(model.layers) if u.cost.kind == "dense_block")
    w = work(model, i, 0)
    assert table.fwd_s[i, 0] == pytest.approx(1e-3 + roofline(w.fwd_flops, w.fwd_bytes, 0.25))
    assert table.dgrad_s[i, 0] == pytest.approx(roofline(w.dgrad_flops, w.dgrad_bytes, 0.5))
    assert table.wgrad_s[i, 0] == pytest.approx(roofline(w.wgrad_flops, w.wgrad_bytes, 0.5))
    assert table.bwd_overhead_s[i, 0] == 2e-3
    backward = table.backward_s(model)
    assert backward[i, 0] == pytest.approx(table.dgrad_s[i, 0] + table.wgrad_s[i, 0] + 2e-3)


def test_overhead_is_paid_only_by_layers_with_tokens_and_only_when_their_backward_runs():
    model = load_model("tiny-vit-llm")
    entry = {"value": 1.0, "forward_overhead_s": 1e-3, "backward_overhead_s": 2e-3}
    profile = cpu_like(default=entry)
    table = build_layer_table(model, WORKLOAD, profile, OPTIONS)
    encoder = [i for i, u in enumerate(model.layers) if u.block == "encoder"]
    backbone = [i for i, u in enumerate(model.layers) if u.block != "encoder"]
    # The text-only microbatch: no image tokens, so the encoder layers do no work and pay nothing.
    assert not table.fwd_s[encoder, 1].any() and not table.bwd_overhead_s[encoder, 1].any()
    assert (table.fwd_s[backbone, 1] >= 1e-3).all() and (table.bwd_overhead_s[backbone, 1] == 2e-3).all()
    # A frozen encoder runs no backward (nothing before it is trainable): no backward overhead either.
    frozen = model.with_frozen(("encoder",))
    backward = build_layer_table(frozen, WORKLOAD, profile, OPTIONS).backward_s(frozen)
    assert not backward[encoder].any()
    assert (backward[backbone, 0] >= 2e-3).all()


def test_a_kind_without_its_own_entry_takes_every_default_figure():
    profile = cpu_like(default={"value": 0.5, "backward_value": 0.25, "forward_overhead_s": 3e-4},
                       vit_block={"value": 0.8})
    assert profile.efficiency_for("dense_block") == 0.5
    assert profile.backward_efficiency_for("dense_block") == 0.25
    assert profile.call_overhead_for("dense_block") == (3e-4, 0.0)
    # A kind with an entry: its value for both phases, and no overhead unless the entry says so.
    assert profile.backward_efficiency_for("vit_block") == 0.8
    assert profile.call_overhead_for("vit_block") == (0.0, 0.0)


def test_layer_weights_and_predictions_are_unchanged_for_old_profiles():
    model = load_model("tiny-vit-llm")
    old = load_profile("cpu-generic")
    table = build_layer_table(model, WORKLOAD, old, CostOptions())
    assert np.array_equal(table.backward_s(model), table.dgrad_s * _dgrad_mask(model) + table.wgrad_s * _trainable(model))


def _trainable(model) -> np.ndarray:
    return np.array(model.trainable_bits(), dtype=bool)[:, None]


def _dgrad_mask(model) -> np.ndarray:
    bits = model.trainable_bits()
    return np.array([any(bits[:i]) for i in range(len(bits))], dtype=bool)[:, None]
