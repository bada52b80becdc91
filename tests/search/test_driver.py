from dataclasses import replace

import optuna
import pytest

from mpipe_tune.errors import MpipeError
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model
from mpipe_tune.search import _driver as driver
from mpipe_tune.search._sampling import TPE

MODEL = load_model("example-mllm")
PROFILE = load_profile("ideal")


def make(devices=2, batch=4, samples=1, profile=PROFILE, model=MODEL, **space):
    """A space of pipelines only unless ``min_pp`` is given: at pp 1 (no bubble on the ideal profile) the bounds
    settle these small spaces in a trial or two, and the sampler and its refinement are what these tests run."""
    space.setdefault("min_pp", 2)
    problem = Problem(model, profile, devices, batch, mix="balanced", num_samples=samples, seed=3)
    evaluator = Evaluator(problem)
    return SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(**space)), evaluator


def exhaustive_optimum(space, evaluator):
    evaluations = [evaluator.evaluate(c) for _, c in space.enumerate()]
    return min((e for e in evaluations if e.fits), key=lambda e: e.mean_s), evaluations


def url(tmp_path, name="s.db"):
    return f"sqlite:///{tmp_path / name}"


@pytest.mark.parametrize("prune", [False, True])
def test_exhaustive_search_finds_the_known_optimum(tmp_path, prune):
    space, evaluator = make(owner_policies=("round-robin", "greedy"))
    optimum, evaluations = exhaustive_optimum(space, Evaluator(evaluator.problem))
    result = run_search(space, evaluator, storage=url(tmp_path), n_trials=10_000, progress=False, prune=prune)
    assert result.mode == "exhaustive" and result.space_size == len(evaluations)
    assert result.best.candidate == optimum.candidate
    assert result.best.mean_s == optimum.mean_s
    study = optuna.load_study(study_name=result.study_name, storage=url(tmp_path))
    assert study.best_value == optimum.mean_s
    assert result.num_trials == result.num_new == result.num_evaluated
    if prune:  # points whose lower bound loses to the optimum are settled without a prediction
        assert result.num_bounded > 0 and result.num_evaluated + result.num_bounded == len(evaluations)
    else:
        assert result.num_bounded == 0 and result.num_trials == len(evaluations)
    # A rerun evaluates nothing new.
    again = run_search(space, evaluator, storage=url(tmp_path), n_trials=10_000, progress=False, prune=prune)
    assert again.num_new == 0 and again.num_trials == result.num_trials and again.best == result.best


def test_optuna_gets_within_one_percent_of_the_exhaustive_optimum_on_a_small_space(tmp_path):
    space, evaluator = make(devices=4, batch=8, samples=2, skeletons=("1f1b",), owner_policies=("round-robin", "greedy"))
    optimum, evaluations = exhaustive_optimum(space, evaluator)
    trials = len(evaluations) // 5  # 20% of 126 points: all of seeds 0-19 reach the optimum (10% on
    # spaces of 500-1,800 points is in benchmarks/README.md)
    result = run_search(space, evaluator, storage=url(tmp_path), n_trials=trials, exhaustive=False, seed=0,
                        progress=False)
    assert result.mode == "optuna" and result.num_trials == trials
    assert result.best.mean_s <= 1.01 * optimum.mean_s


def test_a_rerun_keeps_finished_trials_and_continues_the_study(tmp_path):
    space, evaluator = make(devices=4, batch=8)
    first = run_search(space, evaluator, storage=url(tmp_path), n_trials=6, exhaustive=False, progress=False)
    study = optuna.load_study(study_name=first.study_name, storage=url(tmp_path))
    before = [(t.number, t.params, t.value) for t in study.trials]
    second = run_search(space, evaluator, storage=url(tmp_path), n_trials=10, exhaustive=False, progress=False)
    assert (first.num_trials, second.num_trials, second.num_new) == (6, 10, 4)
    after = optuna.load_study(study_name=first.study_name, storage=url(tmp_path)).trials
    assert [(t.number, t.params, t.value) for t in after[:6]] == before
    assert second.best.mean_s <= first.best.mean_s


def test_plans_over_memory_are_infeasible_not_penalised(tmp_path):
    model = load_model("tiny-vit-llm")
    space, evaluator = make(model=model, devices=4, batch=8, recompute=(False, True))
    unconstrained, _ = exhaustive_optimum(space, evaluator)
    capacity = unconstrained.peak_bytes * 0.99  # the fastest plan no longer fits
    space, evaluator = make(model=model, devices=4, batch=8, recompute=(False, True),
                            profile=replace(PROFILE, memory_capacity_bytes=capacity))
    optimum, evaluations = exhaustive_optimum(space, evaluator)
    assert any(not e.fits and e.mean_s < optimum.mean_s for e in evaluations), "the capacity should bind"
    result = run_search(space, evaluator, storage=url(tmp_path), n_trials=10_000, progress=False)
    assert result.best.candidate == optimum.candidate and result.best.fits
    sampled = run_search(space, evaluator, storage=url(tmp_path, "t.db"), n_trials=60, exhaustive=False, progress=False)
    assert sampled.best.fits
    if not hasattr(optuna.trial.Trial, "set_constraint"):  # Optuna < 5 keeps constraints elsewhere
        return
    study = optuna.load_study(study_name=sampled.study_name, storage=url(tmp_path, "t.db"))
    for t in study.trials:
        info = t.user_attrs["mpipe"]
        if info["peak_bytes"] is not None:
            assert (t.constraints["memory"] > 0) == (info["peak_bytes"] > capacity)
        else:  # settled by its lower bound, or slower than a plan that fits: memory not estimated
            assert t.constraints["memory"] <= 0 and t.value >= sampled.best.mean_s
    assert study.best_trial.constraints["memory"] <= 0


def test_nothing_fits_gives_no_best_but_the_least_memory_plan(tmp_path):
    space, evaluator = make(model=load_model("tiny-vit-llm"), profile=replace(PROFILE, memory_capacity_bytes=1.0))
    result = run_search(space, evaluator, storage=url(tmp_path), n_trials=10_000, progress=False)
    assert result.best is None
    # Every plan is settled by its static memory alone: the least of those is reported.
    assert not result.least_memory.exact and result.num_evaluated == 0
    assert result.least_memory.peak_bytes == min(evaluator.static_peak_bytes(c) for _, c in space.enumerate())
    assert result.least_memory.peak_bytes <= min(evaluator.evaluate(c).peak_bytes for _, c in space.enumerate())


def test_a_study_is_for_one_problem_only(tmp_path):
    space, evaluator = make()
    run_search(space, evaluator, storage=url(tmp_path), study_name="mine", n_trials=3, exhaustive=False, progress=False)
    other_space, other = make(batch=8)
    with pytest.raises(MpipeError, match="study 'mine' .* another planning problem"):
        run_search(other_space, other, storage=url(tmp_path), study_name="mine", n_trials=3, progress=False)


def test_bad_storage_and_trials_are_user_errors(tmp_path):
    space, evaluator = make()
    with pytest.raises(MpipeError, match="study storage"):
        run_search(space, evaluator, storage="nosuchdb://x", n_trials=3, progress=False)
    with pytest.raises(MpipeError, match="trial budget"):
        run_search(space, evaluator, storage=url(tmp_path), n_trials=0, progress=False)


class _FirstChoiceSampler(optuna.samplers.BaseSampler):
    """Proposes the first option of every choice, forever: a sampler that has converged on one point."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return param_distribution.choices[0]


class _Stuck(TPE):
    """The sampling strategy with that sampler: a new strategy is a subclass and one registration."""

    def make_sampler(self, seed):
        return _FirstChoiceSampler()


def _stuck_sampler(monkeypatch):
    monkeypatch.setitem(driver.STRATEGIES, "tpe", _Stuck())


def test_a_sampler_stuck_on_settled_points_ends_as_converged_without_wasting_trials(tmp_path, monkeypatch):
    _stuck_sampler(monkeypatch)
    space, evaluator = make(devices=4, batch=8)  # 364 points, more than the budget
    first = next(space.enumerate())[0]
    result = run_search(space, evaluator, storage=url(tmp_path), n_trials=100, exhaustive=False, refine=False,
                        progress=False)
    # The first point, then its neighbours that the bounds leave open instead of repeats; then settled
    # proposals only, none of them a trial.
    assert result.ending == "converged" and result.num_settled == 20
    assert result.num_trials == result.num_new and 2 <= result.num_trials <= 1 + len(space.neighbors(first))
    study = optuna.load_study(study_name=result.study_name, storage=url(tmp_path))
    candidates = [t.user_attrs["mpipe"]["candidate"] for t in study.trials]
    assert len({repr(c) for c in candidates}) == len(candidates)  # no repeats stored
    assert "converged" in result.how("tpe") and "stopped before the budget" in result.how("tpe")


def test_a_converged_sampler_switches_to_exhaustive_when_the_rest_fits_the_budget(tmp_path, monkeypatch):
    _stuck_sampler(monkeypatch)
    space, evaluator = make(devices=4, batch=8, skeletons=("1f1b",), owner_policies=("round-robin", "greedy"))
    optimum, evaluations = exhaustive_optimum(space, Evaluator(evaluator.problem))
    result = run_search(space, evaluator, storage=url(tmp_path), n_trials=len(evaluations), exhaustive=False,
                        refine=False, progress=False)
    assert result.mode == "optuna" and result.ending == "exhaustive" and result.space_size == len(evaluations)
    assert result.best.candidate == optimum.candidate and result.best.mean_s == optimum.mean_s
    assert result.num_trials <= len(evaluations)  # pruned by bounds: fewer than one trial per point
    assert "exhaustive" in result.how("tpe")


def test_a_sampler_that_settles_early_hands_over_to_the_refinement_first(tmp_path, monkeypatch):
    """Settled proposals before half the budget start the best-first refinement at once; the run ends
    only when that has no neighbour left either."""
    _stuck_sampler(monkeypatch)
    space, evaluator = make(devices=4, batch=8)
    first = next(space.enumerate())[0]
    stuck = run_search(space, evaluator, storage=url(tmp_path, "a.db"), n_trials=100, exhaustive=False,
                       refine=False, progress=False)
    refined = run_search(space, Evaluator(evaluator.problem), storage=url(tmp_path, "b.db"), n_trials=100,
                         exhaustive=False, progress=False)
    assert refined.num_trials > stuck.num_trials and refined.num_trials > 1 + len(space.neighbors(first))
    assert refined.best.mean_s <= stuck.best.mean_s


@pytest.mark.parametrize("tolerance", [0.0, 0.01, 0.05])
def test_the_bound_search_is_within_its_tolerance_of_the_optimum_and_says_its_gap(tolerance):
    space, evaluator = make(devices=4, batch=8, samples=2, recompute=(False, True), zero=(0, 1), max_microbatches=8)
    optimum, evaluations = exhaustive_optimum(space, evaluator)
    result = run_search(space, Evaluator(evaluator.problem), storage=None, n_trials=10**5, sampler="bound",
                        tolerance=tolerance, progress=False)
    assert result.mode == "bound" and result.space_size == len(evaluations)
    assert result.best.mean_s <= optimum.mean_s * (1 + tolerance) * (1 + 1e-9)
    assert 0 <= result.gap <= tolerance and result.ending in ("bound", "enumerated")
    assert result.num_evaluated + result.num_bounded <= result.space_size
    if tolerance == 0:
        assert result.best.mean_s == optimum.mean_s and result.gap == 0
    assert result.num_evaluated < len(evaluations)  # the bounds settle the rest


def test_the_bound_search_stops_at_the_trial_cap_and_reports_the_gap_left():
    space, evaluator = make(devices=4, batch=8, samples=2, recompute=(False, True), max_microbatches=8)
    result = run_search(space, evaluator, storage=None, n_trials=2, sampler="bound", progress=False)
    assert result.ending == "budget" and result.num_trials == 2 and result.gap is not None and result.gap >= 0
    assert "stopped at the trial budget of 2 trials" in result.how("bound")


def test_the_lower_bound_ignores_the_zero_stage_and_counts_the_owners_where_they_are_known():
    """The ZeRO stage and the encoder backwards' placement do not enter the bound; round-robin owners are
    known before the step, so they count, while a per-step policy's coarse bound holds for any owner map
    (below round-robin's) until its owners are found (:meth:`Evaluator.owner_bound`)."""
    space, evaluator = make(devices=4, batch=8, samples=2, zero=(0, 1), max_microbatches=8)
    fresh = Evaluator(evaluator.problem)  # no cache shared between the variants
    tighter = 0
    for _, c in space.enumerate():
        other = replace(c, zero_stage=1 - c.zero_stage, encoder_backward="earliest" if c.has_transpose else c.encoder_backward)
        assert fresh.lower_bounds(other) == Evaluator(evaluator.problem).lower_bounds(c)
        if c.has_transpose:
            rr, greedy = replace(c, owner_policy="round-robin"), replace(c, owner_policy="greedy")
            assert evaluator.lower_bound(greedy) <= evaluator.lower_bound(rr)
            assert evaluator.lower_bound(greedy) <= evaluator.owner_bound(greedy) <= evaluator.evaluate(greedy).mean_s * (1 + 1e-12)
            tighter += evaluator.lower_bound(greedy) < evaluator.lower_bound(rr)
    assert tighter > 0  # the round-robin owners' work tightens some bounds


def test_the_bound_search_caps_its_trials_by_the_space_and_names_a_timeout():
    """Without a trial budget the cap follows the space (a share of its points, at least the minimum);
    a time budget that stops it is named as such, with the gap left."""
    from mpipe_tune.search._driver import BOUND_MIN_TRIALS, bound_trial_cap

    space, evaluator = make(devices=4, batch=8, samples=2, recompute=(False, True), max_microbatches=8)
    result = run_search(space, evaluator, storage=None, n_trials=None, sampler="bound", progress=False, tolerance=0.01)
    assert result.trial_cap == bound_trial_cap(result.space_size) == BOUND_MIN_TRIALS and not result.timed_out
    assert bound_trial_cap(64_000) == 3_200 and bound_trial_cap(10**6) == 5_000
    stopped = run_search(space, Evaluator(evaluator.problem), storage=None, n_trials=None, sampler="bound",
                         progress=False, timeout_s=0.0)
    assert stopped.ending == "budget" and stopped.timed_out and stopped.num_trials == 0
    assert "stopped at the time budget (remaining gap" in stopped.how("bound") or stopped.gap is None
