"""The one predictor: predict, the search's evaluator and the runtime's per-step owners read it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpipe_tune.algebra import Candidate, round_robin
from mpipe_tune.cost import _predictor as predictor_module, Framework
from mpipe_tune.cost._layers import FRAMEWORK_OPTIONS, CostOptions
from mpipe_tune.cost import choose_owners, predict, Predictor
from mpipe_tune.search import Evaluator, Problem
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL = load_model("example-mllm")
PROFILE = load_profile("ideal")
BASE = Candidate("transpose,1f1b", (MODEL.backbone_start,), pp=4, tp=1, dp=1, num_microbatches=8,
                 owner_policy="greedy")


@pytest.fixture(scope="module")
def evaluator():
    return Evaluator(Problem(MODEL, PROFILE, 4, 8, mix="image-heavy", num_samples=2, seed=3))


def test_the_framework_is_built_from_inputs_and_the_candidate_gives_degrees_and_memory_policy():
    framework = Framework.from_inputs({"moe_imbalance": 1.25, "overlap_dp_comm": False, "unrelated": 1})
    record = framework.cost_options().framework()
    assert record == {"moe_imbalance": 1.25, "grad_reduce_dtype": "fp32", "overlap_dp_comm": False,
                      "kernel_mode": "fused", "moe_dispatcher": "alltoall", "moe_capacity_factor": None,
                      "moe_pad_to_capacity": False, "flat_buffer_copies": False}
    assert set(record) == set(FRAMEWORK_OPTIONS) and Framework.from_inputs(record) == framework
    c = replace(BASE, tp=2, dp=4, ep=2, recompute="selective", zero_stage=0, sequence_parallel=True, dtype="fp32")
    o = framework.options(c)
    assert (o.degrees.tp, o.degrees.dp, o.degrees.ep, o.recompute, o.shard_optimizer, o.sequence_parallel, o.dtype) == (
        2, 4, 2, "selective", False, True, "fp32")
    assert (o.moe_imbalance, o.overlap_dp_comm) == (1.25, False)
    assert Framework.of(o) == framework
    assert Framework.from_inputs(CostOptions(grad_reduce_dtype="bf16").framework()).grad_reduce_dtype == "bf16"


def test_compile_is_cached_and_an_owner_map_retimes_the_same_derived_plan():
    p = Predictor(MODEL, PROFILE)
    c = BASE
    weights = (1.0,) * MODEL.num_layers
    first = p.compile(c, layer_weights=weights)
    assert p.compile(c, layer_weights=weights) is first
    owners = (3, 2, 1, 0, 3, 2, 1, 0)
    retimed = p.compile(c, layer_weights=weights, owners=owners)
    assert retimed.owners == owners and retimed.derived is first.derived


def test_the_evaluators_winner_is_predicted_from_the_search_compiled_plan_once(evaluator, monkeypatch):
    c = replace(BASE, encoder_backward="optimised")
    evaluation = evaluator.evaluate(c)
    derives = []
    original = predictor_module.derive
    monkeypatch.setattr(predictor_module, "derive", lambda *a, **k: derives.append(a) or original(*a, **k))
    prediction, workload = evaluator.prediction(c)
    assert derives == []  # no second route: the search's compiled plan, re-timed
    assert evaluator.prediction(c)[0] is prediction  # and no third prediction for a picture
    assert prediction.timeline.makespan_s == pytest.approx(evaluation.makespans_s[0], rel=1e-12)
    # The stored candidate predicts the same step from scratch, as show and run read it.
    again = predict(prediction.candidate, MODEL, workload, PROFILE)
    assert again.plan.order == prediction.plan.order
    assert again.timeline.makespan_s == prediction.timeline.makespan_s


def test_per_step_owners_are_one_choice_for_the_search_and_the_runtime(evaluator):
    for sample in range(2):
        _, table = evaluator.table(sample, BASE)
        slabs = evaluator.slab_counts(BASE)
        p = evaluator.predictor
        c = replace(BASE, slab_counts=slabs)
        # The runtime's route: slack off the round-robin re-timing of the compiled plan, on the table.
        runtime = p.owners(c, table, fallback=False)
        slack = p.compile(c).with_owners(round_robin(8, 4)).timeline(table).warmup_slack_s
        assert runtime == choose_owners("greedy", p.encode_s(c, table), slack)
        assert evaluator.owners(BASE, sample) == runtime.owners
    assert evaluator.predictor.owners(replace(BASE, owner_policy="round-robin"), table).owners == round_robin(8, 4)
    assert evaluator.predictor.owners(replace(BASE, schedule="1f1b", cut=(), owner_policy=None), table) is None
