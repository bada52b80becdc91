from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.algebra import Cut, parse_schedule
from mpipe_tune.inputs import Microbatch
from mpipe_tune.errors import MpipeError
from mpipe_tune.search import Candidate, Evaluator, Problem, pack, max_spill
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model
from conftest import predict_plan

MODEL = load_model("example-mllm")
PROFILE = load_profile("ideal")


@pytest.fixture(scope="module")
def evaluator():
    return Evaluator(Problem(MODEL, PROFILE, 4, 16, mix="image-heavy", num_samples=3, seed=5))


def test_pack_concatenates_sequences_and_their_images():
    a, b = Microbatch(10, 100, (4, 6)), Microbatch(0, 100)
    assert pack((a,)) is a
    assert pack((a, b, Microbatch(7, 50))) == Microbatch(17, 250, (4, 6, 7))


def test_the_global_batch_is_the_same_work_for_every_microbatch_count(evaluator):
    problem = evaluator.problem
    for dp in (1, 2):
        totals = set()
        for M in (1, 2, 4, 16 // dp):
            w = problem.replica_workload(1, dp, M)
            assert len(w) == M
            totals.add((sum(mb.image_tokens for mb in w.microbatches), sum(mb.text_tokens for mb in w.microbatches)))
        assert len(totals) == 1
    assert problem.replica_workload(0, 2, 8).microbatches == problem.sequences(0, 8)


@pytest.mark.parametrize("policy", ["round-robin", "greedy", "optimal"])
def test_each_sampled_step_matches_the_cost_models_own_predict(evaluator, policy):
    c = Candidate("transpose,1f1b", (9,), pp=4, tp=1, dp=1, num_microbatches=8, owner_policy=policy)
    e = evaluator.evaluate(c)
    assert len(e.makespans_s) == 3
    for sample in range(3):
        workload, _ = evaluator.table(sample, c)
        owners = evaluator.owners(c, sample)
        p = predict_plan(Cut((9,)), parse_schedule("transpose,1f1b"), MODEL, workload, PROFILE, 4,
                    slab_counts=e.slab_counts, microbatch_owners=owners)
        assert p.timeline.makespan_s == pytest.approx(e.makespans_s[sample], rel=1e-12)


@pytest.mark.parametrize("model_name", ["tiny-vit-llm", "qwen2vl-vit-llama3-8b"])
def test_architecture_models_with_tp_and_dp_match_predict(model_name):
    model = load_model(model_name)
    profile = load_profile("h100-sxm")
    problem = Problem(model, profile, 16, 16, mix="balanced", num_samples=2)
    evaluator = Evaluator(problem)
    cut = model.backbone_start
    for c in (Candidate("transpose,1f1b", (cut,), 2, 2, 4, 4, "greedy", recompute=True),
              Candidate("1f1b", (), 4, 2, 2, 4)):
        e = evaluator.evaluate(c)
        for sample in range(2):
            workload, _ = evaluator.table(sample, c)
            p = predict_plan(*c.parsed(), model, workload, profile, c.pp, slab_counts=e.slab_counts,
                        microbatch_owners=evaluator.owners(c, sample), options=problem.options_for(c.tp, c.dp, c.recompute))
            assert p.timeline.makespan_s == pytest.approx(e.makespans_s[sample], rel=1e-12)
        peaks = [max(evaluator.prediction(c, k)[0].memory.peak_bytes) for k in range(2)]
        assert e.peak_bytes == pytest.approx(max(peaks), rel=1e-12)
        assert evaluator.evaluate(c, memory=False).mean_s == e.mean_s
    assert e.mean_s == pytest.approx(np.mean(e.makespans_s))
    assert min(e.makespans_s) <= e.p90_s <= max(e.makespans_s)


def test_one_static_slab_partition_serves_every_sampled_step(evaluator):
    c = Candidate("1f1b", (), pp=4, tp=1, dp=1, num_microbatches=8)
    slabs = evaluator.slab_counts(c)
    for sample in range(3):
        prediction, _ = evaluator.prediction(c, sample)
        assert prediction.plan.placement[0].owner.counts() == slabs[0]


def test_per_step_owner_policies_reduce_the_spill_the_model_predicts(evaluator):
    rr = Candidate("transpose,1f1b", (9,), pp=4, tp=1, dp=1, num_microbatches=8, owner_policy="round-robin")
    for k in range(3):
        encode, slack = evaluator.encode_s(rr, k), evaluator.slack_s(rr, k)
        spills = {p: max_spill(evaluator.owners(replace(rr, owner_policy=p), k), encode, slack)
                  for p in ("round-robin", "greedy", "optimal")}
        assert spills["optimal"] <= spills["greedy"] + 1e-12 <= spills["round-robin"] + 1e-12


def test_memory_capacity_decides_feasibility():
    model = load_model("tiny-vit-llm")
    problem = Problem(model, PROFILE, 2, 4, mix="balanced", num_samples=1)
    e = Evaluator(problem).evaluate(Candidate("1f1b", (), pp=2, tp=1, dp=1, num_microbatches=4))
    assert e.peak_bytes > 0 and e.fits and e.memory_excess_bytes < 0
    tight = Problem(model, replace(PROFILE, memory_capacity_bytes=e.peak_bytes / 2), 2, 4, mix="balanced", num_samples=1)
    e2 = Evaluator(tight).evaluate(Candidate("1f1b", (), pp=2, tp=1, dp=1, num_microbatches=4))
    assert not e2.fits and e2.memory_excess_bytes == pytest.approx(e.peak_bytes / 2)


def test_a_workload_file_is_one_step_of_the_global_batch():
    workload = Problem(MODEL, PROFILE, 2, 6, mix="balanced").replica_workload(0, 1, 6)
    problem = Problem(MODEL, PROFILE, 2, 6, workload=workload, num_samples=5)
    assert problem.samples == 1
    assert problem.replica_workload(0, 2, 3).microbatches == workload.microbatches[:3]
    with pytest.raises(MpipeError, match="holds 6 sequences but the global batch is 8"):
        Problem(MODEL, PROFILE, 2, 8, workload=workload)


def test_the_lower_bound_never_exceeds_the_prediction():
    from mpipe_tune.search import SearchSpace

    for model in (MODEL, load_model("tiny-vit-llm")):
        problem = Problem(model, PROFILE, 4, 8, mix="image-heavy", num_samples=2)
        evaluator = Evaluator(problem)
        space = SearchSpace(problem, evaluator.reference_weights())
        ratios = []
        for _, c in space.enumerate():
            e = evaluator.evaluate(c)
            bounds = evaluator.lower_bounds(c)
            assert all(b <= m * (1 + 1e-12) for b, m in zip(bounds, e.makespans_s)), c
            assert all(b <= m * (1 + 1e-12) for b, m in zip(evaluator.owner_bounds(c), e.makespans_s)), c
            assert evaluator.static_peak_bytes(c) <= e.peak_bytes
            ratios.append(evaluator.lower_bound(c) / e.mean_s)
        assert np.median(ratios) > 0.5  # and it is not trivially loose
    bounded = evaluator.bounded(c)
    assert not bounded.exact and bounded.mean_s == evaluator.lower_bound(c)
    assert bounded.peak_bytes == evaluator.static_peak_bytes(c) > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_lower_bounds_hold_on_random_points_with_every_knob_searched(seed):
    """Recomputation (full and selective), ZeRO, sequence and context parallelism, the encoder's own tp,
    every encoder backward placement, interior transposes and every owner policy: on random points the
    bound (and the bound with the policy's owners) never exceeds the prediction, and the owners known
    before the step (round-robin) tighten it on some."""
    from mpipe_tune.search import SearchSpace, SpaceOptions

    problem = Problem(load_model("tiny-vit-llm"), load_profile("h100-sxm"), 8, 16, mix="image-heavy", num_samples=2,
                      seed=seed)
    evaluator = Evaluator(problem)
    options = SpaceOptions(recompute=(False, "selective", True), zero=(0, 1), sequence_parallel=(False, True),
                           cp=(1, 2), encoder_tp=True, encoder_backward=("cooldown", "earliest", "optimised"),
                           interior_transpose=True, skeletons=("1f1b", "gpipe", "zb1p"))
    points = [c for _, c in SearchSpace(problem, evaluator.reference_weights(), options).enumerate()]
    rng = np.random.default_rng(seed)
    tighter = recomputed = 0
    for i in rng.choice(len(points), size=60, replace=False):
        c = points[i]
        e = evaluator.evaluate(c, memory=False)
        for bounds in (evaluator.lower_bounds(c), evaluator.owner_bounds(c)):
            assert all(b <= m * (1 + 1e-12) for b, m in zip(bounds, e.makespans_s)), c
        first, last = evaluator.bound_levels(c)
        levels = [evaluator.bound_at(c, level) for level in range(first, last + 1)]
        assert all(a <= b * (1 + 1e-12) for a, b in zip(levels, levels[1:])), c  # each level tighter ...
        assert levels[-1] <= e.mean_s * (1 + 1e-12), c  # ... and all valid
        recomputed += c.recompute is True and evaluator.recompute_bound(c) > evaluator.lower_bound(
            replace(c, recompute=False)) * (1 + 1e-9)
        if c.has_transpose and c.owner_policy == "round-robin":
            tighter += evaluator.lower_bound(c) > evaluator.lower_bound(replace(c, owner_policy="greedy"))
    assert tighter > 0 and recomputed > 0  # the owners and full recomputation's forwards count


def test_the_lower_bound_and_static_memory_hold_for_zero_bubble_plans():
    """Split backwards may end a rank on weight gradients (the bound leaves out the drain), and zbv's
    second region sits on the ranks in reverse (the bound's and the static memory's slabs follow)."""
    from mpipe_tune.search import SearchSpace, SpaceOptions

    problem = Problem(load_model("tiny-vit-llm"), load_profile("h100-sxm"), 4, 8, mix="image-heavy", num_samples=2)
    evaluator = Evaluator(problem)
    space = SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(skeletons=("zb1p", "zbv")))
    schedules = set()
    for _, c in space.enumerate():
        e = evaluator.evaluate(c)
        assert all(b <= m * (1 + 1e-12) for b, m in zip(evaluator.lower_bounds(c), e.makespans_s)), c
        prediction, _ = evaluator.prediction(c)
        assert evaluator.static_peak_bytes(c) == pytest.approx(max(prediction.memory.static_bytes), rel=1e-12)
        schedules.add(c.schedule)
    assert {"zb1p", "zbv,zbv", "transpose,zb1p", "transpose,zbv,zbv"} <= schedules


def test_static_memory_is_the_cost_models_own():
    model = load_model("qwen2vl-vit-llama3-8b")
    problem = Problem(model, load_profile("h100-sxm"), 16, 16, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    for c in (Candidate("transpose,1f1b,1f1b", (33, 53), 4, 2, 2, 4, "greedy"), Candidate("gpipe", (), 2, 4, 2, 8)):
        prediction, _ = evaluator.prediction(c)
        assert evaluator.static_peak_bytes(c) == pytest.approx(max(prediction.memory.static_bytes), rel=1e-12)


def test_the_static_floor_never_exceeds_a_plans_static_memory_and_settles_what_cannot_fit():
    """The floor (every layer's static bytes over the P ranks, from the degrees and knobs alone) is below
    every plan's largest per-rank static memory; a plan whose floor is over capacity gets an infinite bound."""
    from mpipe_tune.search import SearchSpace, SpaceOptions

    problem = Problem(load_model("tiny-vit-llm"), load_profile("h100-sxm"), 8, 16, mix="image-heavy", num_samples=1)
    evaluator = Evaluator(problem)
    options = SpaceOptions(zero=(0, 1), sequence_parallel=(False, True), encoder_tp=True, cp=(1, 2))
    points = [c for _, c in SearchSpace(problem, evaluator.reference_weights(), options).enumerate()]
    for c in points[::7]:
        assert 0 < evaluator.static_floor_bytes(c) <= evaluator.static_peak_bytes(c) * (1 + 1e-12), c
    tight = replace(problem.profile, memory_capacity_bytes=min(evaluator.static_floor_bytes(c) for c in points) / 2)
    squeezed = Evaluator(replace(problem, profile=tight))
    assert all(squeezed.bound_at(c, level) == float("inf") for c in points[:20] for level in range(1, 3))


def test_the_static_floor_is_the_same_whichever_setting_built_its_parameter_table():
    """The static floor reads one parameter table per tensor-parallel degree (backbone and encoder) and expert
    degree, whichever setting built it (recomputation, sequence and context parallelism, ZeRO): on a MoE model
    with every knob, each point's floor equals the one read off a table of its own setting."""
    from pathlib import Path

    from mpipe_tune.cost import static_bytes_of
    from mpipe_tune.inputs import Workload
    from mpipe_tune.search import SearchSpace, SpaceOptions

    model = load_model(str(Path(__file__).parents[1] / "runtime" / "tiny-mllm-mla-moe.yaml"))
    problem = Problem(model, load_profile("h100-sxm"), 8, 16, mix="image-heavy", num_samples=1)
    options = SpaceOptions(recompute=(False, "selective", True), zero=(0, 1), sequence_parallel=(False, True),
                           cp=(1, 2), ep=None, encoder_tp=True, max_microbatches=4)
    evaluator = Evaluator(problem)
    points = [c for _, c in SearchSpace(problem, evaluator.reference_weights(), options).enumerate()]
    chosen = [points[i] for i in np.random.default_rng(0).permutation(len(points))[:300]]
    assert {c.ep for c in chosen} > {1} and {c.cp for c in chosen} > {1} and {c.encoder_tp for c in chosen} > {None}
    one = Workload(problem.sequences(0, 1), "static")
    for c in chosen:
        own = evaluator.predictor.table(c, one)
        expected = sum(static_bytes_of((((0, model.num_layers),),), model, own, evaluator.options(c))) / c.pp
        assert evaluator.static_floor_bytes(c) == expected, c


@pytest.mark.parametrize("seed", [0, 1])
def test_the_peak_floor_and_step_bounds_hold_on_random_moe_points(seed):
    """Expert parallelism (all-to-alls, imbalance, experts split over ep), with every other knob, split
    backwards, interior transposes and every encoder backward placement, the encoder trainable or frozen:
    on random points the peak floors (static memory plus one microbatch's saved activations per slab, and
    plus what the order keeps live together) never exceed the predicted peak,
    the step bounds never exceed the prediction, and the floor settles plans (an infinite bound) that the
    static memory alone does not, each of which indeed does not fit."""
    from pathlib import Path

    from mpipe_tune.search import SearchSpace, SpaceOptions

    model = load_model(str(Path(__file__).parents[1] / "runtime" / "tiny-mllm-mla-moe.yaml"))
    if seed:
        model = model.with_frozen(("encoder",))
    problem = Problem(model, load_profile("h100-sxm"), 8, 16, mix="image-heavy", num_samples=2, seed=seed)
    evaluator = Evaluator(problem)
    options = SpaceOptions(recompute=(False, "selective", True), zero=(0, 1), sequence_parallel=(False, True),
                           cp=(1, 2), ep=None, encoder_tp=True, interior_transpose=True,
                           encoder_backward=("cooldown", "earliest", "optimised"),
                           skeletons=("1f1b", "gpipe", "zb1p"), max_microbatches=16)
    points = [c for _, c in SearchSpace(problem, evaluator.reference_weights(), options).enumerate()]
    assert {c.ep for c in points} > {1}
    chosen = [points[i] for i in np.random.default_rng(seed).choice(len(points), size=60, replace=False)]
    floors, tighter = [], 0
    for c in chosen:
        e = evaluator.evaluate(c)
        assert all(b <= m * (1 + 1e-12) for b, m in zip(evaluator.owner_bounds(c), e.makespans_s)), c
        floor, order_floor = evaluator.peak_floor_bytes(c), evaluator.order_floor_bytes(c)
        assert evaluator.static_peak_bytes(c) <= floor <= order_floor <= e.peak_bytes * (1 + 1e-12), c
        floors.append(floor)
        tighter += order_floor > floor * (1 + 1e-9)
    assert tighter > 0  # the order keeps more than one microbatch live on some plans
    capacity = float(np.median(floors))
    squeezed = Evaluator(replace(problem, profile=replace(problem.profile, memory_capacity_bytes=capacity)))
    for level in (1, 2):
        settled = [c for c in chosen if squeezed.static_peak_bytes(c) <= capacity
                   and squeezed.bound_at(c, level) == float("inf")]
        assert settled
        assert all(not squeezed.evaluate(c).fits for c in settled)


def test_tables_expected_together_are_built_in_one_pass_and_equal_those_built_alone(monkeypatch):
    """Settings that differ only in dp and M share the kernels' options: the first asked for is built with the
    others expected, in one call, and every table is the one a fresh evaluator builds for that setting alone."""
    from mpipe_tune.cost import Predictor

    problem = Problem(load_model("tiny-vit-llm"), load_profile("h100-sxm"), 8, 16, mix="image-heavy", num_samples=2,
                      seed=4)
    base = Candidate("1f1b", (), pp=2, tp=2, dp=2, num_microbatches=4, sequence_parallel=True)
    settings = [replace(base, dp=dp, pp=8 // (2 * dp), num_microbatches=m) for dp in (1, 2, 4) for m in (2, 4)]
    other = replace(base, tp=1, sequence_parallel=False)  # other kernel options: not in the pass
    evaluator = Evaluator(problem)
    calls = []
    tables = Predictor.tables
    monkeypatch.setattr(Predictor, "tables", lambda self, c, workloads: calls.append(len(workloads)) or tables(
        self, c, workloads))
    evaluator.expect([*settings, other])
    evaluator.expect([replace(base, recompute=True)], plain=True)  # its setting without recomputation: base's
    for c in reversed(settings):
        for sample in range(2):
            workload, table = evaluator.table(sample, c)
            alone_workload, alone = Evaluator(problem).table(sample, c)
            assert workload.microbatches == alone_workload.microbatches and len(workload) == c.num_microbatches
            for field in ("fwd_s", "dgrad_s", "wgrad_s", "saved_bytes", "boundary_bytes", "param_count"):
                assert np.array_equal(getattr(table, field), getattr(alone, field)), field
    assert calls[0] == 2 * len(settings)  # one pass, every sampled step of every setting expected
    n = len(calls)
    evaluator.table(0, other)
    assert calls[n] == 2  # alone
    assert evaluator.table(1, base)[1] is evaluator.table(1, replace(base, pp=4, zero_stage=0))[1]  # no table reads them
