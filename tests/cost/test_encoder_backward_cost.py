"""Encoder backward placements in the cost model: re-timed slots equal a fresh derive, ``optimised`` is
never slower than ``cooldown`` or ``earliest`` on its step, and predict, the evaluator and the
fastest-placement prediction agree."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_compiled import _same_step

from mpipe_tune.algebra import Degrees, Candidate, PLACEMENTS
from mpipe_tune.cost import CompiledPlan
from mpipe_tune.cost._encoder_backward import optimise_slots, placement_slots
from mpipe_tune.cost import CostOptions, predict, predict_fastest_placement, load_profile
from mpipe_tune.inputs import load_workload, load_model

REAL = "qwen2vl-vit-llama3-8b"


def _candidate(model, P, M, dp=1, **fields):
    return Candidate("transpose,1f1b", (model.backbone_start,), pp=P, tp=1, dp=dp, num_microbatches=M,
                     owner_policy="round-robin", **fields)


def _prediction(placement, P=4, M=8, model_name=REAL, profile="h100-sxm", mix="balanced", **fields):
    model, hw = load_model(model_name), load_profile(profile)
    workload = load_workload(mix, num_microbatches=M, seed=1)
    c = _candidate(model, P, M, encoder_backward=placement, **fields)
    return predict(c, model, workload, hw, CostOptions(degrees=Degrees(1, dp=c.dp))), model, workload, hw


@pytest.mark.parametrize("placement", ["earliest", "optimised"])
@pytest.mark.parametrize("P,M,dp", [(4, 8, 1), (8, 16, 2)])
def test_placed_encoder_backwards_re_time_to_what_a_fresh_derive_predicts(placement, P, M, dp):
    base, model, workload, hw = _prediction("cooldown", P, M, dp=dp)
    fresh, *_ = _prediction(placement, P, M, dp=dp)
    compiled = CompiledPlan(base.plan, model, hw, base.options)
    slots = placement_slots(compiled, placement, base.table)
    assert fresh.candidate.encoder_backward_slots == (slots if placement == "optimised" else None)
    _same_step(compiled.with_encoder_backward(slots), fresh, base.table)
    # and derive with those slots explicit builds the same plan
    explicit = replace(fresh.candidate, encoder_backward="optimised", encoder_backward_slots=slots)
    assert explicit.derive(model).order == fresh.plan.order


CONFIGS = [(REAL, "h100-sxm", 4, 8, "balanced"), (REAL, "h100-sxm", 8, 16, "image-heavy"),
           (REAL, "ideal", 4, 12, "balanced"), ("qwen2vl-vit-qwen2-7b", "h100-sxm", 4, 8, "image-heavy")]


@pytest.mark.parametrize("model_name,profile,P,M,mix", CONFIGS)
def test_optimised_is_never_slower_than_cooldown_or_earliest(model_name, profile, P, M, mix):
    times = {p: _prediction(p, P, M, model_name, profile, mix)[0].timeline.makespan_s for p in PLACEMENTS}
    assert times["optimised"] <= min(times["cooldown"], times["earliest"])


def test_the_fastest_placement_is_the_fastest_of_the_three_and_moves_nothing_without_an_encoder_backward():
    base, model, workload, hw = _prediction("cooldown")
    best = predict_fastest_placement(base.candidate, model, workload, hw)
    times = [_prediction(p)[0].timeline.makespan_s for p in PLACEMENTS]
    assert best.timeline.makespan_s == min(times)
    assert best.candidate.encoder_backward == PLACEMENTS[times.index(min(times))]
    frozen = replace(base.candidate, frozen=("encoder", "projector"))
    assert predict_fastest_placement(frozen, model, workload, hw).candidate.encoder_backward == "cooldown"


def test_optimise_slots_refuses_a_plan_without_encoder_backwards():
    base, model, workload, hw = _prediction("cooldown", frozen=("encoder", "projector"))
    compiled = CompiledPlan(base.plan, model.with_frozen(("encoder", "projector")), hw, base.options)
    assert not compiled.has_encoder_backward
    with pytest.raises(AssertionError):
        optimise_slots(compiled, base.table)


def test_optimised_shortens_the_issue_s_example_by_running_rank_0_s_first_encoder_backward_in_its_drain():
    """``predict --schedule transpose,1f1b --pp 4 --microbatches 8`` (example-mllm, ideal, balanced):
    in the cooldown rank 0 ends with two encoder backwards after every other rank's backbone is done."""
    model, hw = load_model("example-mllm"), load_profile("ideal")
    workload = load_workload("balanced", num_microbatches=8, seed=0)
    c = _candidate(model, 4, 8)
    cooldown = predict(c, model, workload, hw)
    optimised = predict(replace(c, encoder_backward="optimised"), model, workload, hw)
    assert optimised.timeline.makespan_s < cooldown.timeline.makespan_s
    rank0 = [str(e) for e in optimised.plan.nodes(0)]
    assert rank0.index("B1.0#0") < rank0.index("B2.0#7")
