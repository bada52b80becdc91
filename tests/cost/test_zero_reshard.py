"""ZeRO-2 and ZeRO-3's reshard policy in the cost model, and the profile's measured comm/compute overlap."""

import numpy as np
import pytest

from mpipe_tune.algebra import Cut, Model, Schedule, Skeleton, Degrees, Bwd, Fwd
from mpipe_tune.cost import Framework, load_profile, parse_profile
from mpipe_tune.inputs import load_model

from mpipe_tune.cost import LinkCost, sharded_half_s

from conftest import charged_s, predict_plan, uniform_workload, with_link

H100 = load_profile("h100-sxm")
BACKBONE = Model("backbone", load_model("tiny-vit-llm").layers[4:])


def measured(phi: float):
    """H100 with a measured comm/compute overlap share."""
    data = {**H100.to_dict(), "comm_compute_overlap": {"value": phi, "source": "measured"}}
    return parse_profile(data, where="test")


def options(zero: int, reshard: bool = True, dp: int = 4, **kw):
    return Framework(**kw).cost_options(Degrees(1, dp=dp), zero_stage=zero, reshard_after_forward=reshard)


def run(model, opts, profile=H100, M=4, pp=2, slabs=((3, 3),)):
    return predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), model, uniform_workload(M, 0, 64), profile, pp,
                        slab_counts=slabs, options=opts)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_step_orders_as_the_collectives_per_microbatch(overlap):
    one, two, keep, reshard = (run(BACKBONE, options(z, r, overlap_dp_comm=overlap))
                               for z, r in ((1, True), (2, True), (3, False), (3, True)))
    # keeping the weights through the step gathers and reduce-scatters once a step: ZeRO-1's timing
    assert np.array_equal(keep.timeline.durations_s, one.timeline.durations_s)
    # stage 2 adds the per-microbatch reduce-scatters only; resharding adds the gathers too
    assert one.timeline.makespan_s < two.timeline.makespan_s < reshard.timeline.makespan_s
    assert keep.timeline.makespan_s <= reshard.timeline.makespan_s


def test_stage2_reduce_scatters_each_backward_and_gathers_nothing_per_microbatch():
    one, two, three = (run(BACKBONE, options(z)) for z in (1, 2, 3))
    extra2 = charged_s(two) - one.timeline.durations_s
    extra3 = charged_s(three) - one.timeline.durations_s
    events = two.plan.order.events
    forwards = [i for i, e in enumerate(events) if isinstance(e, Fwd)]
    backwards = [i for i, e in enumerate(events) if isinstance(e, Bwd)]
    later = [i for i in forwards if events[i].mb > 0]  # the first microbatch's gathers are the step-end reduce's
    assert np.all(extra2[forwards] == 0.0) and np.all(extra3[later] > 0.0)
    last = [i for i in backwards if events[i].mb == 3]  # its reduce-scatter is the step-end reduce's
    assert all(extra2[i] > 0.0 for i in backwards if i not in last) and np.all(extra2[last] == 0.0)
    assert np.all(extra2[backwards] <= extra3[backwards])


def test_stage2_memory_lies_between_stage1_and_stage3():
    model = load_model("llama3-70b")
    peaks = {z: max(predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), model, uniform_workload(8, 0, 512), H100, 4,
                                 options=options(z, dp=8)).memory.peak_bytes) for z in (1, 2, 3)}
    assert peaks[3] < peaks[2] < peaks[1]
    # stage 2 saves the gradients' 4 of ZeRO-1's bytes per parameter (but 4/8 of them), stage 3 the weights' 2 more
    weights = sum(run(model, options(1, dp=8), M=8, pp=4, slabs=None).table.param_count) / 4
    assert peaks[1] - peaks[2] == pytest.approx(weights * 4 * 7 / 8, rel=0.05)


def test_keeping_the_weights_holds_what_stage1_holds():
    one, keep = (run(BACKBONE, options(z, False)) for z in (1, 3))
    assert one.memory.static_bytes == keep.memory.static_bytes


def test_less_measured_overlap_never_shortens_a_step():
    for zero in (1, 2, 3):
        steps = [run(BACKBONE, options(zero), measured(phi)).timeline.makespan_s for phi in (1.0, 0.5, 0.0)]
        assert steps == sorted(steps)
        assert zero == 1 or steps[0] < steps[-1]  # the per-microbatch collectives are always in the way
    # with no overlap each wait is its whole collective (an upper bound: a backward's carries its neighbours' too)
    off = run(BACKBONE, options(3, overlap_dp_comm=False))
    none = run(BACKBONE, options(3), measured(0.0))
    assert none.timeline.makespan_s >= off.timeline.makespan_s


def host(seconds: float):
    """H100 with FSDP2's measured host seconds per sharded layer per call."""
    return parse_profile({**H100.to_dict(), "fsdp_host_s": {"value": seconds, "source": "measured"}}, where="test")


def test_fsdp2s_host_work_is_charged_per_sharded_layer_and_call_on_every_fsdp_stage():
    """With the profile's ``fsdp_host_s`` every stage-2 and stage-3 plan (keeping the weights too) pays it per
    sharded layer per forward and backward, on its sharding actions: on one rank, exactly that many seconds more;
    ZeRO-1 pays nothing."""
    h = 1e-4
    for zero, reshard in ((1, True), (2, True), (3, True), (3, False)):
        opts = options(zero, reshard)
        without, charged = (run(BACKBONE, opts, profile, pp=1, slabs=((6,),)) for profile in (H100, host(h)))
        calls = 2 * 4 * int((without.table.param_count > 0).sum())  # M = 4, a forward and a backward each
        extra = charged.timeline.makespan_s - without.timeline.makespan_s
        assert extra == pytest.approx(0.0 if zero == 1 else h * calls, rel=1e-9, abs=1e-15), (zero, reshard)
        assert np.array_equal(charged.timeline.durations_s, without.timeline.durations_s)


def _fsdp_charge(opts, zero: int, reshard: bool, M: int) -> tuple[float, float]:
    """Per parameter (bytes) and per sharded layer (collectives): what FSDP2 moves on one rank without overlap, at
    ``M`` microbatches: stage 2 its M - 1 per-microbatch reduce-scatters and the step-end reduce-scatter and
    gather, stage 3 resharding every gather before a forward after the first and before each backward too, stage 3
    keeping the weights only the step-end two; ZeRO-1's own flat buffers are not FSDP2's."""
    weights, grads, step_end = opts.dtype_bytes(), opts.grad_reduce_bytes(), 2 * opts.grad_bytes_per_param
    if zero == 1:
        return 0.0, 0.0
    if zero == 2:
        return (M - 1) * grads + step_end, (M - 1) + 2
    gathers = (M - 1) + M if reshard else 0
    return (gathers * weights + ((M - 1) * grads if reshard else 0.0) + step_end,
            gathers + ((M - 1) if reshard else 0) + 2)


@pytest.mark.parametrize("key", ["fsdp_bytes_s", "fsdp_collective_s", "fsdp_tensor_s"])
def test_fsdp2s_copies_and_collective_excess_are_charged_on_each_of_its_collectives(key):
    """With the profile's ``fsdp_bytes_s`` each FSDP2 collective pays it per byte of the layer's unsharded buffer;
    with its ``fsdp_collective_s`` once, one per sharded layer, the step-end reduce-scatter and gather too (FSDP2
    issues them layer by layer, not as one); with its ``fsdp_tensor_s`` once per parameter tensor of the layer."""
    value, M = {"fsdp_bytes_s": 1e-12, "fsdp_collective_s": 1e-4, "fsdp_tensor_s": 1e-5}[key], 4
    profile = parse_profile({**H100.to_dict(), key: {"value": value, "source": "measured"}}, where="test")
    for zero, reshard in ((1, True), (2, True), (3, True), (3, False)):
        opts = options(zero, reshard, overlap_dp_comm=False)
        without, charged = (run(BACKBONE, opts, p, pp=1, slabs=((6,),)) for p in (H100, profile))
        per_param, per_layer = _fsdp_charge(opts, zero, reshard, M)
        count = {"fsdp_bytes_s": per_param * without.table.param_count.sum(),
                 "fsdp_collective_s": per_layer * int((without.table.param_count > 0).sum()),
                 "fsdp_tensor_s": per_layer * without.table.param_tensor_count.sum()}[key]
        assert key != "fsdp_tensor_s" or without.table.param_tensor_count.sum() > len(without.table.param_count)
        extra = charged.timeline.makespan_s - without.timeline.makespan_s
        assert extra == pytest.approx(value * count, rel=1e-6), (zero, reshard)


def test_a_moe_layers_gathers_carry_its_routed_experts_whole_at_ep_1_and_their_share_at_ep_2():
    """FSDP2 shards a MoE layer's routed experts with the rest of the layer without expert parallelism (every byte
    gathered), and as their own unit on the experts' group with it (each rank gathers its experts' share there)."""
    from mpipe_tune.cost._layers import build_layer_table
    from mpipe_tune.cost._sharding_events import layer_collectives_s

    model = load_model("tests/runtime/tiny-mla-moe.yaml")
    link = LinkCost(alpha_s=0.0, beta_s_per_byte=1e-9)
    per_byte = with_link("reduce_scatter", link, with_link("all_gather", link))
    workload = uniform_workload(2, 16, 32)
    moe = [i for i, layer in enumerate(model.layers) if layer.cost.kind == "moe_block"]
    gathered = {}
    for ep in (1, 2):
        opts = Framework().cost_options(Degrees(1, dp=4, ep=ep), zero_stage=3, reshard_after_forward=True)
        table = build_layer_table(model, workload, per_byte, opts)
        gathers, _ = layer_collectives_s(table, per_byte, opts)
        gathered[ep] = gathers[moe]
        expected = [sharded_half_s(per_byte, "all_gather", (table.param_count[i] - table.expert_params()[i])
                                   * opts.dtype_bytes(), 4, 1)
                    + sharded_half_s(per_byte, "all_gather", table.expert_params()[i] / ep * opts.dtype_bytes(),
                                     4 // ep, 1) for i in moe]
        if ep == 1:
            expected = [sharded_half_s(per_byte, "all_gather", table.param_count[i] * opts.dtype_bytes(), 4, 1)
                        for i in moe]
        assert gathered[ep] == pytest.approx(expected, rel=1e-9)
    assert np.all(gathered[1] > gathered[2])
