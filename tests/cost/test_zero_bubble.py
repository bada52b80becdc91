"""The zero-bubble skeletons in the cost model: split durations, closed forms on equal F/B/W times,
live memory until the weight gradients, and the compiled plan against its references."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.algebra import Bwd, Coll, Comm, Cut, ExplicitCost, Fwd, Layer, Model, StepBarrier, Wgrad, parse_schedule
from mpipe_tune.cost import CompiledPlan, CostOptions, load_profile, longest_path_reference
from mpipe_tune.inputs import load_workload, load_model

from conftest import make_model, predict_plan, uniform_workload, walked_peaks


def _last_events(plan) -> set[int]:
    """Each rank's last event before the barrier: where the optimizer update is charged."""
    events = plan.order.events
    return {next(i for i in reversed(nodes) if not isinstance(events[i], StepBarrier)) for nodes in plan.order.nodes}


@pytest.mark.parametrize("frozen", [(), ("encoder",)], ids=["trained", "frozen-encoder"])
def test_input_and_weight_gradients_add_up_to_the_unsplit_backward(frozen):
    """On a real model (h100-sxm): every zb1p stage's Bwd + Wgrad is the 1f1b Bwd of the same stage and
    microbatch, the Wgrad its trainable layers' weight-gradient seconds; a frozen stage has no Wgrad."""
    model = load_model("tiny-vit-llm")
    model = model.with_frozen(frozen) if frozen else model
    profile, workload = load_profile("h100-sxm"), load_workload("balanced", num_microbatches=4, seed=2)
    one = predict_plan(Cut(()), parse_schedule("1f1b"), model, workload, profile, 2)
    zb = predict_plan(Cut(()), parse_schedule("zb1p"), model, workload, profile, 2)
    assert one.plan.placement == zb.plan.placement
    unsplit = {e: d for e, d in zip(one.plan.order.events, one.timeline.durations_s) if isinstance(e, Bwd)}
    split = dict(zip(zb.plan.order.events, zb.timeline.durations_s))
    charged = {zb.plan.order.events[i] for i in _last_events(zb.plan)} | {
        one.plan.order.events[i] for i in _last_events(one.plan)}
    trainable = np.array(model.trainable_bits())
    weights = zb.table.wgrad_s * trainable[:, None]
    checked = 0
    for event, seconds in unsplit.items():
        w = Wgrad(*event[:3])
        if event in charged or w in charged:
            continue
        start, stop = zb.plan.slab(event.region, event.rank)
        assert (w in split) == bool(trainable[start:stop].any())
        assert split[event] + split.get(w, 0.0) == pytest.approx(seconds, rel=1e-12)
        assert split.get(w, 0.0) == pytest.approx(weights[start:stop, event.mb].sum(), rel=1e-12)
        checked += 1
    assert checked >= 4


def _equal_parts(schedule: str, P: int, M: int):
    """One explicit-cost layer per stage, forward = input gradient = weight gradient = 1 s, free links;
    in front of them a trainable layer that costs nothing, so that the first stage's layer computes its
    input gradient too (the model's first layer has none to compute, Lemma 1)."""
    v = len(schedule.split(","))
    model = Model("equal-parts", (Layer("input", "llm", True, ExplicitCost(0.0, 0.0)),) + tuple(
        Layer(f"layer{i}", "llm", True, ExplicitCost(1.0, 2.0)) for i in range(P * v)))
    cut = Cut(tuple(1 + P * j for j in range(1, v)))
    slabs = ((2,) + (1,) * (P - 1),) + ((1,) * P,) * (v - 1)
    return predict_plan(cut, parse_schedule(schedule), model, uniform_workload(M), load_profile("ideal"), P,
                        slab_counts=slabs)


@pytest.mark.parametrize("P,M", [(2, 2), (2, 6), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zb1p_closed_form_on_equal_parts(P, M):
    """ZB-H1: ``3M + (P-1)(tf + tb - tw)`` with tf = tb = tw = 1 s, against 1F1B's ``(M+P-1)(tf+tb+tw)``:
    the deferred weight gradients fill all but ``(P-1)`` seconds of 1F1B's ``3(P-1)`` bubble."""
    assert _equal_parts("1f1b", P, M).timeline.makespan_s == pytest.approx(3 * (M + P - 1))
    zb = _equal_parts("zb1p", P, M).timeline
    assert zb.makespan_s == pytest.approx(3 * M + (P - 1))
    assert zb.bubble_s == pytest.approx([P - 1] * P)  # every rank idles P-1 seconds, a third of 1F1B's


@pytest.mark.parametrize("P,M", [(2, 3), (2, 8), (4, 7), (4, 16), (8, 15), (8, 32)])
def test_zbv_closed_form_on_equal_parts(P, M):
    """ZB-V with ``M >= 2P-1`` on equal chunk parts (1 s each): every rank runs ``6M`` seconds of work,
    and the step is ``6M + (P-1)``, the lower bound set by rank P-1, whose first forward can only start
    after the ``P-1`` forwards before it: no rank idles more than that offset (the authors count ZB-V's
    bubble rate as 0; interleaved 1F1B in two chunks idles ``3(P-1)`` of these seconds)."""
    zb = _equal_parts("zbv,zbv", P, M).timeline
    assert zb.makespan_s == pytest.approx(6 * M + (P - 1))
    assert max(zb.bubble_s) == pytest.approx(P - 1)
    assert _equal_parts("1f1b,1f1b", P, M).timeline.makespan_s == pytest.approx(6 * M + 3 * (P - 1))


def test_zb1p_keeps_1f1b_activations_and_adds_the_kept_gradients():
    """Memory in microbatch units (every stage saves 1 byte per microbatch, keeps 0.25 from its input
    gradient to its weight gradient): 1F1B's rank r holds ``P - r`` microbatches at its peak; zb1p's
    rank r holds ``P`` (its ``P - r`` in flight and the ``r`` whose weight gradients it defers), the
    first rank's 1F1B peak on every rank, plus the kept gradients of its ``r + 1`` pending weight
    gradients."""
    P, M = 4, 8
    results = {}
    for schedule in ("1f1b", "zb1p"):
        prediction = _equal_parts(schedule, P, M)
        unit = np.ones_like(prediction.table.fwd_s)
        unit[0] = 0.0  # the costless input layer keeps nothing
        table = replace(prediction.table, saved_bytes=unit, wgrad_kept_bytes=0.25 * unit)
        compiled = CompiledPlan(prediction.plan, make_model(["llm"] * (P + 1)), load_profile("ideal"), CostOptions())
        results[schedule] = compiled.memory(table, prediction.timeline).activation_peak_bytes
    assert results["1f1b"] == pytest.approx([P - r for r in range(P)])
    assert results["zb1p"] == pytest.approx([P + 0.25 * (r + 1) for r in range(P)])


@pytest.mark.parametrize("schedule,cut,P,M", [
    ("zb1p", (), 4, 8), ("zb1p,zb1p", (6,), 3, 6), ("zbv,zbv", (6,), 3, 7), ("transpose,zbv,zbv", (2, 8), 3, 5),
    ("transpose,zb1p", (2,), 4, 6),
])
def test_compiled_timeline_equals_the_longest_path(schedule, cut, P, M):
    model = make_model(["encoder"] * 2 + ["llm"] * 10, trainable=[False] * 2 + [True] * 10)
    profile = load_profile("h100-sxm")
    workload = load_workload("balanced", num_microbatches=M, seed=5)
    prediction = predict_plan(Cut(cut), parse_schedule(schedule), model, workload, profile, P)
    durations = prediction.timeline.durations_s
    assert np.allclose(prediction.timeline.finish_s, longest_path_reference(prediction.plan, durations), rtol=1e-12)
    assert any(isinstance(e, Wgrad) for e in prediction.plan.order.events)
    forwards = [e for e in prediction.plan.order.events if isinstance(e, Fwd)]
    assert len(forwards) == M * (len(prediction.plan.stages) + (1 if "transpose" in schedule else 0))


def test_memory_equals_a_walk_over_allocations_and_frees():
    """On a real model (frozen ViT, selective recomputation, h100-sxm, transpose,zbv,zbv): a stage's saved activations live
    from its forward's start to its Wgrad's finish (its Bwd's, where a frozen stage has no Wgrad), what
    its Bwd leaves for the Wgrad from the Bwd's start to the Wgrad's finish, a stage's output until
    the transfer that ships it."""
    model = load_model("tiny-vit-llm").with_frozen(("encoder",))
    profile = load_profile("h100-sxm")
    workload = load_workload("balanced", num_microbatches=7, seed=4)
    result = predict_plan(Cut((model.backbone_start, 7)), parse_schedule("transpose,zbv,zbv"), model, workload,
                          profile, 2, options=CostOptions(recompute="selective"))
    plan, table, t = result.plan, result.table, result.timeline
    index = plan.index
    deltas = [[] for _ in range(plan.num_ranks)]
    assert table.wgrad_kept_bytes.sum() > 0
    for i, e in enumerate(plan.order.events):
        if isinstance(e, Fwd) and Bwd(e.region, e.rank, e.mb) in index:
            lo, hi = plan.slab(e.region, e.rank)
            last = index.get(Wgrad(e.region, e.rank, e.mb), index[Bwd(e.region, e.rank, e.mb)])
            size = table.saved_bytes[lo:hi, e.mb].sum()
            deltas[e.rank] += [(t.start_s[i], size), (t.finish_s[last], -size)]
        elif isinstance(e, Wgrad):
            lo, hi = plan.slab(e.region, e.rank)
            size = table.wgrad_kept_bytes[lo:hi, e.mb].sum()
            deltas[e.rank] += [(t.start_s[index[Bwd(*e[:3])]], size), (t.finish_s[i], -size)]
        elif isinstance(e, Coll) and e.comm in (Comm.SEND, Comm.GATHER):
            size = table.boundary_bytes[plan.slab(*e.src)[1] - 1, e.mb]
            deltas[e.src[1]] += [(t.start_s[index[Fwd(e.src[0], e.src[1], e.mb)]], size), (t.finish_s[i], -size)]
    assert list(result.memory.activation_peak_bytes) == pytest.approx(walked_peaks(deltas, t.makespan_s), rel=1e-9)
