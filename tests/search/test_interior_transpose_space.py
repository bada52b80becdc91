"""Interior transposes in the search space (``SpaceOptions.interior_transpose``): the projector between a
Sharded encoder and a Sharded backbone transposed (``S,transpose,S``, with a sink ``S,transpose,S,transpose``);
off by default, and only where the model has a projector and each side has ``pp`` layers."""

import math

import pytest

from mpipe_tune.algebra import Owners, derive, normalize, validate_schedule, Layout
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

from tests.search.test_head_transpose_space import generator_model


def space_of(model, devices=4, batch=8, **options):
    problem = Problem(model, load_profile("ideal"), devices, batch, mix="balanced", num_samples=1)
    return SearchSpace(problem, Evaluator(problem).reference_weights(), SpaceOptions(**options))


@pytest.fixture(scope="module")
def example():
    return space_of(load_model("example-mllm"), interior_transpose=True)


def test_interior_transposes_are_off_by_default_and_on_with_the_option(example):
    default = space_of(load_model("example-mllm"))
    assert not any(SearchSpace.interior(s) for s in default.family)
    assert {"1f1b,transpose,1f1b", "gpipe,transpose,gpipe"} <= set(example.family)
    assert set(default.family) <= set(example.family)  # the other schedules stay as they were
    zbv = space_of(load_model("example-mllm"), interior_transpose=True, skeletons=("zbv",))
    assert "zbv,transpose,zbv" in zbv.family


def test_a_model_without_a_projector_gets_no_interior_transpose():
    model = load_model("small-vit-llm")  # encoder then llm, no projector between them
    assert model.encoder_end == model.backbone_start
    assert not any(SearchSpace.interior(s) for s in space_of(model, interior_transpose=True).family)


def test_an_encoder_shorter_than_pp_layers_leaves_interior_transposes_out_at_that_pp():
    space = space_of(load_model("example-mllm"), devices=16, batch=32, interior_transpose=True)
    assert space.encoder_end == 8
    assert space.interior_cut(8) == (8, 9) and space.interior_cut(16) is None
    for pp, _, dp in space.degrees:
        interior = [s for s in space.schedules(pp, dp) if SearchSpace.interior(s)]
        assert bool(interior) == (1 < pp <= 8), (pp, interior)  # pp 1 searches 1f1b alone


def test_every_interior_point_is_valid_transposes_the_projector_and_evaluates(example):
    evaluator = Evaluator(example.problem)
    model, seen = example.problem.model, set()
    for _, c in example.enumerate():
        if not SearchSpace.interior(c.schedule):
            continue
        cut, schedule = c.parsed()
        validate_schedule(cut, schedule, example.num_layers)
        assert normalize(cut, schedule) == (cut, schedule)
        assert c.cut == (model.encoder_end, model.backbone_start)
        assert c.owner_policy is not None
        assert c.num_microbatches % c.pp == 0  # two woven regions run in rounds of pp
        plan = derive(cut, schedule, model, c.pp, c.num_microbatches, Owners())
        middle = plan.placement[1]
        assert middle.layout is Layout.REPLICATED and middle.layers == (8, 9)  # [start, stop): the projector
        assert [p.layout for p in (plan.placement[0], plan.placement[2])] == [Layout.SHARDED] * 2
        result = evaluator.evaluate(c)
        assert math.isfinite(result.mean_s) and result.mean_s > 0
        seen.add((c.schedule, c.owner_policy))
    assert {s for s, _ in seen} == {"1f1b,transpose,1f1b", "gpipe,transpose,gpipe"}
    assert {p for _, p in seen} >= {"round-robin", "greedy"}


def test_with_a_head_the_interior_transpose_comes_with_a_sink_too():
    layers = list(generator_model().layers)
    projector = layers[1].__class__("merger", "projector", True, layers[1].cost)
    model = generator_model().__class__("generator-projector", tuple(layers[:2] + [projector] + layers[2:]))
    space = space_of(model, devices=2, batch=4, interior_transpose=True)
    assert {"1f1b,transpose,1f1b", "1f1b,transpose,1f1b,transpose"} <= set(space.family)
    sinks = [c for _, c in space.enumerate() if c.schedule == "1f1b,transpose,1f1b,transpose"]
    assert sinks and all(c.cut == (2, 3, model.head_start) for c in sinks)
    plan = derive(*sinks[0].parsed(), model, 2, sinks[0].num_microbatches, Owners())
    assert [p.layout for p in plan.placement] == [Layout.SHARDED, Layout.REPLICATED, Layout.SHARDED, Layout.REPLICATED]


def test_an_exhaustive_search_predicts_the_interior_points_and_keeps_the_best_of_all(example, tmp_path):
    evaluator, seen = Evaluator(example.problem), []
    result = run_search(example, evaluator, storage=f"sqlite:///{tmp_path / 's.db'}", exhaustive=True,
                        progress=False, prune=False, on_trial=seen.append)
    interior = [e for e in seen if SearchSpace.interior(e.candidate.schedule)]
    assert {e.candidate.schedule for e in interior} == {"1f1b,transpose,1f1b", "gpipe,transpose,gpipe"}
    assert result.space_size == example.size() and result.num_evaluated == len({e.candidate for e in seen})
    assert result.best.mean_s == min(e.mean_s for e in seen if e.fits)
