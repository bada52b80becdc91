"""Context parallelism (ring attention) and sequence parallelism in the cost model: closed forms."""

import pytest

from mpipe_tune.algebra import Degrees, Cut, Schedule, Skeleton, ArchCost, Layer, Model
from mpipe_tune.cost import _arch as arch, CostOptions, build_layer_table, LinkCost, load_profile, parse_profile
from mpipe_tune.cost._update import estimate_update_s
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from conftest import predict_plan

IDEAL = load_profile("ideal")
S, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 256, 8, 2, 32
GQA = {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": 512}
MLA = {"hidden": HIDDEN, "heads": HEADS, "ffn": 512, "attention": "mla", "q_lora_rank": 64, "kv_lora_rank": 32,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
TEXT = Microbatch(0, S)


def layer(kind, dims, block="llm"):
    return Layer(kind, block, True, ArchCost(kind, tuple(sorted(dims.items()))))


MODEL = Model("cp", (layer("embedding", {"vocab": 512, "hidden": HIDDEN}), layer("dense_block", GQA),
                     layer("dense_block", MLA), layer("lm_head", {"hidden": HIDDEN, "vocab": 512})))
WORKLOAD = Workload((TEXT, TEXT), "two")


def priced(collective, link):
    data = IDEAL.to_dict()
    for link_class in ("intra_node", "inter_node"):
        data["links"][link_class][collective] = {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
                                                 "source": "ideal"}
    return parse_profile(data, where="test")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_traffic_closed_form(cp):
    # Each ring step a rank sends its 1/cp share of k and v to the next rank: cp - 1 steps forward;
    # backward steps pass k, v and the accumulating dk, dv, twice the bytes.
    gqa = arch.estimate_parallel_traffic("dense_block", GQA, TEXT, dtype_bytes=2, cp_degree=cp)
    assert gqa.ring_steps == cp - 1
    assert gqa.ring_step_bytes == S / cp * KV_HEADS * 2 * HEAD_DIM * 2
    mla = arch.estimate_parallel_traffic("dense_block", MLA, TEXT, dtype_bytes=2, cp_degree=cp, tp_degree=2)
    assert mla.ring_step_bytes == S / cp * (HEADS / 2) * ((16 + 8) + 16) * 2  # expanded per-head k and v, per tp rank
    assert arch.estimate_parallel_traffic("dense_block", GQA, TEXT, dtype_bytes=2).ring_steps == 0


def test_ring_exchange_is_charged_only_beyond_the_overlapped_core_compute():
    cp, beta = 4, 1e-9
    options = CostOptions(degrees=Degrees(1, cp=cp))
    free = build_layer_table(MODEL, WORKLOAD, IDEAL, options)
    for slow in (1e-12, 1e-3):  # the transfer hidden under the core's compute, then exposed
        paid = build_layer_table(MODEL, WORKLOAD, priced("p2p", LinkCost(0.0, slow)), options)
        for i, dims in ((1, GQA), (2, MLA)):
            work = arch.estimate_arch_work("dense_block", dims, TEXT, dtype_bytes=2, cp_degree=cp)
            traffic = arch.estimate_parallel_traffic("dense_block", dims, TEXT, dtype_bytes=2, cp_degree=cp)
            core_fwd = max(work.attention_core_fwd_flops / IDEAL.peak("bf16"),
                           work.attention_core_fwd_bytes / IDEAL.memory_bytes_per_s)
            core_bwd = max(work.attention_core_dgrad_flops / IDEAL.peak("bf16"),
                           work.attention_core_dgrad_bytes / IDEAL.memory_bytes_per_s)
            fwd_exposed = (cp - 1) * max(0.0, slow * traffic.ring_step_bytes - core_fwd / cp)
            bwd_exposed = (cp - 1) * max(0.0, slow * 2 * traffic.ring_step_bytes - core_bwd / cp)
            assert paid.fwd_s[i, 0] - free.fwd_s[i, 0] == pytest.approx(fwd_exposed, rel=1e-9, abs=1e-18)
            assert paid.dgrad_s[i, 0] - free.dgrad_s[i, 0] == pytest.approx(bwd_exposed, rel=1e-9, abs=1e-18)
            assert (fwd_exposed > 0) == (slow > beta)


def test_context_parallelism_divides_a_decoders_work_and_activations():
    for dims in (GQA, MLA):
        one = arch.estimate_arch_work("dense_block", dims, TEXT, dtype_bytes=2)
        split = arch.estimate_arch_work("dense_block", dims, TEXT, dtype_bytes=2, cp_degree=4)
        assert split.fwd_flops == pytest.approx(one.fwd_flops / 4, rel=1e-12)
        assert split.wgrad_flops == pytest.approx(one.wgrad_flops / 4, rel=1e-12)
        assert split.saved_activation_bytes == pytest.approx(one.saved_activation_bytes / 4, rel=1e-12)
        assert split.boundary_bytes == one.boundary_bytes / 4
    vit = {"hidden": 64, "heads": 4, "ffn": 128, "merge_factor": 4}
    image = Microbatch(256, 512)
    assert (arch.estimate_arch_work("vit_block", vit, image, dtype_bytes=2, cp_degree=4)
            == arch.estimate_arch_work("vit_block", vit, image, dtype_bytes=2))  # the encoder is not split


def test_sequence_parallelism_shards_the_tensors_outside_the_tensor_parallel_regions():
    # x, its norm x_norm1 (the q/k/v projections' saved input), x_mid and x_norm2: each 1/tp per rank
    tp = 4
    plain = arch.estimate_arch_work("dense_block", GQA, TEXT, dtype_bytes=2, tp_degree=tp)
    sp = arch.estimate_arch_work("dense_block", GQA, TEXT, dtype_bytes=2, tp_degree=tp, sequence_parallel=True)
    assert plain.saved_activation_bytes - sp.saved_activation_bytes == pytest.approx(
        4 * S * HIDDEN * 2 * (1 - 1 / tp), rel=1e-12)
    assert sp.boundary_bytes == plain.boundary_bytes / tp
    # reduce-scatter + all-gather in place of each all-reduce: the same bytes over the same ring
    assert sp.tp_comm_bytes == plain.tp_comm_bytes
    assert (arch.estimate_arch_work("dense_block", GQA, TEXT, dtype_bytes=2, sequence_parallel=True)
            == arch.estimate_arch_work("dense_block", GQA, TEXT, dtype_bytes=2))  # nothing to shard at tp 1


def test_context_parallel_ranks_shard_the_optimizer_and_reduce_together():
    params = build_layer_table(MODEL, WORKLOAD, IDEAL, CostOptions()).param_count.sum()
    schedule = Schedule((Skeleton("1f1b"),))
    profile = priced("all_reduce", LinkCost(0.0, 1e-9))

    def run(**degrees):
        return predict_plan(Cut(()), schedule, MODEL, WORKLOAD, profile, 1,
                            options=CostOptions(degrees=Degrees(1, **degrees)))

    for dp, cp in ((2, 1), (1, 2), (2, 4)):
        result = run(dp=dp, cp=cp)
        assert result.memory.static_bytes[0] == pytest.approx(params * (2 + 4 + 12 / (dp * cp)), rel=1e-12)
        reduce_s = sum(d for e, d in zip(result.plan.order.events, result.timeline.durations_s)
                       if type(e).__name__ == "DpReduce")
        # the rank's last event, its reduce, also carries its optimizer update
        reduce_s -= estimate_update_s(result.plan, MODEL, result.table, profile,
                                      CostOptions(degrees=Degrees(1, dp=dp, cp=cp)))[0]
        g = dp * cp
        assert reduce_s == pytest.approx(2 * (g - 1) * 1e-9 * 4 * params / g, rel=1e-12)


@pytest.mark.parametrize(("degrees", "message"), [
    ({"dp": 2, "cp": 2, "ep": 8}, "must divide the data-parallel degree 2 times the context"),
    ({"dp": 4, "cp": 4, "ep": 2}, "and be a multiple of 4"),
    ({"cp": 0}, "context-parallel degree is 0"),
])
def test_bad_context_parallel_degrees_get_one_line(degrees, message):
    with pytest.raises(MpipeError, match=message):
        CostOptions(degrees=Degrees(1, **degrees)).validate_degrees()
