"""Each baseline at its own best layout equals the exhaustive optimum restricted to its family."""

from dataclasses import replace

import pytest

from mpipe_tune.algebra import is_interleavable
from mpipe_tune.search import BASELINES, Evaluator, Problem, SearchSpace, SpaceOptions, baseline
from mpipe_tune.search._compare import (
    comparison_rows, evaluate_baselines, family_record, format_comparison, own_best_rows,
)
from mpipe_tune.search._families import family_candidates, search_families, search_family
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL = load_model("example-mllm")  # 8 encoder layers, 1 projector, 16 backbone layers
PROFILE = load_profile("ideal")


def make(profile=PROFILE, model=MODEL, **space):
    problem = Problem(model, profile, 4, 8, mix="balanced", num_samples=2, seed=1)
    evaluator = Evaluator(problem)
    options = SpaceOptions(max_microbatches=8, **space)
    return SearchSpace(problem, evaluator.reference_weights(), options), evaluator


def restricted_optimum(name, space, problem, chunk_counts):
    """The family's fastest plan that fits, by predicting every one of its plans in full with a fresh
    evaluator (no bounds), enumerated here from the space's degrees, microbatch counts and settings."""
    evaluator = Evaluator(problem)
    evaluations = []
    for pp, tp, dp in space.degrees:
        for chunks in chunk_counts:
            schedule = ",".join(["1f1b"] * chunks) if name == "vpp" else {"gpipe": "gpipe"}.get(name, "1f1b")
            for m in space.microbatch_choices(pp, dp, schedule if name != "mpipe-rr" else "transpose,1f1b"):
                c = baseline(name, problem.model, pp, tp, dp, m, vpp_microbatches=(m,), num_chunks=chunks)
                if c is None:
                    continue
                for recompute in space.options.recompute:
                    evaluations.append(evaluator.evaluate(replace(c, recompute=recompute)))
    fitting = [e for e in evaluations if e.fits]
    optimum = min((e.mean_s for e in fitting), default=None)
    return optimum, [e for e in fitting if e.mean_s == optimum], evaluations


def same_plan(a, b):
    return replace(a, label="") == replace(b, label="")


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("max_chunks", [2, 3])
def test_each_family_s_own_best_is_its_exhaustive_optimum(name, max_chunks):
    space, evaluator = make(recompute=(False, True), max_chunks=max_chunks)
    chunk_counts = range(2, max_chunks + 1) if name == "vpp" else [2]
    optimum, argmin, evaluations = restricted_optimum(name, space, evaluator.problem, chunk_counts)
    found = search_family(name, space, evaluator)
    assert found.num_candidates == len(evaluations) > 1
    assert found.best.mean_s == optimum
    assert any(same_plan(found.best.candidate, e.candidate) for e in argmin)
    assert found.best.candidate.label == f"{name}@own" and found.best.fits
    assert found.num_evaluated + found.num_bounded == found.num_candidates


def test_bounds_settle_most_candidates():
    space, evaluator = make(recompute=(False, True), max_chunks=3)
    families = search_families(space, evaluator)
    assert [f.name for f in families] == list(BASELINES)
    assert sum(f.num_bounded for f in families) > sum(f.num_evaluated for f in families)


@pytest.mark.parametrize("name", BASELINES)
def test_the_own_best_respects_a_capacity_that_binds(name):
    tiny = load_model("tiny-vit-llm")  # architecture costs: activations, not only weights, set the peak
    space, evaluator = make(model=tiny, recompute=(False, True))
    optimum, argmin, evaluations = restricted_optimum(name, space, evaluator.problem, [2])
    smaller = [e.peak_bytes for e in evaluations if e.peak_bytes < argmin[0].peak_bytes]
    capacity = max(smaller)  # the unconstrained optimum no longer fits, a plan of a smaller peak does
    space, evaluator = make(profile=replace(PROFILE, memory_capacity_bytes=capacity), model=tiny, recompute=(False, True))
    bound, argmin, evaluations = restricted_optimum(name, space, evaluator.problem, [2])
    assert bound > optimum and any(not e.fits and e.mean_s < bound for e in evaluations), "the capacity should bind"
    found = search_family(name, space, evaluator)
    assert found.best.mean_s == bound and found.best.peak_bytes <= capacity


def test_a_family_that_fits_nowhere_has_no_own_best():
    space, evaluator = make(profile=replace(PROFILE, memory_capacity_bytes=1.0))
    found = search_family("disttrain", space, evaluator)
    assert found.best is None and found.num_candidates > 0


def test_family_candidates_cover_the_space_s_degrees_microbatches_settings_and_vpp_chunks():
    space, _ = make(recompute=(False, True), max_chunks=3)
    vpp = family_candidates("vpp", space)
    assert {c.schedule for c in vpp} == {"1f1b,1f1b", "1f1b,1f1b,1f1b"}
    assert all(is_interleavable(c.pp, c.num_microbatches) and c.label == "vpp@own" for c in vpp)
    megatron = family_candidates("megatron", space)
    assert {(c.pp, c.tp, c.dp) for c in megatron} == set(space.degrees)
    assert {c.recompute for c in megatron} == {False, True}
    assert all(c.pp * c.tp * c.dp == 4 for c in megatron)
    assert {c.schedule for c in family_candidates("vpp", make(max_chunks=1)[0])} == {"1f1b,1f1b"}


def test_the_own_best_is_never_slower_than_the_baseline_at_the_best_plan_s_degrees():
    space, evaluator = make()
    families = {f.name: f for f in search_families(space, evaluator)}
    for _, point in list(space.enumerate())[::7]:  # any plan may be the winner: its degrees, M, recomputation
        for name, e in evaluate_baselines(evaluator, space, evaluator.evaluate(point)):
            if e is not None and e.fits:
                assert families[name].best.mean_s <= e.mean_s


def test_the_table_puts_each_own_row_after_its_baseline_and_says_when_none_fits():
    space, evaluator = make()
    best = evaluator.evaluate(next(space.enumerate())[1])
    baselines = evaluate_baselines(evaluator, space, best)
    families = search_families(space, evaluator)
    families[1] = replace(families[1], best=None)  # as if no disttrain plan fit memory
    summary = {"comparison": comparison_rows(best, baselines), "own_best": own_best_rows(best, baselines, families),
               "families": family_record(families), "current": None}
    text = format_comparison(summary)
    names = [line.split()[0] for line in text.splitlines()[2:13]]
    assert names == ["best", *(n for name in BASELINES for n in (name, f"{name}@own"))]
    count = families[1].num_candidates
    assert f"disttrain@own none of its {count} layouts in the space fits memory" in text
    megatron = next(r for r in summary["own_best"] if r["plan"] == "megatron@own")
    assert megatron["best_speedup"] == megatron["step_s"] / best.mean_s


@pytest.mark.parametrize("squeeze", [False, True])
def test_the_staged_family_order_finds_the_family_s_optimum_with_every_knob(squeeze):
    """With every memory knob (recomputation, ZeRO, sequence and context parallelism, the encoder's own tp),
    and a capacity that leaves part of each family out by its static memory alone (``squeeze``): each family's
    own best is the fastest plan that fits of all its candidates, each predicted in full by a fresh evaluator;
    and every level of the staged bound is at most the next and at most the candidate's step time (infinite
    only for a plan that does not fit)."""
    from mpipe_tune.search._families import StagedBound

    tiny = load_model("tiny-vit-llm")
    problem = Problem(tiny, load_profile("h100-sxm"), 8, 16, mix="image-heavy", num_samples=2, seed=2)
    options = SpaceOptions(recompute=(False, True), zero=(0, 1), sequence_parallel=(False, True), cp=(1, 2),
                           encoder_tp=True, max_microbatches=8)
    if squeeze:
        evaluator = Evaluator(problem)
        space = SearchSpace(problem, evaluator.reference_weights(), options)
        floors = sorted({evaluator.static_floor_bytes(c) for c in family_candidates("megatron", space)})
        problem = replace(problem, profile=replace(problem.profile, memory_capacity_bytes=floors[len(floors) // 2]))
    evaluator = Evaluator(problem)
    space = SearchSpace(problem, evaluator.reference_weights(), options)
    staged = StagedBound(Evaluator(problem))
    left_out = 0
    for name in BASELINES:
        candidates = family_candidates(name, space)
        exact = Evaluator(problem)
        evaluations = [exact.evaluate(c) for c in candidates]
        fitting = [e.mean_s for e in evaluations if e.fits]
        found = search_family(name, space, evaluator)
        assert (found.best is None) == (not fitting)
        if fitting:
            assert found.best.mean_s == min(fitting) and found.best.fits
        for c, e in list(zip(candidates, evaluations))[::5]:
            first, last = staged.levels(c)
            bounds = [staged.bound_at(c, level) for level in range(first, last + 1)]
            # within rounding: at pp 1 the staged work bound (all the work over one rank) and the slab bound (the
            # one rank's work) are the same sum, added in another order
            assert all(a <= b * (1 + 1e-12) for a, b in zip(bounds, bounds[1:])), c
            assert bounds[-1] <= e.mean_s * (1 + 1e-12) or (bounds[-1] == float("inf") and not e.fits), c
            left_out += bounds[0] == float("inf")
    assert (left_out > 0) == squeeze
