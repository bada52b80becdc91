import optuna
import pytest

from mpipe_tune.algebra import Owners, derive, normalize, parse_schedule, validate_schedule, is_interleavable
from mpipe_tune.errors import MpipeError
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model


@pytest.fixture(scope="module")
def example():
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 4, 8, mix="balanced", num_samples=1)
    return SearchSpace(problem, Evaluator(problem).reference_weights())


def assert_valid(space, c):
    model = space.problem.model
    cut, schedule = c.parsed()
    validate_schedule(cut, schedule, model.num_layers)
    assert normalize(cut, schedule) == (cut, schedule), "not in normal form"
    assert c.pp * c.tp * c.dp == space.problem.devices
    assert space.problem.global_batch % (c.dp * c.num_microbatches) == 0
    assert (c.owner_policy is not None) == c.has_transpose
    plan = derive(cut, schedule, model, c.pp, c.num_microbatches, Owners())
    assert len(plan.order.nodes) == c.pp


def test_the_schedule_family_is_in_normal_form_and_valid(example):
    assert "transpose,1f1b" in example.family and "1f1b,1f1b" in example.family
    for text in example.family:
        schedule = parse_schedule(text)
        assert schedule.is_normal()
    assert not any("transpose,transpose" in s for s in example.family)


def test_every_enumerated_point_is_valid_derivable_and_distinct(example):
    points = list(example.enumerate())
    candidates = [c for _, c in points]
    assert len(set(candidates)) == len(candidates) == example.size()
    for c in candidates:
        assert_valid(example, c)
    # The tree covers every degree, schedule and owner policy the space allows.
    assert {(c.pp, c.tp, c.dp) for c in candidates} == set(example.degrees)
    assert {c.schedule for c in candidates} == set(example.family)
    assert {c.owner_policy for c in candidates} == {None, "round-robin", "greedy", "optimal"}


@pytest.mark.parametrize("sampler", [optuna.samplers.RandomSampler(seed=1), optuna.samplers.TPESampler(seed=1)])
def test_optuna_never_samples_an_invalid_point(example, sampler):
    study = optuna.create_study(sampler=sampler)
    seen = set()
    for _ in range(80):
        trial = study.ask()
        c = example.build(lambda name, options: trial.suggest_categorical(name, list(options)))
        assert_valid(example, c)
        seen.add(c)
        study.tell(trial, float(len(seen)))
    assert len(seen) > 10


def test_interleaving_gets_counts_in_equal_rounds_and_regions_of_p_layers(example):
    for _, c in example.enumerate():
        if c.schedule.split(",").count("1f1b") > 1:
            assert is_interleavable(c.pp, c.num_microbatches) and c.num_microbatches >= c.pp
        edges = (0, *c.cut, example.num_layers)
        sharded = [hi - lo for (lo, hi), s in zip(zip(edges, edges[1:]), c.schedule.split(",")) if s != "transpose"]
        assert min(sharded) >= c.pp


def test_interleaving_offers_every_count_torch_accepts():
    """torch's interleaved 1F1B runs M in max(1, M // P) equal rounds: M = 6 on 4 ranks (one round of
    6) is offered, M = 9 (two rounds) is not."""
    space = SearchSpace(Problem(load_model("example-mllm"), load_profile("ideal"), 4, 12, mix="balanced",
                                num_samples=1), [1.0] * 25, SpaceOptions(pp=(4,)))
    assert space.microbatch_choices(4, 1, "1f1b,1f1b") == [4, 6, 12]
    assert space.microbatch_choices(4, 1, "transpose,1f1b,1f1b") == [4, 6, 12]
    assert {c.num_microbatches for _, c in space.enumerate() if c.schedule == "1f1b,1f1b" and c.dp == 1} == {4, 6, 12}
    for _, c in space.enumerate():
        assert_valid(space, c)
    odd = SearchSpace(Problem(load_model("example-mllm"), load_profile("ideal"), 4, 9, mix="balanced",
                              num_samples=1), [1.0] * 25, SpaceOptions(pp=(4,)))
    assert odd.microbatch_choices(4, 1, "1f1b") == [9]
    assert odd.microbatch_choices(4, 1, "1f1b,1f1b") == [3]  # 9 is two unequal rounds; none >= 4 is left
    assert odd.microbatch_choices(4, 1, "gpipe,gpipe") == [9]


def test_transpose_cuts_stay_near_the_encoder_backbone_seam(example):
    cuts = {c.cut[0] for _, c in example.enumerate() if c.has_transpose}
    assert cuts == {7, 8, 9, 10}  # encoder ends at 8, the backbone starts at 9 (after the projector)


def test_pins_restrict_the_degrees():
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 8, 16, mix="balanced", num_samples=1)
    space = SearchSpace(problem, [1.0] * 25, SpaceOptions(pp=(4,), owner_policies=("greedy",)))
    assert space.degrees == [(4, 1, 2), (4, 2, 1)]
    assert {c.owner_policy for _, c in space.enumerate()} <= {None, "greedy"}


@pytest.mark.parametrize("devices,batch,words", [
    (29, 4, "no (pp, tp, dp) with pp*tp*dp = 29 devices"),  # prime: pp 29 over 25 layers, or dp 29 over a batch of 4
    (29, 4, "pp must be at most the layer count (model 'example-mllm' has 25 layers)"),
])
def test_impossible_device_counts_are_a_user_error(devices, batch, words):
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), devices, batch, mix="balanced", num_samples=1)
    with pytest.raises(MpipeError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        SearchSpace(problem, [1.0] * 25)


def test_recomputation_can_be_a_choice(example):
    both = SearchSpace(example.problem, example.weights, SpaceOptions(recompute=(False, True)))
    candidates = [c for _, c in both.enumerate()]
    assert len(candidates) == 2 * example.size()
    assert {c.recompute for c in candidates} == {False, True}
    assert all(not c.recompute for _, c in example.enumerate())


def test_neighbours_differ_in_one_choice_and_are_valid(example):
    params, c = next(p for p in example.enumerate() if p[1].has_transpose and p[1].pp == 4)
    neighbours = example.neighbors(params)
    assert neighbours and all(n != c for _, n in neighbours)
    assert any(n.owner_policy != c.owner_policy and n.num_microbatches == c.num_microbatches for _, n in neighbours)
    assert any((n.pp, n.tp, n.dp) != (c.pp, c.tp, c.dp) for _, n in neighbours)
    for _, n in neighbours:
        assert_valid(example, n)


def test_zero_bubble_skeletons_join_the_space_where_valid():
    """zb1p weaves any number of chunks (interleaved in rounds like 1f1b), zbv exactly two; every point
    derives."""
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 4, 8, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    options = SpaceOptions(skeletons=("1f1b", "zb1p", "zbv"), max_chunks=3)
    space = SearchSpace(problem, evaluator.reference_weights(), options)
    assert {"zb1p", "zb1p,zb1p", "zb1p,zb1p,zb1p", "zbv,zbv", "transpose,zbv,zbv"} <= set(space.family)
    assert all(s.split(",").count("zbv") in (0, 2) for s in space.family)
    for _, c in space.enumerate():
        assert_valid(space, c)
        if c.schedule.count("zb1p") > 1:
            assert is_interleavable(c.pp, c.num_microbatches)
