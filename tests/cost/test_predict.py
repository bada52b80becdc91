"""predict(candidate, model, workload, profile, options): one call from a Candidate to a prediction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import make_model, uniform_workload
from mpipe_tune.algebra import Candidate
from mpipe_tune.cost import CostOptions
from mpipe_tune.cost._predict import cost_options, predict
from mpipe_tune.cost import load_profile
from mpipe_tune.errors import MpipeError

MODEL = make_model(["encoder"] * 2 + ["llm"] * 8)
IDEAL = load_profile("ideal")
CANDIDATE = Candidate("transpose,1f1b", (2,), pp=4, tp=1, dp=1, num_microbatches=6, owner_policy="round-robin")


def test_the_prediction_carries_its_candidate_with_derives_choices_made_explicit():
    workload = uniform_workload(6, 4, 8)
    first = predict(CANDIDATE, MODEL, workload, IDEAL)
    c = first.candidate
    assert c.slab_counts == ((2, 2, 2, 2),) and c.owner_map == (0, 1, 2, 3, 0, 1)
    assert replace(c, slab_counts=None, owner_map=None) == CANDIDATE
    again = predict(c, MODEL, workload, IDEAL)
    assert again.plan.order == first.plan.order and again.timeline.makespan_s == first.timeline.makespan_s


def test_the_candidate_decides_the_degrees_the_options_the_rest():
    options = cost_options(replace(CANDIDATE, tp=2, dtype="fp32", recompute="full", zero_stage=0),
                           CostOptions(moe_imbalance=1.5))
    assert (options.degrees.tp, options.dtype, options.recompute, options.shard_optimizer, options.moe_imbalance) == (
        2, "fp32", True, False, 1.5)


def test_frozen_blocks_of_the_candidate_freeze_the_model():
    frozen = predict(replace(CANDIDATE, frozen=("encoder",)), MODEL, uniform_workload(6, 4, 8), IDEAL)
    assert not any(str(e).startswith("B1.") for e in frozen.plan.order.events)


@pytest.mark.parametrize("candidate,words", [
    (replace(CANDIDATE, num_microbatches=5), "has 6 microbatches but the microbatch count M is 5"),
    (replace(CANDIDATE, owner_policy="greedy"), "owner policy 'greedy' chooses its owners per step"),
    (replace(CANDIDATE, frozen=("vision",)), "frozen block(s) vision: model 'test' has no such block"),
])
def test_what_predict_cannot_do_is_one_line_naming_the_quantity(candidate, words):
    with pytest.raises(MpipeError) as info:
        predict(candidate, MODEL, uniform_workload(6, 4, 8), IDEAL)
    assert words in str(info.value) and "--" not in str(info.value)
