"""The Gantt marks a ZeRO plan's sharding actions where the timeline puts them: each stage's gather at
the start of its first event, its reduce-scatter and free at the end of its last backward."""

import pytest

from mpipe_tune.algebra import Candidate, Bwd, Fwd, ReduceGrad, Reshard, Unshard
from mpipe_tune.cost import predict, load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload
from mpipe_tune.report._gantt import draw_gantt, sharding_marks, zero_of

MODEL = load_model("tiny-vit-llm")
WORKLOAD = Workload(tuple(Microbatch(16, 64, (16,)) for _ in range(4)), "four")


def predicted(zero: str, dp: int = 2):
    stage, policy = {"1": (1, None), "2": (2, None), "3-keep": (3, False), "3-reshard": (3, True)}[zero]
    c = Candidate("1f1b,1f1b", (8,), pp=2, dp=dp, num_microbatches=4, zero_stage=stage, reshard_after_forward=policy)
    return predict(c, MODEL, WORKLOAD, load_profile("h100-sxm"))


@pytest.mark.parametrize("zero", ["2", "3-keep"])
def test_each_stage_is_marked_where_its_events_start_and_end(zero):
    p = predicted(zero)
    t = p.timeline
    marks = sharding_marks(p.plan, t.start_s, t.durations_s, *zero_of(p.options))
    events = p.plan.order.events
    for rank in range(p.plan.num_ranks):
        mine = [(kind, at) for r, kind, at in marks if r == rank]
        for region in (1, 2):  # two woven regions: two stages on each rank
            indices = [i for i in p.plan.order.nodes[rank] if isinstance(events[i], (Fwd, Bwd))
                       and events[i].region == region]
            first = min(t.start_s[i] for i in indices)
            last_backward = max(t.start_s[i] + t.durations_s[i] for i in indices if isinstance(events[i], Bwd))
            assert (Unshard, pytest.approx(first)) in mine
            assert (Reshard, pytest.approx(last_backward)) in mine
            assert ((ReduceGrad, pytest.approx(last_backward)) in mine) == (zero == "3-keep")
        assert sum(kind is Unshard for kind, _ in mine) == sum(kind is Reshard for kind, _ in mine) == 2


@pytest.mark.parametrize("zero,dp", [("1", 2), ("3-reshard", 2), ("3-keep", 1)])
def test_no_marks_without_actions_or_without_a_data_axis(zero, dp):
    p = predicted(zero, dp)
    assert sharding_marks(p.plan, p.timeline.start_s, p.timeline.durations_s, *zero_of(p.options)) == []


def test_a_keeping_plan_draws(tmp_path):
    pytest.importorskip("matplotlib")
    p = predicted("3-keep")
    draw_gantt(p.plan, p.timeline.start_s, p.timeline.durations_s, tmp_path / "g.png", zero=zero_of(p.options))
    assert (tmp_path / "g.png").stat().st_size > 0


def test_the_per_microbatch_actions_are_drawn_on_their_events_ranks(tmp_path):
    """Resharding after forward: every gather and reduce-scatter of every microbatch is a span on the rank of
    the event it is placed at, inside the step; a plan without per-microbatch actions has none."""
    pytest.importorskip("matplotlib")
    from mpipe_tune.report import action_spans

    p = predicted("3-reshard")
    t = p.timeline
    spans = action_spans(p.plan, t)
    events = p.plan.order.events
    forwards, backwards = (sum(isinstance(e, kind) for e in events) for kind in (Fwd, Bwd))
    assert len(spans) == len(t.actions_s) == forwards + 2 * backwards  # gathers before both, a reduce after B
    for (rank, start, seconds), at in zip(spans, t.actions_at):
        assert rank == events[at].rank and 0 <= start and start + seconds <= t.makespan_s * (1 + 1e-12)
    assert action_spans(predicted("1").plan, predicted("1").timeline) == []
    draw_gantt(p.plan, t.start_s, t.durations_s, tmp_path / "g.png", zero=zero_of(p.options), actions=spans)
    assert (tmp_path / "g.png").stat().st_size > 0
