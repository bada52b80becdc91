"""Encoder backward placements: cooldown (unchanged), earliest (unit-time steps), explicit slots.

Each placement keeps every event once on its rank, puts each encoder backward on its owner after
its gradient, and stays deadlock-free (derive asserts a topological order exists).
"""

from __future__ import annotations

import random

import pytest

from conftest import make_model
from mpipe_tune.algebra import (
    Cut, Owners, derive, parse_schedule, Candidate, EARLIEST, EncoderBackward, plan_steps, Bwd,
)
from mpipe_tune.errors import MpipeError

MODEL = make_model(["encoder"] * 2 + ["llm"] * 8)


def _derive(schedule="transpose,1f1b", cut=(2,), P=2, M=4, owners=None, placement=None, model=MODEL):
    return derive(Cut(cut), parse_schedule(schedule), model, P, M, Owners(microbatch=owners), placement)


def _texts(plan, rank):
    return [str(e) for e in plan.nodes(rank)]


def test_the_cooldown_is_derive_s_order_unchanged():
    plain = _derive(P=4, M=8)
    cooldown = _derive(P=4, M=8, placement=EncoderBackward())
    counts = [sum(1 for e in plain.nodes(r) if e.tag in "FB" and e.region == 2) for r in range(4)]
    explicit = _derive(P=4, M=8, placement=EncoderBackward(slots=tuple(counts[m % 4] for m in range(8))))
    assert cooldown.order == plain.order and explicit.order == plain.order


def test_earliest_moves_rank_0_s_first_encoder_backward_into_its_drain_gap():
    """P=2, M=4, round-robin owners. In unit steps rank 0 runs F0 F1 . B0 F2 B1 F3 B2 . B3: its
    gradient of microbatch 0 arrives at step 4, and the first idle step after it is the one before
    B3 (rank 0 waits for rank 1's B3); microbatch 2's arrives at 8, after the last gap, so it stays in
    the cooldown, as do rank 1's (it is never idle after its first forward)."""
    cooldown, earliest = _derive(), _derive(placement=EncoderBackward(EARLIEST))
    want = _texts(cooldown, 0)
    want.remove("B1.0#0")
    want.insert(want.index("B2.0#3"), "B1.0#0")
    assert _texts(earliest, 0) == want
    assert _texts(earliest, 1) == _texts(cooldown, 1)


CASES = [("transpose,1f1b", (2,), P, M) for P in (2, 3, 4) for M in (1, 3, 4, 8)] + [
    ("transpose,gpipe", (2,), 3, 5), ("transpose,1f1b,1f1b", (2, 6), 2, 4), ("transpose,1f1b,1f1b", (2, 6), 3, 6)]


@pytest.mark.parametrize("schedule,cut,P,M", CASES)
def test_earliest_runs_every_event_once_each_encoder_backward_on_its_owner_after_its_gradient(schedule, cut, P, M):
    owners = tuple(random.Random(P * 100 + M).randrange(P) for _ in range(M))
    cooldown = _derive(schedule, cut, P, M, owners)
    earliest = _derive(schedule, cut, P, M, owners, EncoderBackward(EARLIEST))
    assert earliest.order.events == cooldown.order.events
    for r in range(P):
        assert sorted(earliest.order.nodes[r]) == sorted(cooldown.order.nodes[r])
        assert len(set(earliest.order.nodes[r])) == len(earliest.order.nodes[r])
    topo = {e: k for k, e in enumerate(earliest.order.topo)}
    assert len(topo) == len(earliest.order.events), "deadlock-free: a topological order exists"
    index = earliest.index
    for m, owner in enumerate(owners):
        backward = index[Bwd(1, owner, m)]
        assert backward in earliest.order.nodes[owner]
        assert topo[index[Bwd(2, 0, m)]] < topo[backward]
    # every rank's non-encoder-backward events keep their order
    for r in range(P):
        strip = [i for i in earliest.order.nodes[r] if not (earliest.order.events[i].tag == "B"
                                                            and earliest.order.events[i].region == 1)]
        assert strip == [i for i in cooldown.order.nodes[r] if i in set(strip)]


def test_explicit_slots_place_each_encoder_backward_and_refuse_one_before_its_gradient():
    # Microbatch 0's gradient needs rank 0's B2.0#0, its 3rd backbone event (F0 F1 B0): slot 3 is legal, 2 is not.
    plan = _derive(placement=EncoderBackward(slots=(3, 8, 8, 8)))
    assert _texts(plan, 0)[_texts(plan, 0).index("B2.0#0") + 1] == "B1.0#0"
    with pytest.raises(MpipeError, match=r"slot 2 of microbatch 0 on rank 0 comes before its gradient can arrive"
                                         r".*use a slot of at least 3$"):
        _derive(placement=EncoderBackward(slots=(2, 8, 8, 8)))
    with pytest.raises(MpipeError, match=r"slot 9 of microbatch 1 is outside 0..8"):
        _derive(placement=EncoderBackward(slots=(8, 9, 8, 8)))
    with pytest.raises(MpipeError, match=r"list 3 entries, but M=4"):
        _derive(placement=EncoderBackward(slots=(8, 8, 8)))


def test_a_frozen_encoder_has_no_encoder_backward_to_place():
    frozen = MODEL.with_frozen(("encoder",))
    assert _derive(model=frozen, placement=EncoderBackward(EARLIEST)).order == _derive(model=frozen).order
    with pytest.raises(MpipeError, match="no encoder backward"):
        _derive(model=frozen, placement=EncoderBackward(slots=(8, 8, 8, 8)))


def test_optimised_without_slots_and_unknown_placements_are_one_line_errors():
    with pytest.raises(MpipeError, match="optimised encoder backward placement chooses its slots with the cost model"):
        _derive(placement=EncoderBackward("optimised"))
    with pytest.raises(MpipeError, match="'soonest' is not a placement; use one of cooldown, earliest, optimised"):
        _derive(placement=EncoderBackward("soonest"))
    c = Candidate("1f1b", (), 2, 1, 1, 4, encoder_backward="earliest")
    with pytest.raises(MpipeError, match="schedule <1f1b> has no transpose region"):
        c.validate()


def test_the_candidate_stores_its_placement_and_old_records_load_as_the_cooldown():
    c = Candidate("transpose,1f1b", (2,), 2, 1, 1, 4, owner_policy="round-robin", encoder_backward="optimised",
                  encoder_backward_slots=(3, 8, 8, 8))
    assert Candidate.from_dict(c.to_dict()) == c
    assert "encoder backward optimised" in str(c)
    old = c.to_dict()
    del old["encoder_backward"], old["encoder_backward_slots"]
    assert Candidate.from_dict(old).encoder_backward == "cooldown"
    assert Candidate.from_dict(old).encoder_backward_slots is None
    assert c.derive(MODEL).order == _derive(placement=EncoderBackward(slots=(3, 8, 8, 8))).order


@pytest.mark.parametrize("schedule,cut,P,M", CASES)
def test_any_legal_slots_together_give_a_deadlock_free_order(schedule, cut, P, M):
    """Slots at or above each microbatch's smallest legal slot, drawn at random, derive (derive asserts
    a topological order exists); one below it is refused."""
    rng = random.Random(P * 7 + M)
    owners = tuple(rng.randrange(P) for _ in range(M))
    cooldown = _derive(schedule, cut, P, M, owners)
    steps = plan_steps(cooldown)
    low, high = steps.min_slots(owners), steps.cooldown_slots(owners)
    assert all(a <= b for a, b in zip(low, high))
    for _ in range(3):
        slots = tuple(rng.randint(a, b) for a, b in zip(low, high))
        plan = _derive(schedule, cut, P, M, owners, EncoderBackward(slots=slots))
        assert len(plan.order.topo) == len(plan.order.events)
    m = next((m for m in range(M) if low[m] > 0), None)
    if m is not None:
        with pytest.raises(MpipeError, match=f"microbatch {m} on rank {owners[m]} comes before its gradient"):
            _derive(schedule, cut, P, M, owners, EncoderBackward(slots=tuple(
                low[k] - (k == m) for k in range(M))))
