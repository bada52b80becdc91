"""The vocab-parallel cross-entropy as Megatron-LM runs it (issue 28): the logits cast to fp32 and passed over
several times forward and backward, the fp32 softmax kept for the backward, timed as memory-bound kernels; only
the head computes it."""

import pytest

from mpipe_tune.algebra import Degrees
from mpipe_tune.cost import estimate_arch_work
from mpipe_tune.cost._layers import CostOptions, build_layer_table, pass_seconds
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload

HEAD = {"hidden": 1024, "vocab": 32000}
TOKENS = 2048


def head_work(vocab=32000, tokens=TOKENS, *, dtype_bytes=2, tp_degree=1, fused_loss=False):
    return estimate_arch_work("lm_head", {**HEAD, "vocab": vocab}, Microbatch(0, tokens), dtype_bytes=dtype_bytes,
                              tp_degree=tp_degree, fused_loss=fused_loss)


def per_logit(field, *, tp_degree=1, **kwargs):
    """Bytes of ``field`` per logit a rank holds, from two vocabularies (the per-token terms cancel)."""
    small, large = (getattr(head_work(v, tp_degree=tp_degree, **kwargs), field) for v in (32000, 64000))
    return (large - small) / (TOKENS * 32000 / tp_degree)


def test_the_loss_moves_the_fp32_passes_megatron_makes_over_every_logit():
    # bf16 step: the cast (2 B read, 4 B written), max (4), subtract (8), exp (8), sum (4), divide (8) forward;
    # multiply by the output gradient (8) and the cast back (4 + 2) backward
    assert per_logit("memory_bound_fwd_bytes") == pytest.approx(38.0, rel=1e-12)
    assert per_logit("memory_bound_dgrad_bytes") == pytest.approx(14.0, rel=1e-12)
    # an fp32 step casts nothing
    assert per_logit("memory_bound_fwd_bytes", dtype_bytes=4) == pytest.approx(32.0, rel=1e-12)
    assert per_logit("memory_bound_dgrad_bytes", dtype_bytes=4) == pytest.approx(8.0, rel=1e-12)


def test_the_fused_loss_makes_fewer_passes_and_keeps_the_same_softmax():
    assert per_logit("memory_bound_fwd_bytes", fused_loss=True) == pytest.approx(22.0, rel=1e-12)
    assert per_logit("memory_bound_dgrad_bytes", fused_loss=True) == pytest.approx(6.0, rel=1e-12)
    assert per_logit("saved_activation_bytes", fused_loss=True) == per_logit("saved_activation_bytes")


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_the_softmax_kept_for_the_backward_is_fp32_whatever_the_dtype(dtype_bytes):
    assert per_logit("saved_activation_bytes", dtype_bytes=dtype_bytes) == pytest.approx(4.0, rel=1e-12)
    assert per_logit("saved_activation_bytes", dtype_bytes=dtype_bytes, tp_degree=4) == pytest.approx(4.0, rel=1e-12)


def test_the_loss_grows_with_the_vocabulary_and_the_tokens():
    by_vocab = [head_work(v).memory_bound_fwd_bytes for v in (32000, 128256, 151936)]
    by_tokens = [head_work(tokens=t).memory_bound_dgrad_bytes for t in (1024, 4096, 8192)]
    assert by_vocab == sorted(by_vocab) and len(set(by_vocab)) == 3
    assert by_tokens == sorted(by_tokens) and len(set(by_tokens)) == 3
    profile = load_profile("ascend-910b")  # the memory-bound kernels on their own roofline
    seconds = [pass_seconds(head_work(v), "lm_head", profile, "bf16") for v in (32000, 151936)]
    assert all(large > small for small, large in zip(*seconds))


def test_its_three_per_token_all_reduces_move_fp32():
    tp1, tp2 = head_work(tp_degree=1), head_work(tp_degree=2)
    assert tp1.tp_comm_bytes == 0
    assert tp2.tp_comm_bytes == pytest.approx(3 * TOKENS * 4, rel=1e-12)


def test_only_the_head_computes_the_loss():
    model = load_model("llama3-8b")  # embedding, 32 decoder layers, head
    workload = Workload((Microbatch(0, 4096),), "one sequence")
    profile = load_profile("ascend-910b")
    options = CostOptions(degrees=Degrees(2, tp=2))
    plain = build_layer_table(model, workload, profile, options)
    fused = build_layer_table(model, workload, profile, CostOptions(degrees=Degrees(2, tp=2), fused_loss=True))
    assert [layer.cost.kind for layer in model.layers][-1] == "lm_head"
    assert (plain.fwd_s[:-1] == fused.fwd_s[:-1]).all() and (plain.dgrad_s[:-1] == fused.dgrad_s[:-1]).all()
    assert plain.fwd_s[-1, 0] > fused.fwd_s[-1, 0] and plain.dgrad_s[-1, 0] > fused.dgrad_s[-1, 0]
    for kind in ("dense_block", "embedding"):
        work = estimate_arch_work(kind, {"hidden": 1024, "heads": 8, "ffn": 4096, "vocab": 32000},
                                  Microbatch(0, TOKENS), dtype_bytes=2, fused_loss=True)
        assert work == estimate_arch_work(kind, {"hidden": 1024, "heads": 8, "ffn": 4096, "vocab": 32000},
                                          Microbatch(0, TOKENS), dtype_bytes=2)
