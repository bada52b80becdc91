"""Sink transposes in the search space: a model with a head after its backbone (a generator head) gets
``S{v},transpose`` and ``transpose,S{v},transpose``; a model without one keeps the family it had."""

import math

import pytest

from mpipe_tune.algebra import Owners, derive, normalize, validate_schedule, ExplicitCost, Layer, Model
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model


def generator_model() -> Model:
    """Two encoder layers, eight backbone layers and a generator head as costly as three of them."""
    layers = [Layer(f"vit{i}", "encoder", True, ExplicitCost(1e-6, 2e-6, 1024)) for i in range(2)]
    layers += [Layer(f"dec{i}", "llm", True, ExplicitCost(1.5e-6, 3e-6, 4096)) for i in range(8)]
    layers.append(Layer("generator", "generator", True, ExplicitCost(4.5e-6, 9e-6, 4096)))
    return Model("generator-test", tuple(layers))


@pytest.fixture(scope="module")
def space():
    problem = Problem(generator_model(), load_profile("ideal"), 4, 8, mix="balanced", num_samples=1)
    return SearchSpace(problem, Evaluator(problem).reference_weights())


def test_a_head_adds_sink_transposes_in_normal_form(space):
    assert space.head_start == 10
    assert {"1f1b,transpose", "transpose,1f1b,transpose", "1f1b,1f1b,transpose", "gpipe,transpose"} <= set(space.family)
    assert "transpose,1f1b" in space.family and "1f1b" in space.family
    off = SearchSpace(space.problem, space.weights, SpaceOptions(head_transpose=False))
    assert not any(s.endswith(",transpose") for s in off.family)


def test_the_example_model_has_no_head_and_keeps_its_family():
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 4, 8, mix="balanced", num_samples=1)
    example = SearchSpace(problem, Evaluator(problem).reference_weights())
    assert example.head_start == problem.model.num_layers
    assert not any(s.endswith(",transpose") for s in example.family)


def test_every_sink_point_is_valid_holds_the_head_and_evaluates(space):
    evaluator = Evaluator(space.problem)
    seen = set()
    for _, c in space.enumerate():
        cut, schedule = c.parsed()
        if not c.schedule.endswith(",transpose"):
            continue
        validate_schedule(cut, schedule, space.num_layers)
        assert normalize(cut, schedule) == (cut, schedule)
        assert cut.boundaries[-1] == space.head_start
        assert c.owner_policy is not None
        plan = derive(cut, schedule, space.problem.model, c.pp, c.num_microbatches, Owners())
        assert plan.placement[-1].layers == (10, 11)
        result = evaluator.evaluate(c)
        assert math.isfinite(result.mean_s) and result.mean_s > 0
        seen.add((c.schedule, c.owner_policy))
    assert {s for s, _ in seen} >= {"1f1b,transpose", "transpose,1f1b,transpose"}
    assert {p for _, p in seen} >= {"round-robin", "greedy"}
