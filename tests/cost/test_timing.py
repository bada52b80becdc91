import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import Cut, Owners, Schedule, Skeleton, parse_schedule
from mpipe_tune.cost import load_profile
from mpipe_tune.cost._timing import CompiledOrder, longest_path_reference
from mpipe_tune.inputs import Microbatch, Workload

from conftest import make_model, uniform_workload, predict_plan

IDEAL = load_profile("ideal")


def uniform(P, M, layers_per_stage, v=1, skeleton="1f1b", fwd=1.0, bwd=2.0):
    """Uniform stages behind a free input layer (like an embedding), which has no input gradient to
    compute; every other layer pays its full backward, so every stage costs the same."""
    from mpipe_tune.algebra import ExplicitCost, Layer, Model

    k = layers_per_stage
    body = make_model(["llm"] * (P * v * k), fwd=fwd, bwd=bwd).layers
    model = Model("uniform", (Layer("embed", "llm", True, ExplicitCost(0.0, 0.0)),) + body)
    cut = Cut(tuple(1 + P * k * j for j in range(1, v)))
    sched = Schedule((Skeleton(skeleton),) * v)
    slabs = ((k + 1,) + (k,) * (P - 1),) + ((k,) * P,) * (v - 1)
    return predict_plan(cut, sched, model, uniform_workload(M), IDEAL, P, slab_counts=slabs)


@pytest.mark.parametrize("skeleton", ["1f1b", "gpipe"])
@pytest.mark.parametrize("P,M", [(1, 1), (1, 5), (2, 1), (2, 3), (4, 4), (4, 9), (8, 16), (3, 2)])
def test_1f1b_and_gpipe_closed_form(skeleton, P, M):
    k = 2
    tf, tb = k * 1.0, k * 2.0
    result = uniform(P, M, k, skeleton=skeleton)
    assert result.timeline.makespan_s == pytest.approx((M + P - 1) * (tf + tb), rel=1e-12)


@pytest.mark.parametrize("P,M,v", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 4, 3), (4, 12, 3), (3, 6, 2), (8, 16, 2),
                                   # M >= P not a multiple of P: torch's rounds of M // max(1, M // P)
                                   (2, 3, 2), (4, 6, 2), (4, 7, 3), (4, 10, 3), (3, 4, 2)])
def test_interleaved_closed_form(P, M, v):
    k = 1
    tf, tb = v * k * 1.0, v * k * 2.0  # one rank's forward and backward of one microbatch over its v chunks
    result = uniform(P, M, k, v=v)
    assert result.timeline.makespan_s == pytest.approx((M + (P - 1) / v) * (tf + tb), rel=1e-12)


def test_makespan_bounds_busy_time_and_reports_bubbles():
    result = uniform(4, 8, 2)
    t = result.timeline
    assert all(t.makespan_s >= b for b in t.busy_s)
    assert t.bubble_s == tuple(t.makespan_s - b for b in t.busy_s)
    # 1F1B: every rank is busy M*(tf+tb) and idle (P-1)*(tf+tb).
    assert t.bubble_s == pytest.approx((3 * 6.0,) * 4)


def test_transpose_spill_is_encoder_work_beyond_warmup_slack():
    # 1 encoder layer (2 s per image token), 4 llm layers at P=4 (1 s fwd per stage), M = 4, round-robin.
    model = make_model(["encoder"] + ["llm"] * 4, fwd=1.0, bwd=2.0)
    workload = Workload(tuple(Microbatch(image_tokens=2, text_tokens=1) for _ in range(4)))
    result = predict_plan(Cut((1,)), parse_schedule("transpose,1f1b"), model, workload, IDEAL, 4)
    t = result.timeline
    assert t.encoder_s == (2.0, 2.0, 2.0, 2.0)
    assert t.warmup_slack_s == (0.0, 1.0, 2.0, 3.0)
    assert t.spill_s == (2.0, 1.0, 0.0, 0.0)


@st.composite
def random_plans(draw):
    P = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2))
    skeleton = draw(st.sampled_from(["1f1b", "gpipe"]))
    M = P * draw(st.integers(1, 3)) if (v > 1 and skeleton == "1f1b") else draw(st.integers(1, 6))
    enc = draw(st.integers(0, 2))
    per = [draw(st.integers(P, P + 2)) for _ in range(v)]
    blocks = ["encoder"] * enc + ["llm"] * sum(per)
    trainable = draw(st.lists(st.booleans(), min_size=len(blocks), max_size=len(blocks)).filter(any))
    model = make_model(blocks, trainable=trainable)
    bounds = ([enc] if enc else []) + [enc + sum(per[:i]) for i in range(1, v)]
    sched = Schedule(((Skeleton.TRANSPOSE,) if enc else ()) + (Skeleton(skeleton),) * v)
    workload = Workload(tuple(
        Microbatch(draw(st.integers(0, 50)), draw(st.integers(1, 50))) for _ in range(M)))
    owners = tuple(draw(st.integers(0, P - 1)) for _ in range(M))
    profile = load_profile(draw(st.sampled_from(["ideal", "h100-sxm", "cpu-generic"])))
    return predict_plan(Cut(tuple(bounds)), sched, model, workload, profile, P, microbatch_owners=owners)


@given(random_plans())
def test_compiled_evaluator_equals_networkx_reference(result):
    durations = result.timeline.durations_s
    compiled = CompiledOrder(result.plan).finish_times(durations)
    reference = longest_path_reference(result.plan, durations)
    assert np.array_equal(compiled, reference)


@given(random_plans())
def test_makespan_is_at_least_busy_time_and_one_microbatch_critical_path(result):
    t = result.timeline
    assert all(t.makespan_s >= b - 1e-12 for b in t.busy_s)
    plan = result.plan
    from mpipe_tune.algebra import Bwd, Fwd
    for m in range(plan.num_microbatches):
        chain = sum(t.durations_s[i] for i, e in enumerate(plan.order.events)
                    if isinstance(e, (Fwd, Bwd)) and e.mb == m)
        assert t.makespan_s >= chain - 1e-9
