import pytest

from mpipe_tune.algebra import (
    Bwd, Coll, Comm, DpReduce, Fwd, Group, Loss, StepBarrier, Wgrad, derive, parse_event, parse_schedule,
)
from mpipe_tune.algebra import Cut
from mpipe_tune.errors import MpipeError

from conftest import make_model


@pytest.mark.parametrize("event", [
    Fwd(2, 0, 3), Bwd(1, 7, 12), Wgrad(2, 1, 4), Coll(Comm.GATHER, (1, 3), (2, 0), 5), Coll(Comm.RECV_GRAD, (2, 1), (2, 0), 0),
    Loss(4), DpReduce(1, Group.REPLICA), DpReduce(2, Group.DATA, 3), StepBarrier(),
])
def test_text_form_round_trips(event):
    assert parse_event(str(event)) == event


@pytest.mark.parametrize("schedule,cut", [("transpose,1f1b", (2,)), ("transpose,zbv,zbv", (2, 6))])
def test_every_derived_event_round_trips(schedule, cut):
    model = make_model(["encoder"] * 2 + ["llm"] * 8)
    plan = derive(Cut(cut), parse_schedule(schedule), model, 4, 8)
    assert all(parse_event(str(e)) == e for e in plan.order.events)
    assert any(isinstance(e, Wgrad) for e in plan.order.events) == ("zbv" in schedule)


def test_bad_text_is_a_user_error():
    with pytest.raises(MpipeError, match="not an event"):
        parse_event("X1.0#0")
