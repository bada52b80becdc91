"""The runtime's costs the layer roofline does not see: the optimizer update after each rank's last
event, and the ViT block's per-image attention calls. Closed forms on the ideal profile."""

import numpy as np
import pytest

from mpipe_tune.algebra import Degrees, Cut, parse_schedule, DpReduce, StepBarrier
from mpipe_tune.cost import _arch as arch, CostOptions, build_layer_table, load_profile, parse_profile
from mpipe_tune.cost._update import estimate_update_s
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model

from conftest import predict_plan

MODEL = load_model("tiny-vit-llm")
FIRST_LLM = MODEL.backbone_start
WORKLOAD = Workload(tuple(Microbatch(16, 64, (4, 12)) for _ in range(4)), "four")
SGD = CostOptions(dtype="fp32", optimizer_bytes_per_param=0.0)
UPDATE_RATE = 2e9


def ideal_with(**top) -> object:
    data = load_profile("ideal").to_dict()
    data.update({k: {"value": v, "source": "ideal"} for k, v in top.items()})
    return parse_profile(data, where="test")


def params(layers) -> float:
    return float(sum(arch.param_count(MODEL.layers[i].cost.kind, MODEL.layers[i].cost.dims_dict()) for i in layers))


def last_event_s(result, rank: int) -> tuple[object, float]:
    nodes = [i for i in result.plan.order.nodes[rank] if not isinstance(result.plan.order.events[i], StepBarrier)]
    return result.plan.order.events[nodes[-1]], float(result.timeline.durations_s[nodes[-1]])


def test_each_rank_updates_its_trainable_weights_after_its_last_reduce():
    profile = ideal_with(optimizer_update_bytes_per_s=UPDATE_RATE)
    result = predict_plan(Cut(()), parse_schedule("1f1b"), MODEL, WORKLOAD, profile, 2, options=SGD)
    for rank in range(2):
        start, stop = result.plan.slab(1, rank)
        expected = params(range(start, stop)) * 12 / UPDATE_RATE  # SGD in fp32: read w and g, write w
        event, seconds = last_event_s(result, rank)
        assert isinstance(event, DpReduce) and event.rank == rank
        assert seconds == pytest.approx(expected, rel=1e-12)  # a one-member reduce costs nothing itself
    assert result.timeline.makespan_s == pytest.approx(max(
        float(result.timeline.finish_s[i]) for i in range(len(result.plan.order.events))), rel=1e-12)


def test_state_bytes_count_twice_and_a_distributed_optimizer_updates_a_shard():
    profile = ideal_with(optimizer_update_bytes_per_s=UPDATE_RATE)
    table = build_layer_table(MODEL, WORKLOAD, profile, CostOptions())
    plan = predict_plan(Cut(()), parse_schedule("1f1b"), MODEL, WORKLOAD, profile, 1).plan
    everything = params(range(MODEL.num_layers))
    adam = CostOptions(dtype="bf16", shard_optimizer=False, degrees=Degrees(1, dp=4))  # 12 state bytes, fp32 gradients
    assert estimate_update_s(plan, MODEL, table, profile, adam)[0] == pytest.approx(
        everything * (2 * 2 + 4 + 2 * 12) / UPDATE_RATE, rel=1e-12)
    sharded = CostOptions(dtype="bf16", shard_optimizer=True, degrees=Degrees(1, dp=4))
    assert estimate_update_s(plan, MODEL, table, profile, sharded)[0] == pytest.approx(
        everything * (2 * 2 + 4 + 2 * 12) / 4 / UPDATE_RATE, rel=1e-12)
    frozen = MODEL.with_frozen(("encoder", "llm"))
    assert estimate_update_s(plan, frozen, table, profile, adam)[0] == 0.0


def test_a_profile_without_a_measured_rate_updates_at_its_memory_bandwidth():
    ideal = load_profile("ideal")
    assert ideal.optimizer_update_bytes_per_s is None and ideal.update_bytes_per_s == ideal.memory_bytes_per_s
    measured = ideal_with(optimizer_update_bytes_per_s=UPDATE_RATE)
    assert measured.update_bytes_per_s == UPDATE_RATE
    assert parse_profile(measured.to_dict(), where="round trip") == measured
    with pytest.raises(MpipeError, match="optimizer_update_bytes_per_s.value.*must be > 0"):
        ideal_with(optimizer_update_bytes_per_s=0.0)


def test_a_shared_last_event_carries_the_largest_update_of_the_ranks_that_share_it():
    """Transposed trainable encoder, frozen backbone: every rank ends on the ReplicaGroup reduce, and
    every rank updates the whole encoder (a replica each)."""
    profile = ideal_with(optimizer_update_bytes_per_s=UPDATE_RATE)
    model = MODEL.with_frozen(("llm",))
    result = predict_plan(Cut((FIRST_LLM,)), parse_schedule("transpose,1f1b"), model, WORKLOAD, profile, 2, options=SGD)
    trainable = [i for i, u in enumerate(model.layers) if u.trainable]
    for rank in range(2):
        event, seconds = last_event_s(result, rank)
        assert isinstance(event, DpReduce) and event.rank is None
    free = predict_plan(Cut((FIRST_LLM,)), parse_schedule("transpose,1f1b"), model, WORKLOAD, load_profile("ideal"), 2,
                   options=SGD)
    _, free_seconds = last_event_s(free, 0)  # the same reduce at the ideal profile's 1e13 B/s
    update = params(trainable) * 12
    assert seconds - free_seconds == pytest.approx(update / UPDATE_RATE - update / 1e13, rel=1e-9)


def test_vit_blocks_pay_a_call_per_image_beyond_the_first():
    fwd_image_s, bwd_image_s = 3e-4, 7e-4
    data = load_profile("ideal").to_dict()
    data["efficiency"]["vit_block"] = {"value": 1.0, "forward_image_overhead_s": fwd_image_s,
                                       "backward_image_overhead_s": bwd_image_s, "source": "ideal"}
    profile = parse_profile(data, where="test")
    assert parse_profile(profile.to_dict(), where="round trip") == profile
    mbs = (Microbatch(16, 64, (4, 12)), Microbatch(16, 64, (2, 2, 12)), Microbatch(16, 64), Microbatch(0, 64))
    workload = Workload(mbs, "images")
    with_calls = build_layer_table(MODEL, workload, profile, SGD)
    plain = build_layer_table(MODEL, workload, load_profile("ideal"), SGD)
    extra_images = np.array([1, 2, 0, 0])
    vit = np.array([u.cost.kind == "vit_block" for u in MODEL.layers])
    assert vit.any()
    np.testing.assert_allclose(with_calls.fwd_s[vit] - plain.fwd_s[vit], np.outer(np.ones(vit.sum()),
                                                                                 extra_images * fwd_image_s), rtol=1e-9)
    np.testing.assert_allclose((with_calls.backward_s(MODEL) - plain.backward_s(MODEL))[vit],
                               np.outer(np.ones(vit.sum()), extra_images * bwd_image_s), rtol=1e-9)
    np.testing.assert_array_equal(with_calls.fwd_s[~vit], plain.fwd_s[~vit])  # other kinds: no per-image call


def test_docstring_examples():
    import doctest

    from mpipe_tune.cost import _update as update

    assert doctest.testmod(update).failed == 0
