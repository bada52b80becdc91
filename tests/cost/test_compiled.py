"""The compiled plan: its passes against readable references, and owner maps re-timed without a derive."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import Degrees, Bwd, Coll, Comm, Cut, Fwd, Schedule, Skeleton, parse_schedule
from mpipe_tune.cost import (
    CompiledPlan, CostOptions, build_layer_table, Prediction, load_profile, longest_path_reference,
)
from mpipe_tune.inputs import Microbatch, Workload, load_workload, load_model

from conftest import make_model, predict_plan


def _same_step(retimed: CompiledPlan, fresh: Prediction, table) -> None:
    """``retimed`` predicts exactly what a fresh derive + predict with its owners does."""
    assert retimed.events() == fresh.plan.order.events
    assert set(zip(retimed.order.src.tolist(), retimed.order.dst.tolist())) == {
        (s, t) for s, t, _ in fresh.plan.order.edges}
    assert [x.tolist() for x in retimed.order.nodes] == [list(n) for n in fresh.plan.order.nodes]
    assert retimed.plan == fresh.plan  # placement, edges in derive's order and kinds, topological order
    t, f = retimed.timeline(table), fresh.timeline
    assert np.array_equal(t.durations_s, f.durations_s)
    assert np.array_equal(t.finish_s, f.finish_s)
    assert t.makespan_s == f.makespan_s
    assert retimed.makespan(table) == f.makespan_s == retimed.makespan(table)  # two passes, then one call
    for a, b in ((t.busy_s, f.busy_s), (t.spill_s, f.spill_s), (t.encoder_s, f.encoder_s),
                 (t.warmup_slack_s, f.warmup_slack_s)):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
    assert retimed.memory(table, t).peak_bytes == pytest.approx(fresh.memory.peak_bytes, rel=1e-12)


@st.composite
def owner_changes(draw):
    P = draw(st.integers(1, 4))
    M = draw(st.integers(1, 7))
    v = draw(st.integers(1, 2)) if M % max(1, M // P) == 0 or M < P else 1
    per = [draw(st.integers(P, P + 2)) for _ in range(v)]
    enc = draw(st.integers(1, 3))
    frozen = draw(st.booleans())
    model = make_model(["encoder"] * enc + ["llm"] * sum(per),
                       trainable=[not frozen] * enc + [True] * sum(per))
    skeleton = draw(st.sampled_from(["1f1b", "gpipe", "zb1p"]))
    cut = Cut(tuple([enc] + [enc + sum(per[:i]) for i in range(1, v)]))
    schedule = Schedule((Skeleton.TRANSPOSE,) + (Skeleton(skeleton),) * v)
    workload = Workload(tuple(Microbatch(draw(st.integers(0, 50)), draw(st.integers(1, 50))) for _ in range(M)))
    maps = [tuple(draw(st.integers(0, P - 1)) for _ in range(M)) for _ in range(3)]
    profile = load_profile(draw(st.sampled_from(["ideal", "h100-sxm", "cpu-generic"])))
    return cut, schedule, model, workload, profile, P, maps


@given(owner_changes())
def test_owner_maps_retimed_equal_a_fresh_derive(case):
    cut, schedule, model, workload, profile, P, maps = case
    if schedule.skeletons[1].runs_in_rounds and len(schedule.skeletons) > 2 and len(workload) % max(
            1, len(workload) // P):
        return  # interleaving needs M a multiple of its rounds: derive refuses it
    base = predict_plan(cut, schedule, model, workload, profile, P)
    compiled = CompiledPlan(base.plan, model, profile, CostOptions())
    table = base.table
    for owners in maps:
        fresh = predict_plan(cut, schedule, model, workload, profile, P, microbatch_owners=owners)
        _same_step(compiled.with_owners(owners), fresh, table)


@pytest.mark.parametrize("P,M,tp,dp", [(16, 32, 1, 1), (4, 8, 4, 1), (4, 8, 1, 2)])
def test_owner_maps_retimed_across_nodes_equal_a_fresh_derive(P, M, tp, dp):
    """A real model on 8-device nodes: moved Gathers and Scatters change link class (or become free);
    with dp > 1 the data-parallel reduces' overlap reads the ranks' new orders."""
    model = load_model("qwen2vl-vit-llama3-8b")
    profile = load_profile("h100-sxm")
    options = CostOptions(degrees=Degrees(1, tp=tp, dp=dp))
    workload = load_workload("balanced", num_microbatches=M, seed=3)
    cut = Cut((next(i for i, u in enumerate(model.layers) if u.block == "llm"),))
    schedule = parse_schedule("transpose,1f1b")
    base = predict_plan(cut, schedule, model, workload, profile, P, options=options)
    slabs = (base.plan.placement[1].owner.counts(),)
    compiled = CompiledPlan(base.plan, model, profile, options)
    rng = np.random.default_rng(0)
    maps = [tuple(int(r) for r in rng.integers(0, P, M)) for _ in range(3)] + [(P - 1,) * M, (0,) * M]
    for owners in maps:
        fresh = predict_plan(cut, schedule, model, workload, profile, P, slab_counts=slabs, microbatch_owners=owners,
                        options=options)
        _same_step(compiled.with_owners(owners), fresh, base.table)
    # A re-timed plan re-times again, and back to where it started.
    again = compiled.with_owners(maps[0]).with_owners(maps[1])
    _same_step(again, predict_plan(cut, schedule, model, workload, profile, P, slab_counts=slabs,
                              microbatch_owners=maps[1], options=options), base.table)
    assert compiled.with_owners(compiled.owners).makespan(base.table) == base.timeline.makespan_s


@pytest.mark.parametrize("tier", ["python", "compiled"])
def test_the_makespan_in_one_kernel_call_is_the_timelines(tier):
    """makespan's single kernel call (durations, the optimizer update, the longest path) gives the
    timeline's makespan bit for bit, in either tier, on the plan and on re-timed owner maps."""
    from mpipe_tune import jit

    model, profile = load_model("qwen2vl-vit-llama3-8b"), load_profile("h100-sxm")
    cut = Cut((next(i for i, u in enumerate(model.layers) if u.block == "llm"),))
    rng = np.random.default_rng(1)
    with jit.tier(tier):
        for seed in range(3):
            base = predict_plan(cut, parse_schedule("transpose,1f1b"), model,
                                load_workload("balanced", num_microbatches=12, seed=seed), profile, 6)
            compiled = CompiledPlan(base.plan, model, profile, CostOptions())
            for _ in range(2):  # the first call takes the two passes, the second the one call
                assert compiled.makespan(base.table) == base.timeline.makespan_s
            assert compiled._packed(base.table) is not None  # the one-call pass ran
            for _ in range(3):
                retimed = compiled.with_owners(tuple(int(r) for r in rng.integers(0, 6, 12)))
                expected = retimed.timeline(base.table).makespan_s
                assert retimed.makespan(base.table) == expected and retimed.makespan(base.table) == expected


def test_an_owner_map_of_the_wrong_length_is_refused():
    model = make_model(["encoder", "llm", "llm"])
    base = predict_plan(Cut((1,)), parse_schedule("transpose,1f1b"), model, Workload((Microbatch(1, 1),) * 4), load_profile("ideal"), 2)
    compiled = CompiledPlan(base.plan, model, load_profile("ideal"), CostOptions())
    with pytest.raises(Exception, match="owner"):
        compiled.with_owners((0, 1, 0))


def test_durations_and_memory_equal_their_per_event_definitions():
    """Compute events sum their slab's layers, transfers are alpha + beta * bytes (free on one rank),
    and the activation peak is the running sum of live tensors on the timeline."""
    model = load_model("qwen2vl-vit-llama3-8b")
    profile = load_profile("h100-sxm")
    options = CostOptions()
    workload = load_workload("balanced", num_microbatches=6, seed=1)
    cut = Cut((next(i for i, u in enumerate(model.layers) if u.block == "llm"),))
    result = predict_plan(cut, parse_schedule("transpose,1f1b"), model, workload, profile, 4,
                     microbatch_owners=(0, 0, 1, 3, 3, 2), options=options)
    plan, table, t = result.plan, result.table, result.timeline
    bwd = table.backward_s(model)
    for i, e in enumerate(plan.order.events):
        if isinstance(e, (Fwd, Bwd)):
            lo, hi = plan.slab(e.region, e.rank)
            per_layer = table.fwd_s if isinstance(e, Fwd) else bwd
            assert t.durations_s[i] == pytest.approx(per_layer[lo:hi, e.mb].sum(), rel=1e-12)
        elif isinstance(e, Coll) and e.src[1] == e.dst[1]:
            assert t.durations_s[i] == 0.0
        elif isinstance(e, Coll):
            producer = e.src if e.comm in (Comm.SEND, Comm.GATHER) else e.dst
            kind = {Comm.SEND: "p2p", Comm.RECV_GRAD: "p2p", Comm.GATHER: "gather", Comm.SCATTER: "scatter"}[e.comm]
            link = profile.link(kind, inter_node=False)
            n = table.boundary_bytes[plan.slab(*producer)[1] - 1, e.mb]
            assert t.durations_s[i] == pytest.approx(link.alpha_s + link.beta_s_per_byte * n, rel=1e-12)
    assert np.array_equal(t.finish_s, longest_path_reference(plan, t.durations_s))
    # The activation peak, by a per-rank walk over allocations and frees.
    index = plan.index
    deltas = [[] for _ in range(plan.num_ranks)]
    for i, e in enumerate(plan.order.events):
        if isinstance(e, Fwd) and Bwd(e.region, e.rank, e.mb) in index:
            lo, hi = plan.slab(e.region, e.rank)
            size = table.saved_bytes[lo:hi, e.mb].sum()
            deltas[e.rank] += [(t.start_s[i], size), (t.finish_s[index[Bwd(e.region, e.rank, e.mb)]], -size)]
        elif isinstance(e, Coll) and e.comm in (Comm.SEND, Comm.GATHER):
            size = table.boundary_bytes[plan.slab(*e.src)[1] - 1, e.mb]
            deltas[e.src[1]] += [(t.start_s[index[Fwd(e.src[0], e.src[1], e.mb)]], size), (t.finish_s[i], -size)]
    tick = 1e-12 * t.finish_s.max()  # instants equal up to rounding are one instant, frees first (_memory.py)
    for rank, rank_deltas in enumerate(deltas):
        running, peak = 0.0, 0.0
        for _, d in sorted((round(time / tick), d) for time, d in rank_deltas):
            running += d
            peak = max(peak, running)
        assert result.memory.activation_peak_bytes[rank] == pytest.approx(peak, rel=1e-9)


def test_other_cost_options_share_the_order_and_match_predict():
    model = load_model("qwen2vl-vit-llama3-8b")
    profile = load_profile("h100-sxm")
    workload = load_workload("balanced", num_microbatches=8, seed=2)
    cut = Cut((next(i for i, u in enumerate(model.layers) if u.block == "llm"),))
    schedule = parse_schedule("transpose,1f1b")
    base = predict_plan(cut, schedule, model, workload, profile, 4)
    slabs = (base.plan.placement[1].owner.counts(),)
    compiled = CompiledPlan(base.plan, model, profile, CostOptions())
    for options in (CostOptions(degrees=Degrees(1, tp=2)), CostOptions(degrees=Degrees(1, dp=4)),
                    CostOptions(recompute="full")):
        other = compiled.for_options(options)
        assert other.order is compiled.order
        fresh = predict_plan(cut, schedule, model, workload, profile, 4, slab_counts=slabs, options=options)
        table = build_layer_table(model, workload, profile, options)
        assert other.timeline(table).makespan_s == fresh.timeline.makespan_s
        assert other.memory(table, other.timeline(table)).peak_bytes == pytest.approx(fresh.memory.peak_bytes,
                                                                                      rel=1e-12)
