"""RoPE on q and k in every decoder block, as the trainers run it (issue 28): Megatron-LM's (and MindSpeed's)
separate elementwise kernels, Megatron-LM's fused Transformer Engine kernel, or MindSpeed's fused NPU kernel inside
its unfused function's slicing and concatenation; forward and backward, timed as memory-bound kernels."""

import pytest

from mpipe_tune.algebra import Degrees
from mpipe_tune.cost import estimate_arch_work, ROPE_FORMS
from mpipe_tune.cost._layers import CostOptions, build_layer_table, pass_seconds
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload

BLOCK = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336}
TOKENS = 4096


def block_work(rope, *, tokens=TOKENS, dims=None, tp_degree=1, dtype_bytes=2):
    return estimate_arch_work("dense_block", {**BLOCK, **(dims or {})}, Microbatch(0, tokens), dtype_bytes=dtype_bytes,
                              tp_degree=tp_degree, rope=rope)


def rope_bytes(rope, field, **kwargs):
    """What RoPE adds to ``field``: the block less the same block without RoPE."""
    return (getattr(block_work(rope, **kwargs), field)
            - getattr(block_work(rope, **{**kwargs, "dims": {**kwargs.get("dims", {}), "rope_dim": 0}}), field))


def per_element(rope, field, **kwargs):
    """Bytes per element of q and k of a rank (the per-token tables cancel between two head counts)."""
    few = rope_bytes(rope, field, dims={"heads": 16, "kv_heads": 8}, **kwargs)
    many = rope_bytes(rope, field, dims={"heads": 32, "kv_heads": 8}, **kwargs)
    return (many - few) / (TOKENS * 16 * 128)


def test_the_unfused_kernels_move_what_megatron_s_apply_rotary_pos_emb_bshd_moves():
    # t*cos (4), -x2 (2), cat (4), *sin (4), add (6), cat with the unrotated part (4): 24 bytes per bf16 element;
    # backward: *sin (4), -x2 (2), the chunk's cat (4), *cos (4), sum (6), the empty slice's zeros (2) and sum (6)
    assert per_element("unfused", "memory_bound_fwd_bytes") == pytest.approx(24.0, rel=1e-12)
    assert per_element("unfused", "memory_bound_dgrad_bytes") == pytest.approx(28.0, rel=1e-12)


def test_the_fused_forms_make_fewer_passes():
    assert per_element("fused", "memory_bound_fwd_bytes") == pytest.approx(4.0, rel=1e-12)
    assert per_element("fused", "memory_bound_dgrad_bytes") == pytest.approx(4.0, rel=1e-12)
    assert per_element("mindspeed_fused", "memory_bound_fwd_bytes") == pytest.approx(8.0, rel=1e-12)
    assert per_element("mindspeed_fused", "memory_bound_dgrad_bytes") == pytest.approx(12.0, rel=1e-12)
    for field in ("memory_bound_fwd_bytes", "memory_bound_dgrad_bytes"):
        unfused, mindspeed, fused = (block_work(form).__getattribute__(field)
                                     for form in ("unfused", "mindspeed_fused", "fused"))
        assert unfused > mindspeed > fused
    profile = load_profile("ascend-910b")
    seconds = {form: pass_seconds(block_work(form), "dense_block", profile, "bf16")
               for form in ("unfused", "mindspeed_fused", "fused")}
    for phase in (0, 1):  # forward, input gradient
        assert seconds["unfused"][phase] > seconds["mindspeed_fused"][phase] > seconds["fused"][phase]


@pytest.mark.parametrize("rope", ["unfused", "fused", "mindspeed_fused"])
def test_rope_grows_with_the_tokens_and_the_heads(rope):
    by_tokens = [rope_bytes(rope, "memory_bound_fwd_bytes", tokens=t) for t in (1024, 4096, 8192)]
    by_heads = [rope_bytes(rope, "memory_bound_dgrad_bytes", dims={"heads": h, "kv_heads": 8}) for h in (8, 16, 32)]
    assert all(b > 0 for b in by_tokens + by_heads)
    assert by_tokens == sorted(by_tokens) and len(set(by_tokens)) == 3
    assert by_heads == sorted(by_heads) and len(set(by_heads)) == 3


def test_a_rank_rotates_its_share_of_the_q_heads_and_its_k_heads():
    # tp 2: 16 q heads and 4 kv heads a rank (20 of 40 heads fewer; the per-token tables are not split)
    full, half = (rope_bytes("unfused", "memory_bound_fwd_bytes", tp_degree=t) for t in (1, 2))
    assert full - half == pytest.approx(24 * TOKENS * 20 * 128, rel=1e-12)
    # tp 16: 2 q heads, and one of the 8 kv heads (replicated), against two of 32
    gqa = rope_bytes("unfused", "memory_bound_fwd_bytes", tp_degree=16)
    mha = rope_bytes("unfused", "memory_bound_fwd_bytes", dims={"heads": 32, "kv_heads": 32}, tp_degree=16)
    assert mha - gqa == pytest.approx(24 * TOKENS * 1 * 128, rel=1e-12)


def test_partial_rotation_copies_the_unrotated_part():
    # ChatGLM/GLM-4 rotate half of each head (--rotary-percent 0.5): fewer rotated elements, but the slices and the
    # concatenation still pass over the whole head
    full = rope_bytes("unfused", "memory_bound_fwd_bytes")
    half = rope_bytes("unfused", "memory_bound_fwd_bytes", dims={"rope_dim": 64})
    assert 0.4 * full < half < full


def test_a_model_without_rope_pays_nothing_for_it_whatever_the_form():
    # GPT-3's learned absolute positions: rope_dim 0
    works = [block_work(form, dims={"rope_dim": 0}) for form in ROPE_FORMS]
    assert all(work == works[0] for work in works)
    # the tool's own runtime applies none (what the profiler times and fits)
    assert block_work("none") == works[0] != block_work("fused")


def test_rope_keeps_its_tables_for_the_backward_unless_fused():
    assert rope_bytes("fused", "saved_activation_bytes") == 0
    tables = 2 * 2 * TOKENS * 128 * 2  # cos and sin for q and for k, bf16
    assert rope_bytes("unfused", "saved_activation_bytes") == pytest.approx(tables, rel=1e-12)
    assert rope_bytes("mindspeed_fused", "saved_activation_bytes") == pytest.approx(tables, rel=1e-12)


def test_only_the_decoder_blocks_and_both_passes_pay_for_it():
    model = load_model("llama3-8b")  # embedding, 32 decoder layers, head
    workload = Workload((Microbatch(0, 4096),), "one sequence")
    profile = load_profile("ascend-910b")
    tables = {form: build_layer_table(model, workload, profile, CostOptions(degrees=Degrees(2, tp=2), rope=form))
              for form in ("unfused", "fused")}
    kinds = [layer.cost.kind for layer in model.layers]
    for i, kind in enumerate(kinds):
        slow, fast = tables["unfused"], tables["fused"]
        if kind == "dense_block":
            assert slow.fwd_s[i, 0] > fast.fwd_s[i, 0] and slow.dgrad_s[i, 0] > fast.dgrad_s[i, 0]
        else:
            assert slow.fwd_s[i, 0] == fast.fwd_s[i, 0] and slow.dgrad_s[i, 0] == fast.dgrad_s[i, 0]


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="mindspeed_fused"):
        CostOptions(rope="npu")
