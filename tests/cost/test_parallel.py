"""Expert parallelism and ZeRO-1 in the cost model: closed forms."""

import numpy as np
import pytest

from mpipe_tune.algebra import Degrees, Cut, Schedule, Skeleton, ArchCost, Layer, Model
from mpipe_tune.cost import _arch as arch, CostOptions, build_layer_table, LinkCost, estimate_collective_s, load_profile
from mpipe_tune.cost._update import estimate_update_s
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError

from conftest import with_link, predict_plan

IDEAL = load_profile("ideal")
HIDDEN, EXPERTS, TOP_K = 64, 8, 2
MOE_DIMS = {"hidden": HIDDEN, "heads": 4, "experts": EXPERTS, "top_k": TOP_K, "moe_ffn": 32, "shared_experts": 1}


def arch_layer(name, kind, **dims):
    return Layer(name, "llm", True, ArchCost(kind, tuple(sorted(dims.items()))))


MOE_MODEL = Model("tiny-moe", (
    arch_layer("embed", "embedding", vocab=128, hidden=HIDDEN),
    arch_layer("dense", "dense_block", hidden=HIDDEN, heads=4, ffn=128),
    *(arch_layer(f"moe{i}", "moe_block", **MOE_DIMS) for i in range(3)),
    arch_layer("head", "lm_head", hidden=HIDDEN, vocab=128),
))
TOKENS = 256
WORKLOAD = Workload(tuple(Microbatch(0, TOKENS) for _ in range(4)), "uniform")




def static_bytes(options: CostOptions, model: Model = MOE_MODEL) -> float:
    result = predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), model, WORKLOAD, IDEAL, 1, options=options)
    return result.memory.static_bytes[0]


# ------------------------------------------------------------------------------ all-to-all


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_all_to_all_bytes_per_moe_layer_and_direction(ep):
    # Megatron-Core's all-to-all dispatcher: each token travels as top_k copies (one per chosen
    # expert, no de-duplication); dispatch and combine each exchange a tokens*top_k*hidden buffer,
    # (ep-1)/ep of which leaves the rank.
    traffic = arch.estimate_parallel_traffic("moe_block", MOE_DIMS, Microbatch(0, TOKENS), dtype_bytes=2,
                                             ep_degree=ep)
    buffer_bytes = TOKENS * TOP_K * HIDDEN * 2
    assert traffic.all_to_all_bytes == (buffer_bytes, buffer_bytes)  # dispatch, combine
    per_byte = LinkCost(0.0, 1.0)  # one second per byte sent: the time reads the bytes leaving a rank
    for n in traffic.all_to_all_bytes:
        assert estimate_collective_s(per_byte, "all_to_all", n, ep) == pytest.approx(
            TOKENS * TOP_K * HIDDEN * 2 * (ep - 1) / ep, rel=1e-12)


def test_no_all_to_all_without_expert_parallelism_or_experts():
    mb = Microbatch(0, TOKENS)
    assert arch.estimate_parallel_traffic("moe_block", MOE_DIMS, mb, dtype_bytes=2).all_to_all_bytes == ()
    dense = {"hidden": HIDDEN, "heads": 4, "ffn": 128}
    assert arch.estimate_parallel_traffic("dense_block", dense, mb, dtype_bytes=2, ep_degree=4).all_to_all_bytes == ()


def test_moe_layer_pays_dispatch_and_combine_forward_and_backward():
    alpha, beta, ep = 3e-6, 1e-9, 4
    priced = with_link("all_to_all", LinkCost(alpha, beta))
    options = CostOptions(degrees=Degrees(1, dp=4, ep=ep))
    free = build_layer_table(MOE_MODEL, WORKLOAD, IDEAL, options)
    paid = build_layer_table(MOE_MODEL, WORKLOAD, priced, options)
    buffer_bytes = TOKENS * TOP_K * HIDDEN * 2
    one = (ep - 1) * (alpha + beta * buffer_bytes / ep)
    expected = np.array([0, 0, 2 * one, 2 * one, 2 * one, 0])[:, None]  # two all-to-alls per MoE layer
    counts = (ep - 1) * (alpha + beta * EXPERTS * 8 / ep)  # the forward's exchange of int64 token counts first
    assert paid.fwd_s - free.fwd_s == pytest.approx(np.broadcast_to(expected + (expected > 0) * counts,
                                                                    free.fwd_s.shape), rel=1e-9, abs=1e-18)
    assert paid.dgrad_s - free.dgrad_s == pytest.approx(np.broadcast_to(expected, free.fwd_s.shape), rel=1e-9,
                                                        abs=1e-18)
    assert np.array_equal(paid.wgrad_s, free.wgrad_s)


def test_load_imbalance_scales_the_busiest_ranks_rows_and_exchange():
    mb = Microbatch(0, TOKENS)
    even = arch.estimate_parallel_traffic("moe_block", MOE_DIMS, mb, dtype_bytes=2, ep_degree=4)
    skewed = arch.estimate_parallel_traffic("moe_block", MOE_DIMS, mb, dtype_bytes=2, ep_degree=4, moe_imbalance=1.5)
    assert skewed.all_to_all_bytes == tuple(1.5 * n for n in even.all_to_all_bytes)
    work = [arch.estimate_arch_work("moe_block", MOE_DIMS, mb, dtype_bytes=2, ep_degree=4, moe_imbalance=f)
            for f in (1.0, 1.5)]
    assert work[1].wgrad_flops > work[0].wgrad_flops
    # without expert parallelism there is no busiest rank: the factor is not read
    assert (arch.estimate_arch_work("moe_block", MOE_DIMS, mb, dtype_bytes=2, moe_imbalance=1.5)
            == arch.estimate_arch_work("moe_block", MOE_DIMS, mb, dtype_bytes=2))


# ------------------------------------------------------------------------------------ memory


def test_expert_state_is_divided_by_ep_exactly():
    table = build_layer_table(MOE_MODEL, WORKLOAD, IDEAL, CostOptions())
    experts = table.expert_params().sum()
    per_param = 2 + 4 + 12  # bf16 weights, fp32 gradients, Adam state
    assert experts == 3 * EXPERTS * 3 * HIDDEN * MOE_DIMS["moe_ffn"]  # swiglu: gate, up, down per expert
    base = static_bytes(CostOptions(shard_optimizer=False, degrees=Degrees(1, dp=8)))
    for ep in (2, 4, 8):
        sharded = static_bytes(CostOptions(shard_optimizer=False, degrees=Degrees(1, dp=8, ep=ep)))
        assert base - sharded == pytest.approx(experts * (1 - 1 / ep) * per_param, rel=1e-12)


@pytest.mark.parametrize(("dp", "ep"), [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2)])
def test_zero1_divides_optimizer_state_by_dp_exactly(dp, ep):
    # ZeRO-1: a rank holds 1/dp of the dense optimizer state, and 1/(dp/ep) of its 1/ep of the experts'
    table = build_layer_table(MOE_MODEL, WORKLOAD, IDEAL, CostOptions())
    params, experts = table.param_count.sum(), table.expert_params().sum()
    unsharded = static_bytes(CostOptions(shard_optimizer=False, degrees=Degrees(1, dp=dp, ep=ep)))
    zero1 = static_bytes(CostOptions(shard_optimizer=True, degrees=Degrees(1, dp=dp, ep=ep)))
    assert unsharded - zero1 == pytest.approx(12 * ((params - experts) * (1 - 1 / dp) + experts * (1 / ep - 1 / dp)),
                                              rel=1e-12)
    weights_and_grads = (params - experts * (1 - 1 / ep)) * (2 + 4)
    assert zero1 == pytest.approx(weights_and_grads + 12 * params / dp, rel=1e-12)


def test_expert_gradients_reduce_over_the_expert_data_parallel_group():
    priced = with_link("all_reduce", LinkCost(0.0, 1e-9))
    schedule = Schedule((Skeleton("1f1b"),))
    table = build_layer_table(MOE_MODEL, WORKLOAD, IDEAL, CostOptions())
    params, experts = table.param_count.sum(), table.expert_params().sum()

    def reduce_s(dp, ep):
        options = CostOptions(degrees=Degrees(1, dp=dp, ep=ep))
        result = predict_plan(Cut(()), schedule, MOE_MODEL, WORKLOAD, priced, 1, options=options)
        events = result.plan.order.events
        update_s = estimate_update_s(result.plan, MOE_MODEL, result.table, priced, options)[0]  # on the last reduce
        return sum(d for e, d in zip(events, result.timeline.durations_s) if type(e).__name__ == "DpReduce") - update_s

    ring = lambda n, g: 2 * (g - 1) * 1e-9 * n / g  # noqa: E731
    assert reduce_s(8, 1) == pytest.approx(ring(4 * params, 8), rel=1e-12)
    assert reduce_s(8, 4) == pytest.approx(ring(4 * (params - experts), 8) + ring(4 * experts / 4, 2), rel=1e-12)
    assert reduce_s(8, 8) == pytest.approx(ring(4 * (params - experts), 8), rel=1e-12)  # one rank per expert group


# ------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("options", "model", "message"), [
    (CostOptions(degrees=Degrees(1, dp=4, ep=3)), MOE_MODEL,
     "expert-parallel degree 3 must divide the data-parallel degree 4"),
    (CostOptions(degrees=Degrees(1, dp=16, ep=16)), MOE_MODEL, "must divide the 8 routed experts of layer 2"),
    (CostOptions(degrees=Degrees(1, dp=2, ep=2)), Model("dense", MOE_MODEL.layers[:2]), "needs MoE layers"),
    (CostOptions(moe_imbalance=0.5, degrees=Degrees(1, dp=2, ep=2)), MOE_MODEL, "must be a finite number >= 1"),
    (CostOptions(degrees=Degrees(1, ep=0)), MOE_MODEL, "must be integers >= 1"),
])
def test_bad_expert_parallel_degrees_get_one_line(options, model, message):
    with pytest.raises(MpipeError, match=message):
        static_bytes(options, model)

