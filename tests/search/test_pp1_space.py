"""pp = 1 in the space, the baselines and the bounds: the data-, tensor- and fully-sharded layouts without a
pipeline, searched with one schedule (every skeleton list is the same work in sequence on the one rank)."""

from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.algebra import Owners, derive
from mpipe_tune.errors import MpipeError
from mpipe_tune.search import BASELINES, Candidate, Evaluator, Problem, SearchSpace, SpaceOptions, baseline
from mpipe_tune.search._baselines import UNPIPELINED
from mpipe_tune.search._families import family_candidates
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

EVERY_SKELETON = SpaceOptions(skeletons=("1f1b", "gpipe", "zb1p", "zbv"), zero=(0, 1, 2, 3), recompute=(False, True))


@pytest.fixture(scope="module")
def tiny():
    problem = Problem(load_model("tiny-vit-llm"), load_profile("h100-sxm"), 4, 16, mix="image-heavy", num_samples=2)
    evaluator = Evaluator(problem)
    return evaluator, SearchSpace(problem, evaluator.reference_weights(), EVERY_SKELETON)


def test_the_default_space_holds_pp_1_with_one_schedule_and_no_owners(tiny):
    _, space = tiny
    assert {(1, 1, 4), (1, 2, 2), (1, 4, 1)} <= set(space.degrees)
    assert space.schedules(1, 4) == ["1f1b"] and len(space.schedules(2, 2)) > 1
    unpipelined = [c for _, c in space.enumerate() if c.pp == 1]
    assert {c.schedule for c in unpipelined} == {"1f1b"}
    assert {c.zero_stage for c in unpipelined} == {0, 1, 2, 3} and {c.cut for c in unpipelined} == {()}
    assert all(c.owner_policy is None for c in unpipelined)
    assert {c.num_microbatches for c in unpipelined if c.dp == 4} == {1, 2, 4}  # any M: gradient accumulation
    for c in unpipelined[:6]:
        plan = derive(*c.parsed(), space.problem.model, 1, c.num_microbatches, Owners())
        assert len(plan.order.nodes) == 1


def test_pp_1_takes_the_spaces_own_plain_skeleton_and_none_where_it_has_none(tiny):
    evaluator, space = tiny
    weights = evaluator.reference_weights()
    only = {s: SearchSpace(space.problem, weights, SpaceOptions(skeletons=(s,))) for s in ("gpipe", "zbv")}
    assert only["gpipe"].schedules(1, 4) == ["gpipe"]
    assert only["zbv"].schedules(1, 4) == [] and all(pp > 1 for pp, _, _ in only["zbv"].degrees)
    pinned = SearchSpace(space.problem, weights, SpaceOptions(pp=(1,)))
    assert {pp for pp, _, _ in pinned.degrees} == {1}
    with pytest.raises(MpipeError, match=r"pp 1 also needs a one-region skeleton: 1f1b, gpipe or zb1p\), tp must"):
        SearchSpace(space.problem, weights, SpaceOptions(pp=(1,), skeletons=("zbv",)))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_at_pp_1_every_other_schedule_is_no_real_gain_and_holds_more_memory(tiny, zero):
    """What leaving them out rests on: each schedule of the family at pp 1 (woven, gpipe, zero-bubble,
    transposed) predicted within 0.1% of ``1f1b``'s step time (the cost model puts a woven or transposed plan
    a few microseconds ahead at most: its gradient reduce in two pieces, the last one shorter) and its peak
    at least ``1f1b``'s."""
    evaluator, space = tiny
    for recompute in (False, True):
        def at_pp_1(schedule):
            transpose, _, sink = space.shape(schedule)
            owners = "round-robin" if transpose or sink or space.interior(schedule) else None
            cut = space.cut_of(schedule, 1, space.cut_window[0] if transpose else None)
            return evaluator.evaluate(Candidate(schedule, cut, 1, 1, 4, 4, owners, zero_stage=zero,
                                                recompute=recompute))

        plain = at_pp_1("1f1b")
        others = [at_pp_1(s) for s in space.family if s != "1f1b"]
        assert len(others) >= 10
        for e in others:
            assert e.mean_s >= plain.mean_s * (1 - 1e-3), e.candidate
            assert e.peak_bytes >= plain.peak_bytes * (1 - 1e-12), e.candidate


def test_at_pp_1_only_megatron_exists_and_the_others_say_why():
    model = load_model("example-mllm")
    assert set(UNPIPELINED) == set(BASELINES) - {"megatron"}
    c = baseline("megatron", model, 1, 2, 4, 8)
    assert c.schedule == "1f1b" and c.cut == () and c.slab_counts == ((model.num_layers,),)
    assert all(baseline(name, model, 1, 2, 4, 8, vpp_microbatches=(8,)) is None for name in UNPIPELINED)
    assert baseline("disttrain", model, 2, 1, 1, 8) is not None  # pp 2 still has them all
    assert baseline("mpipe-rr", model, 2, 1, 1, 8) is not None


def test_the_megatron_family_holds_its_pp_1_layouts_and_the_others_none(tiny):
    _, space = tiny
    assert {(c.pp, c.tp, c.dp) for c in family_candidates("megatron", space) if c.pp == 1} == {
        (1, 1, 4), (1, 2, 2), (1, 4, 1)}
    for name in UNPIPELINED:
        assert all(c.pp > 1 for c in family_candidates(name, space)), name


def test_the_bounds_hold_at_pp_1(tiny):
    """Every pp-1 point (ZeRO 0, 1, 2 and 3, full recomputation or none, each M): the step bounds and each bound
    level never exceed the prediction, the static floor and the peak floors never exceed the plan's memory;
    at one rank with nothing to fill the bound is close (every event of the step is on the rank)."""
    evaluator, space = tiny
    points = [c for _, c in space.enumerate() if c.pp == 1]
    ratios = []
    for c in points:
        e = evaluator.evaluate(c)
        assert all(b <= m * (1 + 1e-12) for b, m in zip(evaluator.lower_bounds(c), e.makespans_s)), c
        first, last = evaluator.bound_levels(c)
        levels = [evaluator.bound_at(c, level) for level in range(first, last + 1)]
        assert all(a <= b * (1 + 1e-12) for a, b in zip(levels, levels[1:])) and levels[-1] <= e.mean_s * (1 + 1e-12)
        assert 0 < evaluator.static_floor_bytes(c) <= evaluator.static_peak_bytes(c) * (1 + 1e-12), c
        floor = evaluator.peak_floor_bytes(c)
        assert evaluator.static_peak_bytes(c) <= floor <= evaluator.order_floor_bytes(c) <= e.peak_bytes * (1 + 1e-12)
        ratios.append(evaluator.lower_bound(c) / e.mean_s)
    assert np.min(ratios) > 0.8, np.min(ratios)


def test_zero_3_at_pp_1_shards_the_whole_model_over_the_data_ranks(tiny):
    """ZeRO-3 at pp 1 is FSDP: every rank holds a quarter of the whole model's weights, gradients and optimizer
    state at dp 4 (plus a gathered layer), less than at ZeRO 1 (every weight and gradient, a quarter of the
    optimizer state), less than one process holding it all."""
    evaluator, _ = tiny
    c = Candidate("1f1b", (), 1, 1, 4, 4)
    whole = evaluator.static_peak_bytes(replace(c, dp=1, zero_stage=0))
    sharded, optimizer = (evaluator.static_peak_bytes(replace(c, zero_stage=z)) for z in (3, 1))
    assert whole / 4 <= sharded < optimizer < whole
