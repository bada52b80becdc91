"""ZeRO stages 2 and 3 in the search: the dominance the bound search uses (a stage-2 or stage-3 plan's step,
at either reshard policy, is never below its stage-1 twin's), the bounds that stay bounds with it, and an exact search that predicts a stage-3 plan only
where its twin does not fit."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search

H100 = load_profile("h100-sxm")
MOE = load_model(str(Path(__file__).parents[1] / "runtime" / "tiny-mllm-mla-moe.yaml"))
EVERY_KNOB = dict(recompute=(False, "selective", True), zero=(1,), sequence_parallel=(False, True), cp=(1, 2),
                  encoder_tp=True, encoder_backward=("cooldown", "earliest", "optimised"), interior_transpose=True,
                  skeletons=("1f1b", "gpipe", "zb1p"), max_microbatches=16)


def _space(model, ep=None):
    problem = Problem(model, H100, 8, 16, mix="image-heavy", num_samples=2, seed=1)
    evaluator = Evaluator(problem)
    options = SpaceOptions(**EVERY_KNOB, ep=ep)
    points = [c for _, c in SearchSpace(problem, evaluator.reference_weights(), options).enumerate()]
    return evaluator, points


SPACES = {"dense": _space(load_model("tiny-vit-llm"), ep=(1,)), "moe": _space(MOE)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(sorted(SPACES)), pick=st.integers(min_value=0, max_value=10**9),
       overlap=st.booleans(), zero=st.sampled_from([(2, None), (3, True), (3, False)]))
def test_a_stage3_plan_is_never_faster_than_its_stage1_twin_and_its_bounds_hold(which, pick, overlap, zero):
    evaluator, points = SPACES[which]
    if not overlap:  # the waits add whole: the same dominance
        evaluator = _no_overlap(evaluator)
    one = points[pick % len(points)]
    three = replace(one, zero_stage=zero[0], reshard_after_forward=zero[1])
    e1, e3 = evaluator.evaluate(one), evaluator.evaluate(three)
    assert all(t3 >= t1 * (1 - 1e-12) for t1, t3 in zip(e1.makespans_s, e3.makespans_s)), (one, e1, e3)
    assert evaluator.twin_s(three) == e1.mean_s <= e3.mean_s * (1 + 1e-12)
    for bounds in (evaluator.lower_bounds(three), evaluator.owner_bounds(three)):
        assert all(b <= m * (1 + 1e-12) for b, m in zip(bounds, e3.makespans_s)), three
    for twin_bounds in (False, True):
        evaluator.twin_bounds = twin_bounds
        first, last = evaluator.bound_levels(three)
        levels = [evaluator.bound_at(three, level) for level in range(first, last + 1)]
        assert all(a <= b * (1 + 1e-12) for a, b in zip(levels, levels[1:])), three  # each level tighter ...
        assert levels[-1] <= e3.mean_s * (1 + 1e-12), three  # ... and all valid
    evaluator.twin_bounds = False
    floor = evaluator.peak_floor_bytes(three)
    assert evaluator.static_floor_bytes(three) <= evaluator.static_peak_bytes(three) * (1 + 1e-12)
    order_floor = evaluator.order_floor_bytes(three)
    assert evaluator.static_peak_bytes(three) <= floor <= order_floor <= e3.peak_bytes * (1 + 1e-12)


_NO_OVERLAP: dict = {}


def _no_overlap(evaluator: Evaluator) -> Evaluator:
    key = id(evaluator)
    if key not in _NO_OVERLAP:
        problem = evaluator.problem
        _NO_OVERLAP[key] = Evaluator(replace(problem, options=replace(problem.options, overlap_dp_comm=False)))
    return _NO_OVERLAP[key]


def test_stage3_fits_where_stage1_does_not_and_the_exact_search_finds_the_optimum_of_every_stage(tmp_path):
    """A capacity between the stage-3 and the stage-1 peaks of the space's plans: the search over the stages
    (0, 1, 3), pruning by the twins, returns the exhaustive optimum, and predicts a stage-3 plan only where
    its twin did not fit (or was not predicted)."""
    short = Workload(tuple(Microbatch(image_tokens=4, text_tokens=8, images=(4,)) for _ in range(16)), "short")
    problem = Problem(load_model("tiny-vit-llm"), H100, 8, 16, workload=short)  # weights outweigh activations
    probe = Evaluator(problem)
    options = SpaceOptions(zero=(0, 1, 3), reshard=(True,), recompute=(False, True), max_microbatches=8)
    points = [c for _, c in SearchSpace(problem, probe.reference_weights(), options).enumerate()]
    peaks = {c: probe.evaluate(c).peak_bytes for c in points}
    ones = [peaks[c] for c in points if c.zero_stage == 1]
    capacity = float(np.quantile(ones, 0.5))
    tight = replace(problem, profile=replace(problem.profile, memory_capacity_bytes=capacity))
    full = Evaluator(tight)
    space = SearchSpace(tight, full.reference_weights(), options)
    evaluations = [full.evaluate(c) for _, c in space.enumerate()]
    optimum = min((e for e in evaluations if e.fits), key=lambda e: e.mean_s)
    assert any(e.fits and e.candidate.zero_stage == 3 and not full.evaluate(replace(e.candidate, zero_stage=1)).fits
               for e in evaluations)  # stage 3 makes some plans fit
    evaluator = Evaluator(tight)
    result = run_search(space, evaluator, storage=f"sqlite:///{tmp_path / 's.db'}", sampler="bound",
                        progress=False, tolerance=0.0, n_trials=len(evaluations))
    assert result.best.mean_s == optimum.mean_s
    predicted = [c for c in evaluator._results if c.zero_stage == 3]
    assert predicted  # some stage-3 plans needed a prediction ...
    for c in predicted:  # ... each where its twin does not fit, or its twin never was predicted in full
        twin = evaluator._results.get(replace(c, zero_stage=1))
        assert twin is None or twin.peak_bytes is None or not twin.fits, c
    assert len(predicted) < sum(c.zero_stage == 3 for c in points) / 2


def test_the_reshard_policy_is_searched_at_stage3_and_keeping_the_weights_is_never_slower():
    """``--zero 3`` (:data:`~mpipe_tune.search._planner.RESHARD`) searches both policies at every pipeline degree
    (pp 1 included, where the default would reshard): each stage-3 layout comes with a keep and a reshard point,
    and keeping the gathered weights through the step predicts a step no longer than gathering them again."""
    from mpipe_tune.search import SpaceRequest, space_options

    model = load_model("tiny-vit-llm")
    options = space_options(SpaceRequest(zero="3"), model)
    assert options.zero == (3,) and options.reshard == (False, True)
    assert space_options(SpaceRequest(zero="3-keep"), model).reshard == (False,)
    assert space_options(SpaceRequest(zero="1"), model).reshard == (None,)
    problem = Problem(model, H100, 8, 16, mix="image-heavy", num_samples=2, seed=1)
    evaluator = Evaluator(problem)
    space = SearchSpace(problem, evaluator.reference_weights(), replace(options, max_microbatches=8))
    points = [(params, c) for params, c in space.enumerate()]
    assert {c.reshard_after_forward for _, c in points} == {False, True}
    assert {c.pp for _, c in points if c.reshard_after_forward is False} >= {1, 2}
    keeps = [c for _, c in points if c.reshard_after_forward is False]
    for keep in keeps[:: max(1, len(keeps) // 40)]:
        on = evaluator.evaluate(replace(keep, reshard_after_forward=True))
        off = evaluator.evaluate(keep)
        assert all(k <= r * (1 + 1e-12) for k, r in zip(off.makespans_s, on.makespans_s)), keep
    groups = list(space.groups())
    assert sum(g.size for g in groups) == len(points)  # the policy is part of a group's memory setting
    assert {g.setting[3] for g in groups} == {False, True}
