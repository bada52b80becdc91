"""The planner: the best is never slower than a row it shows; defaults that find a plan; widening."""

import pytest

from mpipe_tune.cli._errors import error_line
from mpipe_tune.cost import parse_profile
from mpipe_tune.search import Evaluator, Problem, SearchSpace
from mpipe_tune.search._planner import SearchOptions, SpaceRequest, has_experts, plan, space_options
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL = load_model("example-mllm")
PROFILE = load_profile("ideal")


def problem(profile=PROFILE, devices=4, batch=8, model=MODEL):
    return Problem(model, profile, devices, batch, mix="balanced", num_samples=2, seed=1)


EVERY_KNOB = SpaceRequest(recompute="all", zero="search", sequence_parallel="search", encoder_tp="search",
                          max_microbatches=8)


@pytest.mark.parametrize("trials", [1, 5])
def test_no_row_is_faster_than_best_even_when_the_search_is_starved(trials):
    """With one trial the search alone misses the optimum: the rows it evaluated beside it are candidates too."""
    outcome = plan(problem(), EVERY_KNOB,
                   SearchOptions(trials=trials, progress=False, current="pp=4,tp=1,dp=1,schedule=1f1b,M=8"))
    summary = outcome.summary()
    rows = [*summary["comparison"][1:], *summary["own_best"], summary["current"]]
    best = summary["comparison"][0]
    assert best["fits_memory"] and outcome.best.fits
    for r in rows:
        if r["fits_memory"]:
            assert r["best_speedup"] >= 1.0, r["plan"]
            assert r["step_s"] >= best["step_s"], r["plan"]


def test_the_winner_is_the_fastest_fitting_plan_of_the_search_and_every_family():
    outcome = plan(problem(), SpaceRequest(max_microbatches=8), SearchOptions(trials=3, progress=False))
    candidates = [e for e in [outcome.result.best, *(f.best for f in outcome.families)] if e is not None and e.fits]
    assert outcome.best.mean_s == min(e.mean_s for e in candidates)
    assert outcome.best_from in ("search", *(f.label for f in outcome.families))


def test_a_moe_model_searches_expert_parallelism_unless_ep_is_given():
    moe, dense = load_model("qwen2vl-vit-deepseek-v3"), MODEL
    assert has_experts(moe) and not has_experts(dense)
    assert space_options(SpaceRequest(), moe).ep is None  # every degree the layout allows
    assert space_options(SpaceRequest(), dense).ep == (1,)
    assert space_options(SpaceRequest(ep="1"), moe).ep == (1,)


def test_widening_touches_only_the_knobs_not_given():
    wider, knobs = SpaceRequest(recompute="off", zero="1", ep="1").widened()
    assert knobs == ("sequence_parallel",)
    assert (wider.recompute, wider.zero, wider.sequence_parallel, wider.ep) == ("off", "1", "search", "1")
    _, knobs = SpaceRequest().widened()
    assert knobs == ("recompute", "zero", "sequence_parallel")
    wider, _ = SpaceRequest().widened()
    assert space_options(wider, load_model("tiny-vit-llm")).zero == (0, 1, 2, 3)  # the widening reaches ZeRO-2 and -3
    assert space_options(SpaceRequest(zero="search"), load_model("tiny-vit-llm")).zero == (0, 1)


def _capacity_between(p):
    """A capacity under every default plan's peak but over some plan's of the widened space: only widening fits."""
    evaluator = Evaluator(p)
    weights = evaluator.reference_weights()
    peaks = {}
    for name, request in (("default", SpaceRequest(max_microbatches=8)),
                          ("widened", SpaceRequest(max_microbatches=8).widened()[0])):
        space = SearchSpace(p, weights, space_options(request, p.model))
        peaks[name] = min(evaluator.evaluate(c).peak_bytes for _, c in space.enumerate())
    assert peaks["widened"] < peaks["default"], peaks
    return (peaks["widened"] + peaks["default"]) / 2


def test_when_nothing_fits_the_open_memory_knobs_are_widened_and_a_given_one_is_not():
    tiny = load_model("tiny-vit-llm")
    capacity = _capacity_between(problem(load_profile("h100-sxm"), 2, 4, tiny))
    data = load_profile("h100-sxm").to_dict()
    data["memory_capacity_bytes"]["value"] = capacity
    small = parse_profile(data, where="test")
    outcome = plan(problem(small, 2, 4, tiny), SpaceRequest(max_microbatches=8), SearchOptions(trials=20, progress=False))
    assert outcome.best is not None and outcome.best.fits
    assert outcome.widened == ("recompute", "zero", "sequence_parallel")
    assert outcome.widened_line.endswith("recomputation all, ZeRO stage all, sequence parallelism search")
    refused = plan(problem(small, 2, 4, tiny), SpaceRequest(max_microbatches=8, recompute="off", zero="1",
                                                sequence_parallel="off"),
                   SearchOptions(trials=20, progress=False))
    assert refused.best is None and refused.widened == ()
    assert "search the knobs you fixed (recomputation, ZeRO stage, sequence parallelism)" in refused.no_fit_message()
    line = error_line(refused.no_fit_error(), "plan")  # the command line adds each knob's flag
    assert "(recomputation (--recompute), ZeRO stage (--zero), sequence parallelism (--sequence-parallel))" in line
    assert refused.least_memory is not None and refused.least_memory.peak_bytes > capacity
