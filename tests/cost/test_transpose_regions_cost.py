"""The cost model on interior and sink transposes: per-event durations, memory (a Replicated region's
weights on every rank, its activations on the owner), and owner maps re-timed."""

import numpy as np
import pytest

from mpipe_tune.algebra import Bwd, Coll, Comm, Cut, Fwd, parse_schedule
from mpipe_tune.cost import CompiledPlan, CostOptions
from mpipe_tune.cost._memory import estimate_static_bytes, static_bytes_of
from mpipe_tune.cost import load_profile, longest_path_reference
from mpipe_tune.inputs import load_workload, load_model

from conftest import predict_plan, walked_peaks

MODEL = load_model("qwen2vl-vit-llama3-8b")
VISION = MODEL.backbone_start
LAST = MODEL.num_layers - 1  # the LM head
H100 = load_profile("h100-sxm")
CASES = {
    "sink head": ("1f1b,transpose", (LAST,)),
    "encoder and head": ("transpose,1f1b,transpose", (VISION, LAST)),
    "interior": ("1f1b,transpose,1f1b", (VISION, VISION + 4)),
}


def predicted(name, P=4, M=8, owners=None, options=CostOptions(), frozen=()):
    schedule, cut = CASES[name]
    model = MODEL.with_frozen(frozen) if frozen else MODEL
    workload = load_workload("balanced", num_microbatches=M, seed=2)
    return predict_plan(Cut(cut), parse_schedule(schedule), model, workload, H100, P, microbatch_owners=owners,
                        options=options), model


@pytest.mark.parametrize("name", list(CASES))
def test_durations_and_activations_equal_their_per_event_definitions(name):
    """Compute events sum their slab (the whole region when replicated); a transfer carries the output
    of the layer before its seam, forward or backward; every forward's saved activations and every
    shipped output live on the rank that runs the forward (the owner, on a Replicated region)."""
    result, model = predicted(name, owners=(3, 1, 0, 0, 2, 1, 3, 2))
    plan, table, t = result.plan, result.table, result.timeline
    bwd = table.backward_s(model)
    index = plan.index
    deltas = [[] for _ in range(plan.num_ranks)]
    for i, e in enumerate(plan.order.events):
        if isinstance(e, (Fwd, Bwd)):
            lo, hi = plan.slab(e.region, e.rank)
            per_layer = table.fwd_s if isinstance(e, Fwd) else bwd
            assert t.durations_s[i] == pytest.approx(per_layer[lo:hi, e.mb].sum(), rel=1e-12)
            if isinstance(e, Fwd) and Bwd(e.region, e.rank, e.mb) in index:
                size = table.saved_bytes[lo:hi, e.mb].sum()
                deltas[e.rank] += [(t.start_s[i], size), (t.finish_s[index[Bwd(e.region, e.rank, e.mb)]], -size)]
        elif isinstance(e, Coll):
            forward = e.src[0] < e.dst[0] or e.comm is Comm.SEND
            upstream = e.src if forward else e.dst
            n = table.boundary_bytes[plan.slab(*upstream)[1] - 1, e.mb]
            kind = {Comm.SEND: "p2p", Comm.RECV_GRAD: "p2p", Comm.GATHER: "gather", Comm.SCATTER: "scatter"}[e.comm]
            link = H100.link(kind, inter_node=False)
            expected = 0.0 if e.src[1] == e.dst[1] else link.alpha_s + link.beta_s_per_byte * n
            assert t.durations_s[i] == pytest.approx(expected, rel=1e-12)
            if forward:
                deltas[e.src[1]] += [(t.start_s[index[Fwd(e.src[0], e.src[1], e.mb)]], n), (t.finish_s[i], -n)]
    assert np.array_equal(t.finish_s, longest_path_reference(plan, t.durations_s))
    assert list(result.memory.activation_peak_bytes) == pytest.approx(walked_peaks(deltas, t.makespan_s), rel=1e-9)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_holds_each_replicated_region_whole(name):
    """Static memory: a rank's slabs plus every Replicated region (weights, gradients, optimizer state),
    whichever microbatches it owns; a rank that owns none still holds them."""
    result, model = predicted(name, owners=(0, 0, 1, 1, 2, 2, 0, 1))  # rank 3 owns nothing
    plan = result.plan
    static = estimate_static_bytes(plan, model, result.table, result.options)
    replicated = [p.layers for p in plan.replicated]
    for r in range(4):
        slabs = [plan.slab(j, r) for j in plan.sharded_regions()]
        alone = static_bytes_of(((*slabs, *replicated),), model, result.table, result.options)[0]
        assert static[r] == pytest.approx(alone, rel=1e-12)
        assert static[r] > static_bytes_of((tuple(slabs),), model, result.table, result.options)[0]
    assert result.memory.static_bytes == static


@pytest.mark.parametrize("name", list(CASES))
def test_owner_maps_retimed_equal_a_fresh_derive(name):
    base, model = predicted(name)
    slabs = base.candidate.slab_counts
    compiled = CompiledPlan(base.plan, model, H100, base.options)
    for owners in [(0,) * 8, (3, 2, 1, 0, 0, 1, 2, 3)]:
        schedule, cut = CASES[name]
        fresh = predict_plan(Cut(cut), parse_schedule(schedule), model, load_workload("balanced", num_microbatches=8,
                             seed=2), H100, 4, slab_counts=slabs, microbatch_owners=owners)
        retimed = compiled.with_owners(owners)
        assert retimed.plan == fresh.plan
        t = retimed.timeline(base.table)
        assert t.makespan_s == fresh.timeline.makespan_s
        assert retimed.memory(base.table, t).peak_bytes == pytest.approx(fresh.memory.peak_bytes, rel=1e-12)


def test_a_frozen_encoder_ships_no_gradient_into_a_transposed_source_and_the_head_still_trains():
    result, _ = predicted("encoder and head", frozen=("encoder", "projector"))
    events = result.plan.order.events
    assert not any(isinstance(e, Bwd) and e.region == 1 for e in events)
    assert any(isinstance(e, Bwd) and e.region == 3 for e in events)
    assert [j for j, _ in result.plan.collectives.reduces] == [2, 3]
