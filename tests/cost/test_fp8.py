"""fp8 as frameworks run it (issue 16, item 4): only the linear layers' GEMMs at the fp8 peak; attention
cores, norms and pointwise kernels at the bf16 peak; tensors between kernels in bf16."""

import pytest

from mpipe_tune.cost import estimate_arch_work
from mpipe_tune.cost._layers import CostOptions, compute_seconds
from mpipe_tune.cost import load_profile, parse_profile
from mpipe_tune.inputs import Microbatch

DIMS = {"hidden": 1024, "heads": 8, "kv_heads": 2, "ffn": 4096}
MB = Microbatch(0, 2048)
BF16_PEAK, FP8_PEAK = 1e15, 2e15


def fp8_profile(attention_core_efficiency=None):
    data = load_profile("ideal").to_dict()
    data["peak_flops_per_s"]["fp8"] = {"value": FP8_PEAK, "source": "ideal"}
    data["efficiency"]["default"]["value"] = 0.5
    if attention_core_efficiency is not None:
        data["efficiency"]["attention_core"] = {"value": attention_core_efficiency, "source": "ideal"}
    return parse_profile(data, where="test")


def test_fp8_runs_only_linear_gemms_at_the_fp8_peak():
    work = estimate_arch_work("dense_block", DIMS, MB, dtype_bytes=2)
    assert 0 < work.linear_fwd_flops < work.fwd_flops
    assert work.linear_wgrad_flops == pytest.approx(work.wgrad_flops)  # every weight gradient is a GEMM's
    fwd, dgrad, wgrad, core_fwd, _ = compute_seconds(work, "dense_block", fp8_profile(), "fp8")
    other = work.fwd_flops - work.linear_fwd_flops
    assert fwd == pytest.approx(work.linear_fwd_flops / (0.5 * FP8_PEAK) + other / (0.5 * BF16_PEAK), rel=1e-12)
    assert core_fwd == pytest.approx(work.attention_core_fwd_flops / (0.5 * BF16_PEAK), rel=1e-12)
    bf16_fwd = compute_seconds(work, "dense_block", fp8_profile(), "bf16")[0]
    assert bf16_fwd == pytest.approx(work.fwd_flops / (0.5 * BF16_PEAK), rel=1e-12)
    assert 1.0 < bf16_fwd / fwd < 2.0  # the fp8 speedup is bounded by the share of linear FLOPs


def test_attention_core_entry_times_the_core_and_leaves_the_rest_of_the_layer():
    work = estimate_arch_work("dense_block", DIMS, MB, dtype_bytes=2)
    fwd, *_ = compute_seconds(work, "dense_block", fp8_profile(attention_core_efficiency=0.25), "bf16")
    core = work.attention_core_fwd_flops
    assert fwd == pytest.approx((work.fwd_flops - core) / (0.5 * BF16_PEAK) + core / (0.25 * BF16_PEAK), rel=1e-12)


def test_fp8_keeps_bf16_tensors():
    assert CostOptions(dtype="fp8").dtype_bytes() == CostOptions(dtype="bf16").dtype_bytes() == 2


def test_fp8_linear_entry_times_only_the_gemms_of_an_fp8_step():
    data = fp8_profile().to_dict()
    data["efficiency"]["fp8_linear"] = {"value": 0.25, "source": "ideal"}
    profile = parse_profile(data, where="test")
    work = estimate_arch_work("dense_block", DIMS, MB, dtype_bytes=2)
    fwd = compute_seconds(work, "dense_block", profile, "fp8")[0]
    other = work.fwd_flops - work.linear_fwd_flops
    assert fwd == pytest.approx(work.linear_fwd_flops / (0.25 * FP8_PEAK) + other / (0.5 * BF16_PEAK), rel=1e-12)
    assert compute_seconds(work, "dense_block", profile, "bf16")[0] == pytest.approx(
        compute_seconds(work, "dense_block", fp8_profile(), "bf16")[0], rel=1e-12)  # bf16 steps ignore it
