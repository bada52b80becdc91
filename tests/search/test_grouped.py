"""The bound search's grouped order: groups partition the space, and the lazy order is the whole space's."""

import pytest

from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.search._bounds import BoundOrder
from mpipe_tune.search._grouped import GroupOrder, StagedWorkBound
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

SPACES = {
    "example, memory knobs": ("example-mllm", "ideal", 4, 8, dict(recompute=(False, "selective", True), zero=(0, 1),
                                                                  max_microbatches=8)),
    "llama3-8b, every knob": ("qwen2vl-vit-llama3-8b", "h100-sxm", 8, 32, dict(
        recompute=(False, True), zero=(0, 1), sequence_parallel=(False, True), cp=(1, 2), encoder_tp=True,
        encoder_backward=("cooldown", "earliest"))),
    "example, 64 devices, every knob": ("example-mllm", "ideal", 64, 256, dict(
        recompute=(False, "selective", True), zero=(0, 1), sequence_parallel=(False, True), cp=(1, 2), encoder_tp=True,
        encoder_backward=("cooldown", "earliest", "optimised"),
        min_pp=2)),  # pipelines: on the ideal profile pp 1 has no bubble, and its bound is its step (no gap left)
}


def make(name, samples=1):
    model, profile, devices, batch, options = SPACES[name]
    problem = Problem(load_model(model), load_profile(profile), devices, batch, mix="balanced", num_samples=samples,
                      seed=3)
    evaluator = Evaluator(problem)
    return SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(**options)), evaluator


@pytest.mark.parametrize("name", list(SPACES)[:2])
def test_the_groups_partition_the_space_in_tree_order(name):
    space, _ = make(name)
    points = list(space.walk())
    assert [key for key, _, _ in points] == sorted(key for key, _, _ in points)  # keys sort as the points come
    by_key = {key: (params, c) for key, params, c in points}
    grouped = []
    for group in space.groups():
        members = list(space.group_points(group))
        assert len(members) == group.size > 0
        pp, tp, dp, cp = group.layout
        for key, params, c in members:
            assert by_key[key] == (params, c)
            assert (c.pp, c.tp, c.dp, c.cp, c.num_microbatches) == (pp, tp, dp, cp, group.num_microbatches)
            encoder_tp = c.tp if c.encoder_tp is None else c.encoder_tp  # None: the backbone's
            assert (c.recompute, c.ep, c.zero_stage, c.reshard_after_forward, c.sequence_parallel,
                    encoder_tp) == group.setting
        grouped.extend(key for key, _, _ in members)
    assert sorted(grouped) == sorted(by_key)  # every point in exactly one group


def test_the_grouped_order_is_the_whole_space_bound_order():
    """Points come out of the lazy grouped order as out of one BoundOrder over every point: by final bound,
    ties in tree order; the group's bound is below each of its points' final bounds."""
    space, evaluator = make("example, memory knobs", samples=2)
    capacity = evaluator.problem.profile.memory_capacity_bytes
    everything = [c for _, c in space.enumerate()]
    whole = BoundOrder(everything, evaluator.bound_levels, evaluator.bound_at)
    expected = []
    while whole:
        low, index = whole.peek()
        whole.pop()
        expected.append((low, everything[index]))
    work = StagedWorkBound(evaluator)
    order = GroupOrder(space, evaluator.static_floor_bytes, capacity, work, work.levels, evaluator.bound_levels,
                       evaluator.bound_at)
    got = []
    while order:
        low = order.low()
        point = order.step()
        if point is not None:
            got.append((low, point[1]))
    assert order.left == 0 and order.size == len(everything)
    assert [c for _, c in got] == [c for _, c in expected]
    assert [low for low, _ in got] == pytest.approx([low for low, _ in expected], rel=1e-12)


@pytest.mark.parametrize("tolerance", [0.0, 0.01])
def test_the_bound_search_returns_the_exhaustive_optimum_and_builds_only_the_groups_it_opens(tolerance):
    space, evaluator = make("example, memory knobs", samples=2)
    evaluations = [evaluator.evaluate(c) for _, c in space.enumerate()]
    optimum = min((e for e in evaluations if e.fits), key=lambda e: e.mean_s)
    built = []
    original = space.group_points
    space.group_points = lambda group: built.append(group) or original(group)
    result = run_search(space, Evaluator(evaluator.problem), storage=None, n_trials=10**5, sampler="bound",
                        tolerance=tolerance, progress=False)
    assert result.mode == "bound" and result.space_size == len(evaluations)
    assert result.best.mean_s <= optimum.mean_s * (1 + tolerance) * (1 + 1e-9)
    if tolerance == 0:
        assert result.best.candidate == optimum.candidate
    groups = list(space.groups())
    opened = {g for g in built[len(groups):]}  # the first len(groups) calls read each group's first point
    assert 0 < len(opened) < len(groups)  # the groups whose bound loses are never opened
    assert result.num_evaluated + result.num_bounded <= result.space_size


def test_a_space_over_the_old_enumeration_limit_is_searched_by_bound():
    """No space is too large for the bound order: it never holds every point (above 250,000 points the
    search used to fall back to TPE). Here every point built is counted: a small share of the space."""
    space, evaluator = make("example, 64 devices, every knob")
    size = sum(g.size for g in space.groups())
    assert size > 250_000
    built = []
    original = space.build
    space.build = lambda choose: built.append(1) or original(choose)
    result = run_search(space, evaluator, storage=None, n_trials=2000, sampler="bound", tolerance=0.01, progress=False)
    assert result.mode == "bound" and result.space_size == size and result.ending == "bound"
    assert 0 < result.gap <= 0.01 and result.num_evaluated + result.num_bounded <= size
    assert len(built) < size / 20


def test_a_group_bound_rises_by_sampled_step_and_bounds_every_point_of_the_group():
    space, evaluator = make("example, memory knobs", samples=3)
    work = StagedWorkBound(evaluator)
    assert work.levels == 3
    for group in space.groups():
        points = [c for _, _, c in space.group_points(group)]
        bounds = [work(points[0], level) for level in range(1, work.levels + 1)]
        assert 0 < bounds[0] <= bounds[1] <= bounds[2] == evaluator.bound_at(points[0], 0)
        assert all(bounds[-1] <= evaluator.evaluate(c).mean_s * (1 + 1e-12) for c in points)


def test_when_nothing_fits_the_rest_comes_out_least_floor_first_opened_groups_included():
    """Nothing fits: groups still closed (static floor over capacity) and points of opened groups (their own
    memory floor out of reach) both come back, each point once, least floor first (the default 512-device
    DeepSeek-V3 plan reached this with both kinds left)."""
    space, _ = make("example, memory knobs")
    groups = list(space.groups())
    closed = {g.layout + (g.num_microbatches,) + tuple(map(str, g.setting)) for g in groups[::2]}

    def tag(c):
        encoder_tp = c.tp if c.encoder_tp is None else c.encoder_tp
        return (c.pp, c.tp, c.dp, c.cp, c.num_microbatches, *map(str, (c.recompute, c.ep, c.zero_stage,
                                                                        c.sequence_parallel, encoder_tp)))

    def floor(c):
        return 2.0 + c.pp if tag(c) in closed else 1.0

    order = GroupOrder(space, floor, 1.5, lambda c, level: 0.0, 1, lambda c: (0, 1),
                       lambda c, level: float("inf"))
    taken = []
    while order.low() < float("inf"):
        taken.append(order.step())
    assert all(t is None for t in taken) and len(closed) < len(groups)
    rest = order.unfit()
    floors = [f for f, _ in rest]
    assert floors == sorted(floors) and floors[0] == 1.0
    points = [c for _, pts in rest for _, c in pts]
    assert sorted(map(repr, points)) == sorted(repr(c) for _, c in space.enumerate())
    assert not order and order.left == 0
