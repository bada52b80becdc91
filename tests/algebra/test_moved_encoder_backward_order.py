"""Encoder backwards moved off their owners (full recomputation): each runs once, on the rank its
placement names, fed by a Scatter that reaches that rank, after its gradient, in a deadlock-free order;
what cannot hold is refused in one line."""

from __future__ import annotations

import random

import pytest

from conftest import make_model
from mpipe_tune.algebra import (
    Cut, Owners, derive, parse_schedule, Candidate, EncoderBackward, plan_steps, Bwd, Coll, Comm,
)
from mpipe_tune.errors import MpipeError, NotSupportedError

MODEL = make_model(["encoder"] * 2 + ["llm"] * 8)


def _derive(schedule="transpose,1f1b", cut=(2,), P=2, M=4, owners=None, placement=None, model=MODEL):
    return derive(Cut(cut), parse_schedule(schedule), model, P, M, Owners(microbatch=owners), placement)


CASES = [("transpose,1f1b", (2,), P, M) for P in (2, 3, 4) for M in (1, 3, 8)] + [
    ("transpose,gpipe", (2,), 3, 5), ("transpose,1f1b,1f1b", (2, 6), 2, 4), ("transpose,zb1p", (2,), 3, 6)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule,cut,P,M", CASES)
def test_a_moved_backward_runs_once_on_its_rank_fed_by_a_scatter_to_it_in_a_deadlock_free_order(schedule, cut, P, M,
                                                                                               seed):
    rng = random.Random(seed * 1000 + P * 100 + M)
    owners = tuple(rng.randrange(P) for _ in range(M))
    cooldown = _derive(schedule, cut, P, M, owners)
    steps = plan_steps(cooldown)
    ranks = tuple(rng.randrange(P) for _ in range(M))
    lowest = steps.min_slots(ranks)
    slots = tuple(rng.randint(lowest[m], len(steps.compute[r])) for m, r in enumerate(ranks))
    moved = _derive(schedule, cut, P, M, owners, EncoderBackward("optimised", slots, ranks))
    # the same events, every one once on one rank (the moved backwards on their new ranks)
    assert len(moved.order.events) == len(cooldown.order.events)
    listed = [i for nodes in moved.order.nodes for i in nodes]
    assert sorted(listed) == sorted(i for nodes in cooldown.order.nodes for i in nodes)
    own = [i for i in listed if moved.order.events[i].tag in "FBWL"]  # the reduces and the barrier are shared
    assert len(set(own)) == len(own)
    topo = {e: k for k, e in enumerate(moved.order.topo)}
    assert len(topo) == len(moved.order.events), "deadlock-free: a topological order exists"
    for m, r in enumerate(ranks):
        backward = moved.index[Bwd(1, r, m)]
        assert backward in moved.order.nodes[r]
        before = moved.order.nodes[r][:moved.order.nodes[r].index(backward)]
        assert sum(1 for i in before if moved.order.events[i].tag in "FB"
                   and moved.order.events[i].region != 1) == slots[m], "its slot counts its rank's backbone events"
        (scatter,) = [e for e in moved.order.events if isinstance(e, Coll) and e.comm is Comm.SCATTER and e.mb == m]
        assert scatter.dst == (1, r) and scatter.src == moved.stages[0]
        assert topo[moved.index[scatter]] < topo[backward]
    # every rank's other events keep their order
    for r in range(P):
        rest = [i for i in moved.order.nodes[r] if not (moved.order.events[i].tag == "B"
                                                        and moved.order.events[i].region == 1)]
        assert rest == [i for i in cooldown.order.nodes[r] if i in set(rest)]


def test_a_slot_before_the_gradient_on_the_new_rank_is_refused_naming_that_rank():
    # Microbatch 0's gradient leaves rank 0 after B2.0#0; on rank 1 it needs B2.1#0 (F2.1#0 B2.1#0): slot 2.
    ranks = (1, 1, 0, 1)
    assert plan_steps(_derive()).min_slots(ranks)[0] == 2
    with pytest.raises(MpipeError, match=r"slot 1 of microbatch 0 on rank 1 comes before its gradient can arrive"):
        _derive(placement=EncoderBackward("optimised", (1, 8, 8, 8), ranks))
    with pytest.raises(MpipeError, match="ranks are given without slots"):
        _derive(placement=EncoderBackward("optimised", None, ranks))
    with pytest.raises(MpipeError, match="ranks list 3 entries, but M=4"):
        _derive(placement=EncoderBackward("optimised", (8, 8, 8, 8), (1, 1, 0)))
    with pytest.raises(MpipeError, match="rank 2 of microbatch 1 is not a pipeline rank 0..1"):
        _derive(placement=EncoderBackward("optimised", (8, 8, 8, 8), (1, 2, 0, 1)))


def test_a_move_beside_an_interior_transpose_is_refused_as_other_placements_are():
    model = make_model(["encoder"] * 2 + ["llm"] * 4 + ["projector"] * 2 + ["llm"] * 4)
    with pytest.raises(NotSupportedError, match="beside an interior or sink transpose is not supported yet"):
        _derive("transpose,1f1b,transpose,1f1b", (2, 6, 8), 2, 4, model=model,
                placement=EncoderBackward("optimised", (8, 8, 8, 8), (1, 0, 1, 0)))


@pytest.mark.parametrize("recompute", [False, "selective"])
def test_the_candidate_refuses_moved_ranks_without_full_recomputation_in_one_line(recompute):
    c = Candidate("transpose,1f1b", (2,), 2, 1, 1, 4, owner_policy="round-robin", recompute=recompute,
                  encoder_backward="optimised", encoder_backward_slots=(8, 8, 8, 8), encoder_backward_ranks=(1, 0, 1, 0))
    assert not c.moves_encoder_backward
    with pytest.raises(MpipeError, match=r"need full recomputation, but the recomputation is '(none|selective)'"
                                         r"; recompute fully or drop the ranks$"):
        c.validate()


def test_the_candidate_stores_its_ranks_and_old_records_load_as_the_owners():
    c = Candidate("transpose,1f1b", (2,), 2, 1, 1, 4, owner_policy="round-robin", owner_map=(0, 1, 0, 1),
                  recompute=True, encoder_backward="optimised", encoder_backward_slots=(2, 8, 8, 8),
                  encoder_backward_ranks=(1, 1, 0, 1))
    c.validate()
    assert c.moves_encoder_backward and Candidate.from_dict(c.to_dict()) == c
    assert "encoder backward optimised (1 on other ranks)" in str(c)
    old = c.to_dict()
    del old["encoder_backward_ranks"]
    assert Candidate.from_dict(old).encoder_backward_ranks is None
    plan = c.derive(MODEL)
    assert plan.index[Bwd(1, 1, 0)] in plan.order.nodes[1]
    assert plan.order == _derive(placement=EncoderBackward("optimised", (2, 8, 8, 8), (1, 1, 0, 1))).order
