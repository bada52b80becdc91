"""Today's layer variants in the cost model: Gated DeltaNet's work is linear in the sequence, windows and sliding
windows cut the attention core's scores, gated attention adds its gate, DeepStack features cross stage boundaries,
and the tensor-parallel split divides every variant's work."""

from __future__ import annotations

import pytest

from mpipe_tune.cost._arch import estimate_arch_work, param_count
from mpipe_tune.cost._arch_linear_attention import CHUNK_TOKENS
from mpipe_tune.inputs import Microbatch

GQA = {"hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128, "ffn": 2048}
DELTANET = {**GQA, "attention": "gated_deltanet", "heads": 8, "kv_heads": 4, "value_head_dim": 128}
VIT = {"hidden": 256, "heads": 4, "ffn": 512, "merge_factor": 4}


def work(kind, dims, text=0, image=0, images=None, **kw):
    return estimate_arch_work(kind, dims, Microbatch(image, text, images), dtype_bytes=2, **kw)


def test_deltanet_work_is_linear_in_the_sequence_where_attention_is_quadratic():
    short, long = (work("dense_block", DELTANET, text=n) for n in (8 * CHUNK_TOKENS, 64 * CHUNK_TOKENS))
    assert long.fwd_flops == pytest.approx(8 * short.fwd_flops, rel=1e-9)
    assert long.attention_core_fwd_flops == pytest.approx(8 * short.attention_core_fwd_flops, rel=1e-9)
    full_short, full_long = (work("dense_block", GQA, text=n) for n in (8 * CHUNK_TOKENS, 64 * CHUNK_TOKENS))
    assert full_long.attention_core_fwd_flops == pytest.approx(64 * full_short.attention_core_fwd_flops, rel=1e-9)


def test_deltanet_keeps_one_recurrent_state_per_value_head_and_its_chunk_inverse():
    tokens = 4 * CHUNK_TOKENS
    one = work("dense_block", DELTANET, text=tokens)
    wider = work("dense_block", {**DELTANET, "value_head_dim": 256}, text=tokens)
    # a state is head_dim x value_head_dim per value head; doubling value_head_dim doubles it and v, z, the output
    state_bytes = 2 * 8 * 128 * 128
    assert wider.saved_activation_bytes - one.saved_activation_bytes > state_bytes


def test_deltanet_parameters_are_qwen3_5s():
    """One Qwen3.5-27B linear-attention layer's token mixer (in_proj_qkv, in_proj_z, in_proj_b/a, conv1d, A_log,
    dt_bias, the gated norm, out_proj), besides its MLP and two norms."""
    dims = {"hidden": 5120, "heads": 48, "kv_heads": 16, "head_dim": 128, "ffn": 17408, "attention": "gated_deltanet"}
    mixer = 5120 * 10240 + 5120 * 6144 + 5120 * 96 + 10240 * 4 + 96 + 128 + 6144 * 5120
    assert param_count("dense_block", dims) == mixer + 3 * 5120 * 17408 + 2 * 5120


def test_gated_attention_adds_the_gate_projection_and_its_product():
    plain, gated = work("dense_block", GQA, text=512), work("dense_block", {**GQA, "attention_gate": True}, text=512)
    assert gated.linear_fwd_flops - plain.linear_fwd_flops == 2 * 512 * 1024 * 8 * 128
    assert param_count("dense_block", {**GQA, "attention_gate": True}) - param_count("dense_block", GQA) == 1024 * 1024


def test_a_sliding_window_charges_the_pairs_it_sees():
    full = work("dense_block", GQA, text=4096)
    local = work("dense_block", {**GQA, "sliding_window": 1024}, text=4096)
    ratio = (2 * 1024 * 4096 - 1024 * 1024) / 4096 ** 2
    assert local.attention_core_fwd_flops == pytest.approx(ratio * full.attention_core_fwd_flops, rel=1e-12)
    assert local.fwd_bytes == full.fwd_bytes  # every token is still read and written once


def test_vit_windows_cut_the_scores_to_whole_windows_per_image():
    full = work("vit_block", VIT, image=128, images=(64, 64))  # two images of 256 patches each
    windowed = work("vit_block", {**VIT, "window": 64}, image=128, images=(64, 64))
    assert windowed.attention_core_fwd_flops == pytest.approx(full.attention_core_fwd_flops / 4, rel=1e-12)


def test_deepstack_features_cross_the_boundaries_between_tap_and_injection():
    plain = work("dense_block", GQA, text=512, image=100, images=(100,))
    carrying = work("dense_block", {**GQA, "side_width": 2 * 1024}, text=512, image=100, images=(100,))
    assert carrying.boundary_bytes - plain.boundary_bytes == 2 * 100 * 2 * 1024
    injecting = work("dense_block", {**GQA, "deepstack_in": True}, text=512, image=100, images=(100,))
    assert injecting.fwd_flops - plain.fwd_flops == 100 * 1024
    tap = work("vit_block", {**VIT, "deepstack_out": 1024}, image=100, images=(100,))
    assert tap.linear_fwd_flops > work("vit_block", VIT, image=100, images=(100,)).linear_fwd_flops


@pytest.mark.parametrize("dims", [DELTANET, {**GQA, "attention_gate": True, "qk_norm": True, "sliding_window": 256,
                                              "post_norms": True}])
def test_tensor_parallel_halves_each_variants_matmuls_and_core(dims):
    one, two = work("dense_block", dims, text=1024), work("dense_block", dims, text=1024, tp_degree=2)
    assert two.linear_fwd_flops == pytest.approx(one.linear_fwd_flops / 2, rel=1e-9)
    assert two.attention_core_fwd_flops == pytest.approx(one.attention_core_fwd_flops / 2, rel=1e-9)
    assert two.tp_comm_bytes > 0 == one.tp_comm_bytes


def test_deltanet_launches_the_chunked_kernels_and_its_norms_count_as_the_block_s():
    """The delta rule's six forward kernels and eight backward (two recomputed), fused or not; the gates and the
    gated norm fuse into one kernel each; the q/k norms of gated attention launch an RMSNorm's kernels each."""
    from mpipe_tune.cost._arch_layers import RMSNORM_KERNELS, build_layer
    from mpipe_tune.cost._kernel_passes import pass_kernels
    from mpipe_tune.inputs import resolve_dims

    mb = Microbatch(0, 4 * CHUNK_TOKENS)
    layer = build_layer("dense_block", resolve_dims("dense_block", DELTANET), mb, 1)
    core = [p for p in layer.pieces if p.attention_core]
    assert [sum(p.kernels[i] for p in core) for i in range(3)] == [6.0, 8.0, 0.0]
    eager, fused = pass_kernels(layer.pieces, "eager"), pass_kernels(layer.pieces, "fused")
    assert eager[0] - fused[0] >= (6 - 1) + (10 - 1)  # the gates' and the gated norm's eager kernels
    plain = build_layer("dense_block", resolve_dims("dense_block", GQA), mb, 1)
    normed = build_layer("dense_block", resolve_dims("dense_block", {**GQA, "qk_norm": True}), mb, 1)
    assert pass_kernels(normed.pieces, "eager")[0] - pass_kernels(plain.pieces, "eager")[0] == 2 * RMSNORM_KERNELS[0]
