"""Issue 37: kernels per pass, efficiency by shape and the host-issue roof (the cost model's side)."""

import math

import numpy as np
import pytest

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost._arch import estimate_layer, param_tensor_count
from mpipe_tune.cost import Framework
from mpipe_tune.cost._kernel_model import AttentionCurve, GemmCurve, MemoryCurve, optimizer_kernels
from mpipe_tune.cost._kernel_passes import pass_kernels
from mpipe_tune.cost import CostOptions, build_layer_table, Predictor, load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model, Microbatch, Workload

DIMS = {"hidden": 1024, "heads": 8, "kv_heads": 8, "ffn": 4096}
CURVES = {"gemm": {"max": 0.8, "half_dim": 128, "tile_m": 128, "tile_n": 128, "units": 132, "source": "ideal"},
          "attention": {"max": 0.6, "half_seq": 512, "source": "ideal"},
          "memory": {"max": 0.85, "half_bytes": 1e6, "source": "ideal"}}
HOST = {"dispatch_s": {"value": 10e-6, "source": "ideal"}, "sync_s": {"value": 20e-6, "source": "ideal"}}


def ideal(**extra):
    return parse_profile({**load_profile("ideal").to_dict(), **extra}, where="test")


# ------------------------------------------------------------------------------------------------ curves


def test_the_gemm_curve_is_its_closed_form_and_rises_with_every_dimension():
    c = GemmCurve(max=0.8, half_dim=128, tile_m=128, tile_n=128, units=132)
    m, n, k = 4096, 1024, 512
    tiles = 32 * 8
    expected = 0.8 * tiles / (2 * 132) * (m / (m + 128)) * (n / (n + 128)) * (k / (k + 128))
    assert c.efficiency(m, n, k) == pytest.approx(expected, rel=1e-12)
    full = c.efficiency(128 * 132, 128, 8192)  # exactly one full wave of tiles
    assert full == pytest.approx(0.8 * (16896 / 17024) * 0.5 * (8192 / 8320), rel=1e-12)
    for d in (16, 64, 256, 1024):  # the roll-off of a small reduction dimension
        assert c.efficiency(128 * 132, 128, d) < c.efficiency(128 * 132, 128, 2 * d)


def test_the_last_wave_of_tiles_is_quantised():
    c = GemmCurve(max=1.0, half_dim=0, tile_m=128, tile_n=128, units=132)
    assert c.efficiency(128 * 132, 128, 64) == pytest.approx(1.0)
    assert c.efficiency(128 * 133, 128, 64) == pytest.approx(133 / 264)  # one tile spills into a second wave
    assert c.efficiency(128, 128, 64) == pytest.approx(1 / 132)


def test_the_attention_and_memory_curves_are_their_closed_forms_and_monotone():
    a, m = AttentionCurve(max=0.6, half_seq=512), MemoryCurve(max=0.85, half_bytes=1e6)
    assert a.efficiency(1536) == pytest.approx(0.6 * 0.75)
    assert m.efficiency(3e6) == pytest.approx(0.85 * 0.75)
    lengths = np.array([64, 256, 1024, 8192])
    assert np.all(np.diff(a.efficiency(lengths)) > 0) and np.all(np.diff(m.efficiency(lengths * 1e3)) > 0)


# ---------------------------------------------------------------------------------------------- kernels


def _layer(dims, tokens=512, **kwargs):
    return estimate_layer("dense_block", dims, Microbatch(0, tokens), dtype_bytes=2, **kwargs)[1]


def test_a_decoder_layer_forward_runs_seven_gemms_and_its_kernel_counts_follow_the_mode():
    pieces = _layer(DIMS).pieces
    gemms = [p for p in pieces if p.family == "gemm"]
    assert len(gemms) == 7  # q, k, v, output; gate, up, down
    assert sum(p.kernels[0] for p in gemms) == 7
    eager, fused, compiled = (pass_kernels(pieces, mode) for mode in ("eager", "fused", "compiled"))
    assert eager[0] > fused[0] > compiled[0] >= 7 + 1  # the GEMMs and the attention core stay
    # eager: 2 RMSNorms (8 each), SwiGLU (2), 2 adds, fused RoPE (2), 7 GEMMs, the core: 8+8+2+2+2+7+1
    assert eager[0] == 30
    assert fused[0] == 1 + 1 + 1 + 2 + 2 + 7 + 1  # fused norms and SwiGLU


def test_twice_the_dims_gives_the_expected_flop_scaling_and_the_same_kernel_count():
    one = _layer(DIMS)
    two = _layer({"hidden": 2048, "heads": 16, "kv_heads": 16, "ffn": 8192})
    gemm_flops = [sum(p.fwd_flops for p in layer.pieces if p.family == "gemm") for layer in (one, two)]
    assert gemm_flops[1] == pytest.approx(4 * gemm_flops[0], rel=1e-12)
    assert pass_kernels(one.pieces, "eager") == pass_kernels(two.pieces, "eager")
    assert param_tensor_count("dense_block", DIMS) == 9  # 2 norms, q, k, v, o, gate, up, down


def test_tensor_parallelism_adds_collective_kernels_and_keeps_the_others():
    one, split = _layer(DIMS).pieces, _layer(DIMS, tp_degree=4).pieces
    assert pass_kernels(split, "fused")[0] == pass_kernels(one, "fused")[0] + 2  # two all-reduces
    assert [p.gemm_shape[1] for p in split if p.family == "gemm"][:1] == [1024 / 4]


def test_the_optimizer_launches_by_mode():
    assert optimizer_kernels(0, "eager") == 0
    assert optimizer_kernels(64, "eager") > optimizer_kernels(64, "fused") > 0


# ------------------------------------------------------------------------------------------- the roofs


def _table(profile, tokens, mode="fused"):
    model = load_model("tiny-vit-llm")
    workload = Workload((Microbatch(0, tokens),), "w")
    return build_layer_table(model, workload, profile, CostOptions(kernel_mode=mode))


def test_without_the_new_keys_a_profile_times_as_before():
    plain = _table(ideal(), 256)
    assert plain.fwd_s.sum() == pytest.approx(_table(load_profile("ideal"), 256).fwd_s.sum(), rel=1e-12)


def test_the_host_roof_bounds_small_layers_and_not_large_ones():
    host = ideal(host=HOST)
    small, small_host = _table(ideal(), 16), _table(host, 16)
    assert np.all(small_host.fwd_s >= small.fwd_s)
    decoder = 5  # a decoder block of the tiny model: its forward is its kernels times the dispatch cost
    kernels = pass_kernels(estimate_layer("dense_block", load_model("tiny-vit-llm").layers[decoder].cost.dims_dict(),
                                          Microbatch(0, 16), dtype_bytes=2)[1].pieces, "fused")[0]
    assert small_host.fwd_s[decoder, 0] == pytest.approx(kernels * 10e-6, rel=1e-9)
    compute, memory, host_s, comm = (b[decoder, 0] for b in small_host.bound_s)
    assert host_s == pytest.approx(small_host.fwd_s[decoder, 0] + small_host.dgrad_s[decoder, 0]
                                   + small_host.wgrad_s[decoder, 0], rel=1e-9) and compute == memory == comm == 0
    eager = _table(host, 16, mode="eager")
    graphs = _table(host, 16, mode="graphs")
    assert eager.fwd_s[decoder, 0] > small_host.fwd_s[decoder, 0] > graphs.fwd_s[decoder, 0]


def test_the_shape_curves_slow_small_kernels_more_than_large_ones():
    shaped = ideal(kernel_efficiency=CURVES)
    ratio = [(_table(shaped, t).fwd_s.sum() / _table(ideal(), t).fwd_s.sum()) for t in (64, 4096)]
    assert ratio[0] > ratio[1] > 1


def test_the_host_roof_changes_a_ranking_more_smaller_microbatches_lose_once_dispatch_counts():
    model = load_model("tiny-vit-llm")
    few = Workload(tuple(Microbatch(0, 512) for _ in range(2)), "2 x 512")
    many = Workload(tuple(Microbatch(0, 128) for _ in range(8)), "8 x 128")

    def step(profile, workload):
        c = Candidate("1f1b", (), pp=2, num_microbatches=len(workload))
        return Predictor(model, profile, Framework()).predict(c, workload).timeline.makespan_s

    device_only, with_host = ideal(), ideal(host=HOST)
    assert step(device_only, many) < step(device_only, few)  # a smaller bubble wins on the roofline alone
    assert step(with_host, many) > step(with_host, few)  # four times the kernels per token lose once issued


# ---------------------------------------------------------------------------------------------- profile


@pytest.mark.parametrize("key,value,message", [
    ("host", {"dispatch_s": {"value": 1e-6, "source": "measured"}}, "host.sync_s is missing"),
    ("host", {"dispatch_s": {"value": -1e-6, "source": "measured"}, "sync_s": {"value": 0, "source": "assumed"}},
     "host.dispatch_s.value = -1e-06: must be >= 0"),
    ("host", {"dispatch_s": {"value": 1e-6}, "sync_s": {"value": 0, "source": "assumed"}}, "host.dispatch_s.source"),
    ("kernel_efficiency", {"gemm": {**CURVES["gemm"], "max": 1.5}}, "kernel_efficiency.gemm.max = 1.5"),
    ("kernel_efficiency", {"gemm": {k: v for k, v in CURVES["gemm"].items() if k != "units"}},
     "kernel_efficiency.gemm.units is missing"),
    ("kernel_efficiency", {"gemm": {**CURVES["gemm"], "tile_m": 0}}, "kernel_efficiency.gemm.tile_m = 0"),
    ("kernel_efficiency", {"conv": CURVES["memory"]}, "kernel_efficiency.conv"),
    ("kernel_efficiency", {"memory": {**CURVES["memory"], "source": "guessed"}}, "kernel_efficiency.memory.source"),
])
def test_a_bad_host_or_curve_entry_is_one_line_naming_it(key, value, message):
    with pytest.raises(MpipeError, match=message.replace("(", r"\(").replace(".", r"\.")) as error:
        ideal(**{key: value})
    assert "\n" not in str(error.value)


def test_host_and_curves_round_trip_through_the_json_form():
    profile = ideal(host=HOST, kernel_efficiency=CURVES)
    again = parse_profile(profile.to_dict(), where="again")
    assert again == profile and again.host.dispatch_s == 10e-6 and again.kernel_efficiency.gemm.units == 132
    assert math.isclose(again.kernel_efficiency.memory.half_bytes, 1e6)


def test_an_unknown_kernel_mode_is_refused_in_one_line():
    with pytest.raises(MpipeError, match="kernel mode 'jit'"):
        CostOptions(kernel_mode="jit")
