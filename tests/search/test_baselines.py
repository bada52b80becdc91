import pytest

from mpipe_tune.algebra import ByLayer, ByMicrobatch, Cut, Layout, Owners, derive, parse_schedule
from mpipe_tune.search import BASELINES, Evaluator, Problem, baseline, even_split
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL = load_model("example-mllm")  # 8 encoder layers, 1 projector, 16 backbone layers


def plan_of(c):
    cut, schedule = c.parsed()
    return derive(cut, schedule, MODEL, c.pp, c.num_microbatches, Owners(slab_counts=c.slab_counts))


def test_even_split_puts_extra_layers_last():
    assert even_split(16, 4) == (4, 4, 4, 4)
    assert even_split(17, 4) == (4, 4, 4, 5)
    assert sum(even_split(63, 16)) == 63


def test_megatron_puts_encoder_projector_and_a_backbone_share_in_stage_0():
    plan = plan_of(baseline("megatron", MODEL, 4, 1, 1, 8))
    assert str(plan.schedule) == "1f1b" and plan.cut == Cut(())
    (region,) = plan.placement
    assert region.owner.slabs == ((0, 13), (13, 17), (17, 21), (21, 25))


def test_disttrain_gives_the_encoder_a_stage_of_its_own():
    plan = plan_of(baseline("disttrain", MODEL, 4, 1, 1, 8))
    (region,) = plan.placement
    blocks = [{MODEL.layers[i].block for i in range(*slab)} for slab in region.owner.slabs]
    assert blocks[0] == {"encoder", "projector"}
    assert all(b == {"llm"} for b in blocks[1:])
    assert region.owner.counts() == (9, 5, 5, 6)


def test_vpp_cuts_the_backbone_in_the_middle_and_needs_m_a_multiple_of_p():
    c = baseline("vpp", MODEL, 4, 1, 1, 6, vpp_microbatches=(4, 8, 12))
    assert c.num_microbatches in (4, 8)  # nearest multiple of P to 6 the space allows
    plan = plan_of(c)
    assert str(plan.schedule) == "1f1b,1f1b" and plan.cut == Cut((17,))
    first, second = plan.placement
    assert first.owner.counts() == (11, 2, 2, 2) and second.owner.counts() == (2, 2, 2, 2)
    assert baseline("vpp", MODEL, 4, 1, 1, 6, vpp_microbatches=()) is None


def test_gpipe_and_mpipe_round_robin():
    gpipe = plan_of(baseline("gpipe", MODEL, 2, 1, 1, 4))
    assert str(gpipe.schedule) == "gpipe" and gpipe.placement[0].owner.counts() == (17, 8)
    c = baseline("mpipe-rr", MODEL, 2, 1, 1, 4)
    plan = derive(*c.parsed(), MODEL, 2, 4, Owners())
    assert str(plan.schedule) == "transpose,1f1b" and plan.cut == Cut((9,))
    assert isinstance(plan.placement[0].owner, ByMicrobatch) and plan.placement[0].owner.owners == (0, 1, 0, 1)
    assert plan.placement[1].layout is Layout.SHARDED


def test_baselines_that_cannot_exist_are_none():
    assert baseline("megatron", MODEL, 32, 1, 1, 32) is None
    text_only = load_model("llama3-8b")
    assert baseline("disttrain", text_only, 4, 1, 1, 8) is None
    assert baseline("mpipe-rr", text_only, 4, 1, 1, 8) is None


@pytest.mark.parametrize("name", BASELINES)
def test_every_baseline_is_predicted_through_derive_like_any_candidate(name):
    problem = Problem(MODEL, load_profile("ideal"), 4, 8, mix="balanced", num_samples=2)
    evaluator = Evaluator(problem)
    c = baseline(name, MODEL, 4, 1, 1, 8, vpp_microbatches=(4, 8))
    e = evaluator.evaluate(c)
    prediction, _ = evaluator.prediction(c)
    assert prediction.timeline.makespan_s == pytest.approx(e.makespans_s[0], rel=1e-12)
    assert isinstance(prediction.plan.placement[-1].owner, ByLayer)
    assert str(prediction.plan.schedule) == c.schedule
    assert parse_schedule(c.schedule).is_normal()
