"""The encoder's own tensor-parallel degree as a search choice, and in the baselines' families."""

from pathlib import Path

from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions
from mpipe_tune.algebra import Candidate
from mpipe_tune.search._families import family_candidates
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MLLM = load_model(str(Path(__file__).parents[1] / "runtime" / "tiny-mllm-mla-moe.yaml"))
IDEAL = load_profile("ideal")


def space(**options):
    problem = Problem(MLLM, IDEAL, 8, 16, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    return SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(max_microbatches=8, **options)), evaluator


def parameter_names(s):
    return {name for params, _ in s.enumerate() for name in params}


def test_encoder_tp_is_asked_only_where_tp_is_above_1():
    plain, _ = space(tp=(1,))
    searched, _ = space(tp=(1,), encoder_tp=True)
    assert parameter_names(searched) == parameter_names(plain)  # tp = 1: nothing new to ask
    assert {c.encoder_tp for _, c in searched.enumerate()} == {None}
    s, _ = space(tp=(2,), encoder_tp=True)
    assert "encoder_tp[2|1]" in parameter_names(s)
    assert {c.encoder_tp for _, c in s.enumerate()} == {None, 1}  # None: the plan's tp


def test_the_default_space_does_not_search_it():
    s, _ = space(tp=(2,))
    assert not any(name.startswith("encoder_tp") for name in parameter_names(s))
    assert {c.encoder_tp for _, c in s.enumerate()} == {None}


def test_the_families_range_over_it_and_the_chosen_one_is_predicted():
    s, evaluator = space(tp=(2,), encoder_tp=True)
    candidates = family_candidates("disttrain", s)
    assert {c.encoder_tp for c in candidates} == {None, 1}
    at_tp = next(c for c in candidates if c.encoder_tp is None)
    own = Candidate(**{**at_tp.__dict__, "encoder_tp": 1})
    assert evaluator.evaluate(own).mean_s != evaluator.evaluate(at_tp).mean_s


def test_candidates_round_trip_and_old_files_read_as_the_plans_tp():
    c = Candidate("transpose,1f1b", (9,), pp=2, tp=4, dp=1, num_microbatches=8, owner_policy="greedy", encoder_tp=2)
    assert Candidate.from_dict(c.to_dict()) == c and "etp2" in str(c)
    old = c.to_dict()
    del old["encoder_tp"]
    assert Candidate.from_dict(old).encoder_tp is None
    assert Candidate(**{**c.__dict__, "encoder_tp": 4}).encoder_tp is None  # equal to tp: stored as None
