"""How a trainer runs its kernels changes their cost: an eager RMSNorm's fp32 traffic, torch's own attention
kernel against Transformer Engine's, and torchtitan's ``op`` selective recomputation (issue 37)."""

import pytest

from mpipe_tune.algebra import Degrees
from mpipe_tune.cost._arch import estimate_layer
from mpipe_tune.cost._arch_layers import RMSNORM_EAGER_TRAFFIC
from mpipe_tune.cost._kernel_passes import shaped_pass_seconds
from mpipe_tune.cost._layers import CostOptions, build_layer_table, op_recompute_pieces
from mpipe_tune.cost import load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model, Microbatch, Workload

LLAMA = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
CURVES = {"gemm": {"max": 0.8, "half_dim": 128, "tile_m": 128, "tile_n": 128, "units": 132, "source": "ideal"},
          "attention": {"max": 0.6, "half_seq": 512, "native_ratio": 0.5, "source": "ideal"},
          "memory": {"max": 1.0, "half_bytes": 1.0, "source": "ideal"}}


def shaped(**curves):
    return parse_profile({**load_profile("ideal").to_dict(), "kernel_efficiency": {**CURVES, **curves}}, where="test")


def decoder(tokens=2048):
    return estimate_layer("dense_block", LLAMA, Microbatch(0, tokens), dtype_bytes=2)[1].pieces


def test_an_eager_rmsnorm_moves_its_fp32_intermediates_and_a_fused_one_does_not():
    norm = decoder()[0]
    elems = 2048 * 4096
    assert norm.bytes_moved(0, 2, eager=False) == 2 * norm.fwd_elems
    fwd = RMSNORM_EAGER_TRAFFIC[0]
    assert norm.bytes_moved(0, 2, eager=True) == pytest.approx(elems * (2 * fwd[0] + 4 * fwd[1]))  # 36 bytes each
    profile = shaped()
    eager = shaped_pass_seconds([norm], "dense_block", profile, "bf16", 2, "eager")[0]
    fused = shaped_pass_seconds([norm], "dense_block", profile, "bf16", 2, "fused")[0]
    assert eager[0] > 8 * fused[0] and eager[1] > 8 * fused[1]
    swiglu = [p for p in decoder() if p.kernels == (2.0, 3.0, 0.0)][0]  # act(gate) * up: 5 and 9 elements eager
    assert [swiglu.bytes_moved(i, 2, eager=True) / swiglu.bytes_moved(i, 2, eager=False) for i in (0, 1)] == \
        pytest.approx([5 / 3, 9 / 5])


def test_torchs_own_attention_runs_at_the_profiles_native_ratio_and_only_in_the_modes_that_call_it():
    core = [p for p in decoder() if p.family == "attention"]
    profile = shaped()
    seconds = {mode: shaped_pass_seconds(core, "dense_block", profile, "bf16", 2, mode)[0][0]
               for mode in ("eager", "compiled", "fused", "graphs")}
    assert seconds["eager"] == pytest.approx(2 * seconds["fused"]) and seconds["compiled"] == seconds["eager"]
    assert seconds["graphs"] == seconds["fused"]
    without = shaped(attention={k: v for k, v in CURVES["attention"].items() if k != "native_ratio"})
    assert shaped_pass_seconds(core, "dense_block", without, "bf16", 2, "eager")[0][0] == pytest.approx(seconds["fused"])
    again = parse_profile(profile.to_dict(), where="again")
    assert again.kernel_efficiency.attention.native_ratio == 0.5


def test_a_native_ratio_above_one_is_refused_in_one_line():
    with pytest.raises(MpipeError, match="kernel_efficiency.attention") as error:
        shaped(attention={**CURVES["attention"], "native_ratio": 1.5})
    assert "\n" not in str(error.value)


def test_torchtitans_op_policy_recomputes_every_second_matmul_and_the_memory_bound_kernels():
    pieces = decoder()
    again = op_recompute_pieces(pieces)
    shapes = [p.gemm_shape[1] for p in again if p.family == "gemm"]
    assert shapes == [1024, 4096, 14336]  # wk, wo, w3 of q, k, v, o, w1, w3, w2: the 2nd, 4th and 6th
    assert not any(p.family == "attention" for p in again)
    assert {id(p) for p in pieces if p.family == "memory"} <= {id(p) for p in again}
    assert op_recompute_pieces(estimate_layer("embedding", {"hidden": 64, "vocab": 1000}, Microbatch(0, 8),
                                              dtype_bytes=2)[1].pieces) == ()


def test_op_selective_recomputation_re_runs_more_than_the_attention_core_and_less_than_the_layer():
    model = load_model("llama3-8b")
    workload = Workload((Microbatch(0, 2048),), "w")
    profile = shaped()
    tables = {policy: build_layer_table(model, workload, profile, CostOptions(recompute="selective",
                                                                            selective_recompute=policy))
              for policy in ("attention_core", "op")}
    full = build_layer_table(model, workload, profile, CostOptions(recompute=True))
    block = 1
    assert tables["attention_core"].recompute_s[block, 0] < tables["op"].recompute_s[block, 0] < full.recompute_s[block, 0]
    assert tables["op"].recompute_s[0, 0] == tables["attention_core"].recompute_s[0, 0]  # the embedding: not wrapped
    # it keeps the block's input, the saved matmuls' outputs (wq, wv, w1, w2) and the attention output
    kept = (4096 + 4096 + 1024 + 14336 + 4096 + 4096) * 2048 * 2
    assert tables["op"].saved_bytes[block, 0] == pytest.approx(kept)
    assert full.saved_bytes[block, 0] < kept < tables["attention_core"].saved_bytes[block, 0]
    with pytest.raises(MpipeError, match="selective recomputation 'layer'"):
        CostOptions(selective_recompute="layer")


def test_a_narrow_head_slows_the_attention_core_by_the_gemm_roll_off_and_a_wide_one_gains_nothing():
    profile = shaped()  # GEMM half_dim 128: s(64) / s(128) = (64 / 192) / (128 / 256) = 2 / 3

    def per_flop(head_dim):
        dims = {"hidden": 32 * head_dim, "heads": 32, "kv_heads": 8, "ffn": 4096, "head_dim": head_dim}
        core = [p for p in estimate_layer("dense_block", dims, Microbatch(0, 4096), dtype_bytes=2)[1].pieces
                if p.family == "attention"]
        return shaped_pass_seconds(core, "dense_block", profile, "bf16", 2)[0][0] / core[0].fwd_flops

    assert per_flop(64) == pytest.approx(1.5 * per_flop(128)) and per_flop(256) == pytest.approx(per_flop(128))


def test_a_micro_batch_of_several_sequences_runs_one_forward_with_attention_per_sequence():
    """Megatron-LM and torchtitan run a micro batch of b sequences as one forward over b x s tokens: the GEMMs see
    all the rows, each sequence's attention only its own square."""
    packed = Microbatch(0, 8192, texts=(4096, 4096))
    assert packed.text_sizes() == (4096, 4096) and Microbatch(0, 8192).text_sizes() == (8192,)
    one, two = (estimate_layer("dense_block", LLAMA, mb, dtype_bytes=2)[1].pieces
                for mb in (Microbatch(0, 8192), packed))
    core = [[p for p in pieces if p.family == "attention"][0] for pieces in (one, two)]
    assert core[1].fwd_flops == pytest.approx(core[0].fwd_flops / 2) and core[1].seq_lens == (4096, 4096)
    gemms = [[p.gemm_shape for p in pieces if p.family == "gemm"] for pieces in (one, two)]
    assert gemms[0] == gemms[1] and gemms[0][0][0] == 8192
    model = load_model("llama3-8b")
    profile = shaped()
    tables = [build_layer_table(model, Workload(mbs, "w"), profile, CostOptions())
              for mbs in ((packed,), (Microbatch(0, 8192),), (Microbatch(0, 4096),) * 2)]
    assert tables[0].fwd_s[1, 0] < tables[1].fwd_s[1, 0]  # less attention than one 8K sequence
    assert tables[0].fwd_s[1, 0] < tables[2].fwd_s[1].sum()  # larger kernels than two 4K microbatches


def test_without_gradient_accumulation_fusion_each_microbatch_adds_every_weight_gradient_into_the_main_gradient():
    model = load_model("llama3-8b")
    workload = Workload((Microbatch(0, 1024),) * 2, "w")
    profile = shaped()
    fused, unfused = (build_layer_table(model, workload, profile, CostOptions(grad_accumulation_fusion=flag,
                                                                              degrees=Degrees(1, tp=2)))
                      for flag in (True, False))
    block = 1
    added = unfused.wgrad_s[block] - fused.wgrad_s[block]
    expected = fused.param_count[block] / 2 * (2 + 2 * 4) / profile.memory_bytes_per_s  # bf16 read, fp32 read + write
    assert added == pytest.approx([expected, expected])
    assert unfused.bound_s[1][block] - fused.bound_s[1][block] == pytest.approx(added)  # charged as memory traffic
    assert (unfused.fwd_s == fused.fwd_s).all() and (unfused.dgrad_s == fused.dgrad_s).all()
