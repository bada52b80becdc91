"""The memory-bound kernels' own roofline (issue 28): with the profile's ``memory_bound`` entry, a layer's norms,
activations, residual adds, softmax and permutes are timed by their bytes at that fraction of the bandwidth,
after its matmuls and attention core, instead of hiding under the layer's compute."""

import pytest

from mpipe_tune.cost import estimate_arch_work
from mpipe_tune.cost._arch_layers import build_layer
from mpipe_tune.cost._layers import CostOptions, build_layer_table, compute_seconds, pass_seconds
from mpipe_tune.cost import load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import resolve_dims, load_model, Microbatch, Workload

DIMS = {"hidden": 1024, "heads": 8, "kv_heads": 2, "ffn": 4096}
MB = Microbatch(0, 2048)
PEAK, BANDWIDTH = 1e15, 3e12


def profile(memory_bound=None, backward=None):
    data = load_profile("ideal").to_dict()
    data["peak_flops_per_s"] = {"bf16": {"value": PEAK, "source": "ideal"}}
    data["memory_bytes_per_s"] = {"value": BANDWIDTH, "source": "ideal"}
    data["efficiency"]["default"]["value"] = 0.5
    if memory_bound is not None:
        entry = {"value": memory_bound, "source": "ideal"}
        if backward is not None:
            entry["backward_value"] = backward
        data["efficiency"]["memory_bound"] = entry
    return parse_profile(data, where="test")


def test_the_memory_bound_kernels_are_every_kernel_but_the_matmuls_and_the_core():
    layer = build_layer("dense_block", resolve_dims("dense_block", DIMS), MB, 1)
    streamed = [p for p in layer.pieces if not (p.linear or p.attention_core) and p.fwd_elems > 0]
    assert len(streamed) == 6  # two norms, two residual adds, the SwiGLU, RoPE
    work = estimate_arch_work("dense_block", DIMS, MB, dtype_bytes=2)
    assert work.memory_bound_fwd_bytes == pytest.approx(2 * sum(p.fwd_elems for p in streamed), rel=1e-12)
    assert work.memory_bound_dgrad_bytes == pytest.approx(2 * sum(p.dgrad_elems for p in streamed), rel=1e-12)
    assert work.memory_bound_fwd_flops == pytest.approx(
        work.fwd_flops - work.linear_fwd_flops - work.attention_core_fwd_flops, rel=1e-12)
    assert 0 < work.memory_bound_fwd_bytes < work.fwd_bytes


def test_without_the_entry_a_pass_is_one_roofline_of_the_whole_layer():
    work = estimate_arch_work("dense_block", DIMS, MB, dtype_bytes=2)
    plain = profile()
    assert plain.memory_bound_efficiency() is None
    fwd_c, dgrad_c, wgrad_c, *_ = compute_seconds(work, "dense_block", plain, "bf16")
    assert pass_seconds(work, "dense_block", plain, "bf16") == (
        max(fwd_c, work.fwd_bytes / BANDWIDTH), max(dgrad_c, work.dgrad_bytes / BANDWIDTH),
        max(wgrad_c, work.wgrad_bytes / BANDWIDTH))


def test_with_the_entry_the_elementwise_traffic_is_paid_after_the_compute():
    work = estimate_arch_work("dense_block", DIMS, MB, dtype_bytes=2)
    fwd_c, _, _, core_c, _ = compute_seconds(work, "dense_block", profile(), "bf16")
    assert fwd_c > work.fwd_bytes / BANDWIDTH  # compute-bound as a whole: the elementwise bytes hid under it
    fwd, dgrad, wgrad = pass_seconds(work, "dense_block", profile(1.0), "bf16")
    mb_c = work.memory_bound_fwd_flops / (0.5 * PEAK)
    assert work.memory_bound_fwd_bytes / BANDWIDTH > mb_c  # those kernels are memory-bound
    assert fwd == pytest.approx(fwd_c - mb_c + work.memory_bound_fwd_bytes / BANDWIDTH, rel=1e-12)
    half, half_dgrad, _ = pass_seconds(work, "dense_block", profile(0.5), "bf16")
    assert half - fwd == pytest.approx(work.memory_bound_fwd_bytes / BANDWIDTH, rel=1e-9)  # at half the bandwidth
    _, slow_dgrad, _ = pass_seconds(work, "dense_block", profile(1.0, backward=0.25), "bf16")
    assert slow_dgrad - dgrad == pytest.approx(3 * work.memory_bound_dgrad_bytes / BANDWIDTH, rel=1e-9)
    assert wgrad >= max(compute_seconds(work, "dense_block", profile(), "bf16")[2], 0.0)


def test_the_layer_table_charges_it_to_compute_bound_layers_only():
    model = load_model("llama3-8b")
    workload = Workload((Microbatch(0, 4096),), "one sequence")
    with_entry = build_layer_table(model, workload, profile(1.0), CostOptions())
    without = build_layer_table(model, workload, profile(), CostOptions())
    assert (with_entry.fwd_s[1:] > without.fwd_s[1:]).all() and (with_entry.dgrad_s[1:] > without.dgrad_s[1:]).all()
    assert with_entry.fwd_s[0] == without.fwd_s[0]  # the embedding lookup was memory-bound already


def test_the_entry_is_a_fraction():
    data = profile().to_dict()
    data["efficiency"]["memory_bound"] = {"value": 1.5, "source": "ideal"}
    with pytest.raises(MpipeError, match="memory_bound"):
        parse_profile(data, where="test")
