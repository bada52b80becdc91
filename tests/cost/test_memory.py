import numpy as np
import pytest

from mpipe_tune.algebra import Degrees, Cut, Schedule, Skeleton, parse_schedule
from mpipe_tune.cost import CostOptions, load_profile
from mpipe_tune.inputs import load_model

from conftest import uniform_workload, predict_plan

IDEAL = load_profile("ideal")
TINY = load_model("tiny-vit-llm")  # 4 encoder layers, embedding, 4 decoder blocks, head


def backbone_only(P, M, skeleton, options=CostOptions()):
    from mpipe_tune.algebra import Model

    model = Model("backbone", TINY.layers[4:])  # embed, 4 decoders, head: 6 layers
    slabs = ((3, 3),) if P == 2 else None
    return predict_plan(Cut(()), Schedule((Skeleton(skeleton),)), model, uniform_workload(M, 0, 64), IDEAL, P,
                   slab_counts=slabs, options=options), model


def test_static_memory_is_weights_grads_and_optimizer_of_the_slabs():
    result, model = backbone_only(2, 4, "1f1b", CostOptions(dtype="bf16", shard_optimizer=False))
    params = result.table.param_count
    expected = [params[:3].sum() * (2 + 4 + 12), params[3:].sum() * (2 + 4 + 12)]
    assert result.memory.static_bytes == pytest.approx(expected)


def test_frozen_layers_hold_weights_only_and_optimizer_shards_over_dp():
    model = TINY.with_frozen(("encoder",))
    options = CostOptions(shard_optimizer=True, degrees=Degrees(1, dp=4))
    result = predict_plan(Cut((4,)), parse_schedule("transpose,1f1b"), model, uniform_workload(4, 16, 64), IDEAL, 2,
                     slab_counts=((3, 3),), options=options)
    p = result.table.param_count
    encoder = p[:4].sum() * 2
    assert result.memory.static_bytes[0] == pytest.approx(encoder + p[4:7].sum() * (2 + 4 + 12 / 4))


def test_1f1b_holds_p_microbatches_in_flight_and_gpipe_holds_m():
    one_f, _ = backbone_only(2, 4, "1f1b")
    gpipe, _ = backbone_only(2, 4, "gpipe")
    saved_stage0 = one_f.table.saved_bytes[:3, 0].sum()
    assert saved_stage0 > 0
    gap = gpipe.memory.activation_peak_bytes[0] - one_f.memory.activation_peak_bytes[0]
    assert gap == pytest.approx(2 * saved_stage0)


def test_recomputation_lowers_the_activation_peak_and_costs_time():
    plain, _ = backbone_only(2, 4, "1f1b")
    recompute, _ = backbone_only(2, 4, "1f1b", CostOptions(recompute=True))
    assert recompute.memory.activation_peak_bytes[0] < plain.memory.activation_peak_bytes[0]
    assert recompute.timeline.makespan_s > plain.timeline.makespan_s


def test_transposed_encoder_activations_live_across_the_backbone_span():
    # The encoder's saved activations of every owned microbatch stay live until the cooldown.
    result = predict_plan(Cut((4,)), parse_schedule("transpose,1f1b"), TINY, uniform_workload(4, 16, 64), IDEAL, 2,
                     slab_counts=((3, 3),))
    encoder_saved = result.table.saved_bytes[:4, 0].sum()
    assert result.memory.activation_peak_bytes[1] >= 2 * encoder_saved  # rank 1 owns microbatches 1 and 3


def test_plans_over_capacity_are_flagged():
    from dataclasses import replace

    small = replace(IDEAL, memory_capacity_bytes=1.0)
    result = predict_plan(Cut(()), parse_schedule("1f1b"), TINY, uniform_workload(2, 16, 64), small, 2)
    assert result.memory.over_capacity == (True, True) and not result.memory.fits
    assert predict_plan(Cut(()), parse_schedule("1f1b"), TINY, uniform_workload(2, 16, 64), IDEAL, 2).memory.fits
