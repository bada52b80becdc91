"""ZeRO stage 3 (FSDP full sharding) in the cost model: memory and per-microbatch collectives, hand-counted
on small cases, and what the search relies on (a stage-3 plan's step is never below its stage-1 twin's)."""

import numpy as np
import pytest

from mpipe_tune.algebra import Cut, Model, Schedule, Skeleton, parse_schedule, Degrees, Bwd, DpReduce, Fwd
from mpipe_tune.cost import Framework, CostOptions, build_layer_table, estimate_collective_s, load_profile
from mpipe_tune.inputs import load_model

from conftest import charged_s, predict_plan, uniform_workload

IDEAL = load_profile("ideal")
H100 = load_profile("h100-sxm")
TINY = load_model("tiny-vit-llm")
BACKBONE = Model("backbone", TINY.layers[4:])  # embed, 4 decoders, head: 6 layers


def stage(zero: int, dp: int = 4, overlap_dp_comm: bool = True, **kw) -> CostOptions:
    return Framework(overlap_dp_comm=overlap_dp_comm).cost_options(Degrees(1, dp=dp), zero_stage=zero, **kw)


def run(model, options, profile=IDEAL, M=4, slabs=((3, 3),), schedule="1f1b"):
    return predict_plan(Cut(()), Schedule((Skeleton(schedule),)), model, uniform_workload(M, 0, 64), profile, 2,
                        slab_counts=slabs, options=options)


def test_stage3_shards_weights_gradients_and_state_and_holds_a_working_set():
    result = run(BACKBONE, stage(3))
    p = result.table.param_count
    for rank, layers in enumerate((p[:3], p[3:])):
        sharded = layers.sum() * (2 + 4 + 12) / 4
        working = 2 * layers.max() * 2 + layers.max() * 4  # two layers' weights gathered, one gradient
        assert result.memory.static_bytes[rank] == pytest.approx(sharded + working)


def test_frozen_layers_weights_are_sharded_and_hold_no_gradient():
    model = TINY.with_frozen(("encoder",))
    result = predict_plan(Cut((4,)), parse_schedule("transpose,1f1b"), model, uniform_workload(4, 16, 64), IDEAL, 2,
                          slab_counts=((3, 3),), options=stage(3))
    p = result.table.param_count
    held = p[:7]  # the transposed (frozen) encoder on every rank, then rank 0's backbone slab
    expected = p[:4].sum() * 2 / 4 + p[4:7].sum() * (2 + 4 + 12) / 4 + 2 * held.max() * 2 + p[4:7].max() * 4
    assert result.memory.static_bytes[0] == pytest.approx(expected)


def test_stage3_needs_less_memory_than_stage1_for_a_large_model_at_dp8():
    model = load_model("llama3-70b")
    one, three = (predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), model, uniform_workload(8, 0, 512), H100, 4,
                               options=stage(z, dp=8)) for z in (1, 3))
    assert max(three.memory.peak_bytes) < max(one.memory.peak_bytes) - 20e9  # weights and gradients: 6 of 18 B/param
    assert three.timeline.makespan_s >= one.timeline.makespan_s


def _collectives(result, options):
    """Per layer, the ring all-gather of its weights and the ring reduce-scatter of its gradient over the
    dp ranks of one node, by hand from the link's alpha and beta (dp = 4 inside a node of 8)."""
    link = H100.link("all_gather", inter_node=False)
    g = options.degrees.dp
    params = result.table.param_count
    gather = np.where(params > 0, (g - 1) * (link.alpha_s + link.beta_s_per_byte * params * 2 / g), 0.0)
    scatter = np.where(params > 0, (g - 1) * (link.alpha_s + link.beta_s_per_byte * params * 4 / g), 0.0)
    assert gather[1] == pytest.approx(estimate_collective_s(H100.link("all_reduce", inter_node=False),
                                                            "all_reduce", params[1] * 2, g) / 2)
    return gather, scatter


@pytest.mark.parametrize("overlap", [True, False])
def test_each_microbatch_gathers_before_forward_and_backward_and_reduce_scatters(overlap):
    one_options, three_options = (stage(z, overlap_dp_comm=overlap) for z in (1, 3))
    one, three = run(BACKBONE, one_options, H100), run(BACKBONE, three_options, H100)
    gather, scatter = _collectives(three, three_options)
    M = 4
    c = three.table.fwd_s
    B = three.table.backward_s(BACKBONE)
    extra = charged_s(three) - one.timeline.durations_s
    phi = H100.overlap_share  # the profile's share of a collective the compute beside it hides

    def beyond(x, compute):  # what a collective of x seconds beside that compute keeps the rank waiting
        return x - phi * min(x, compute)
    checked = set()
    for i, event in enumerate(three.plan.order.events):
        if isinstance(event, DpReduce):  # the last microbatch's reduce-scatters, the first one's gathers
            assert extra[i] == pytest.approx(0.0, abs=1e-15)
            continue
        if not isinstance(event, (Fwd, Bwd)):
            continue
        lo, hi = three.plan.slab(event.region, event.rank)
        m = event.mb
        r = scatter * (m < M - 1)  # the last microbatch's reduce-scatter is the step-end reduce's
        if isinstance(event, Fwd):
            g = gather * (m > 0)  # the first microbatch's gathers are the step-end reduce's
            expected = (g[lo] + sum(beyond(g[l], c[l - 1, m]) for l in range(lo + 1, hi)) if overlap
                        else g[lo:hi].sum())
        else:
            r_next = lambda l: r[l + 1] if l + 1 < len(r) else 0.0  # noqa: E731
            g_prev = lambda l: gather[l - 1] if l > 0 else 0.0  # noqa: E731
            expected = (gather[hi - 1] + sum(beyond(r_next(l) + g_prev(l), B[l, m]) for l in range(lo, hi)) + r[lo]
                        if overlap else (gather[lo:hi] + r[lo:hi]).sum())
        assert extra[i] == pytest.approx(expected, rel=1e-9, abs=1e-15), event
        checked.add(type(event))
    assert checked == {Fwd, Bwd}
    assert three.timeline.makespan_s > one.timeline.makespan_s


def test_full_recomputation_gathers_nothing_more():
    plain, full = (run(BACKBONE, stage(3, recompute=r), H100) for r in (False, True))
    one = run(BACKBONE, stage(1, recompute=True), H100)
    extra_full = charged_s(full) - one.timeline.durations_s
    base = run(BACKBONE, stage(1), H100)
    extra_plain = charged_s(plain) - base.timeline.durations_s
    forwards = [i for i, e in enumerate(full.plan.order.events) if isinstance(e, Fwd)]
    # the forwards' waits are the same (the re-run forward gathers nothing of its own)
    assert extra_full[forwards] == pytest.approx(extra_plain[forwards], rel=1e-9)


def test_a_table_is_shared_between_the_stages():
    # the layer table does not read the ZeRO stage: the waits are added to the event durations
    workload = uniform_workload(4, 0, 64)
    a, b = (build_layer_table(BACKBONE, workload, H100, stage(z)) for z in (1, 3))
    assert np.array_equal(a.fwd_s, b.fwd_s) and np.array_equal(a.backward_s(BACKBONE), b.backward_s(BACKBONE))


@pytest.mark.parametrize("zero,overlap", [((3, True), True), ((3, True), False), ((2, None), True)])
def test_the_actions_are_nodes_of_their_own_and_on_one_rank_the_step_is_the_folded_one(zero, overlap):
    """The per-microbatch gathers and reduce-scatters are timed as nodes beside their events: the events
    themselves last what they last at stage 1; on one pipeline rank (each rank a chain) the step equals the
    events with each action's seconds added to its event (the folded figure); under a pipeline an action can
    hide where its rank waits for another, so the step is at most that and at least the twin's."""
    def options(z):
        return stage(z[0], overlap_dp_comm=overlap, reshard_after_forward=z[1] if z[1] is not None else True)

    for pp, slabs in ((1, ((6,),)), (2, ((3, 3),))):
        one = predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), BACKBONE, uniform_workload(4, 0, 64), H100, pp,
                           slab_counts=slabs, options=options((1, None)))
        shard = predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), BACKBONE, uniform_workload(4, 0, 64), H100, pp,
                             slab_counts=slabs, options=options(zero))
        assert np.array_equal(shard.timeline.durations_s, one.timeline.durations_s)
        assert shard.timeline.actions_s is not None and shard.timeline.actions_s.sum() > 0
        folded = charged_s(shard)
        if pp == 1:  # a chain: the step is the sum of what its rank runs
            assert shard.timeline.makespan_s == pytest.approx(folded.sum(), rel=1e-12)
        assert one.timeline.makespan_s <= shard.timeline.makespan_s * (1 + 1e-12)
        assert shard.timeline.busy_s[0] == pytest.approx(folded[np.asarray(shard.plan.order.columns.nodes[0])].sum(), rel=1e-12)
        starts = shard.timeline.actions_start_s
        assert np.all(starts >= 0) and np.all(starts + shard.timeline.actions_s <= shard.timeline.makespan_s * (1 + 1e-12))


def test_a_plan_compiled_for_other_options_times_its_own_actions():
    """One derived plan compiled at stage 2, then for stage 3 resharding (more actions) and back: each copy's
    step is the one a fresh compile gives (the order with the actions is made for each setting's own)."""
    from mpipe_tune.algebra import derive
    from mpipe_tune.cost import CompiledPlan

    workload = uniform_workload(4, 0, 64)
    plan = derive(Cut(()), Schedule((Skeleton("1f1b"),)), BACKBONE, 2, 4)
    two, three = stage(2), stage(3, reshard_after_forward=True)
    table = build_layer_table(BACKBONE, workload, H100, two)
    first = CompiledPlan(plan, BACKBONE, H100, two)
    assert first.makespan(table) == CompiledPlan(plan, BACKBONE, H100, two).makespan(table)
    other = first.for_options(three)
    assert other.makespan(table) == CompiledPlan(plan, BACKBONE, H100, three).makespan(table) > first.makespan(table)
    assert other.for_options(two).makespan(table) == first.makespan(table)
