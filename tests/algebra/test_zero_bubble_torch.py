"""Zero-bubble orders against torch's: derive's per-rank compute events of ``zb1p`` and ``zbv`` equal
the compute actions of ``torch.distributed.pipelining``'s ``ScheduleInterleavedZeroBubble`` and
``ScheduleZBVZeroBubble`` (torch 2.13) wherever torch builds a schedule.

torch's schedules are built from stub stages, as in test_interleaved_torch.py. Our ``Bwd`` of a split
skeleton is torch's ``I`` (input gradient), our ``Wgrad`` its ``W``; stage index = position in
``plan.stages`` (for ``zbv`` the V: rank r holds stages r and 2P-1-r, torch's ``style="v"``).

Where they differ: torch refuses an M that is not a multiple of ``max(1, M // P)`` rounds even for one
chunk, where the order does not depend on rounds; ``zb1p`` runs any M there (tested below to be
acyclic and torch's order with the rounds rule lifted is the same formula).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpipe_tune.algebra import Bwd, Cut, Fwd, Schedule, Skeleton, Wgrad, derive, is_interleavable
from mpipe_tune.errors import MpipeError

from conftest import make_model

pytest.importorskip("torch")
from torch.distributed.pipelining.schedules import (  # noqa: E402
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, _format_pipeline_order,
)

TORCH_CLASS = {Skeleton.ZB1P: ScheduleInterleavedZeroBubble, Skeleton.ZBV: ScheduleZBVZeroBubble}
OP = {Fwd: "F", Bwd: "I", Wgrad: "W"}


def torch_pipeline(skeleton: Skeleton, P: int, M: int, v: int) -> dict[int, list]:
    """Rank -> torch's actions (None for its idle steps)."""
    out = {}
    for rank in range(P):
        stages = [SimpleNamespace(num_stages=P * v, group_size=P, group_rank=rank, submod=None) for _ in range(v)]
        out[rank] = TORCH_CLASS[skeleton](stages, M).pipeline_order[rank]
    return out


def torch_order(skeleton: Skeleton, P: int, M: int, v: int) -> dict[int, list[str]]:
    """Rank -> torch's compute actions as text (``5I2``: stage 5, input gradient, microbatch 2)."""
    return {rank: [str(a) for a in actions if a is not None] for rank, actions in torch_pipeline(skeleton, P, M, v).items()}


def derived_order(skeleton: Skeleton, P: int, M: int, v: int, trainable=None) -> dict[int, list[str]]:
    """Rank -> derive's Fwd/Bwd/Wgrad events in torch's action text."""
    model = make_model(["llm"] * (P * v), trainable=trainable)
    plan = derive(Cut(tuple(P * j for j in range(1, v))), Schedule((skeleton,) * v), model, P, M)
    stage_index = {stage: i for i, stage in enumerate(plan.stages)}
    return {rank: [f"{stage_index[(e.region, e.rank)]}{OP[type(e)]}{e.mb}" for e in plan.nodes(rank)
                   if type(e) in OP] for rank in range(P)}


def grid(skeleton: Skeleton, P: int, M: int, v: int) -> str:
    return _format_pipeline_order(torch_pipeline(skeleton, P, M, v))


ZB1P_CASES = [(P, M, v) for v in (1, 2) for P in (1, 2, 3, 4) for M in range(1, 3 * P + 2) if is_interleavable(P, M)]
ZBV_CASES = [(P, M) for P in (1, 2, 3, 4) for M in range(1, 3 * P + 2)]


def test_the_cases_cover_few_and_many_microbatches():
    assert (4, 3, 1) in ZB1P_CASES and (4, 8, 2) in ZB1P_CASES and (3, 5, 2) in ZB1P_CASES
    assert (4, 3) in ZBV_CASES and (4, 7) in ZBV_CASES and (4, 12) in ZBV_CASES  # M < 2P-1, = 2P-1, > 2P-1


@pytest.mark.parametrize("P,M,v", ZB1P_CASES, ids=str)
def test_zb1p_order_equals_torchs_interleaved_zero_bubble(P, M, v):
    ours, theirs = derived_order(Skeleton.ZB1P, P, M, v), torch_order(Skeleton.ZB1P, P, M, v)
    for rank in range(P):
        assert ours[rank] == theirs[rank], f"rank {rank} differs from torch's order:\n{grid(Skeleton.ZB1P, P, M, v)}"


@pytest.mark.parametrize("P,M", ZBV_CASES, ids=str)
def test_zbv_order_equals_torchs_zbv_zero_bubble(P, M):
    ours, theirs = derived_order(Skeleton.ZBV, P, M, 2), torch_order(Skeleton.ZBV, P, M, 2)
    for rank in range(P):
        assert ours[rank] == theirs[rank], f"rank {rank} differs from torch's order:\n{grid(Skeleton.ZBV, P, M, 2)}"


@pytest.mark.parametrize("P,M", [(2, 5), (3, 7), (4, 9), (4, 11)])
def test_one_chunk_zb1p_runs_the_m_torch_refuses(P, M):
    """torch applies its rounds rule to one chunk too; the one-chunk order does not use rounds."""
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_order(Skeleton.ZB1P, P, M, 1)
    ours = derived_order(Skeleton.ZB1P, P, M, 1)
    for rank in range(P):
        assert [a for a in ours[rank] if "I" in a] == [f"{rank}I{m}" for m in range(M)]
        assert [a for a in ours[rank] if "W" in a] == [f"{rank}W{m}" for m in range(M)]


def test_split_backwards_only_on_the_zero_bubble_skeletons():
    for skeleton in Skeleton:
        assert skeleton.splits_backward == (skeleton in (Skeleton.ZB1P, Skeleton.ZBV))
    assert not any("W" in a for rank in derived_order(Skeleton.ONE_F_ONE_B, 2, 4, 1).values() for a in rank)


def test_frozen_stages_have_no_weight_gradient_and_keep_their_input_gradient():
    """A frozen stage after a trainable one still runs its input gradient (its Bwd, which it sends
    upstream) but no Wgrad; a frozen stage before every trainable one runs neither."""
    trainable = [False, True, False, False, True, True, False, False]  # one layer per stage, stage i = layer i
    plan = derive(Cut((4,)), Schedule((Skeleton.ZBV,) * 2), make_model(["llm"] * 8, trainable=trainable), 4, 7)
    assert plan.stages == ((1, 0), (1, 1), (1, 2), (1, 3), (2, 3), (2, 2), (2, 1), (2, 0))
    for i, (region, rank) in enumerate(plan.stages):
        mine = [e for e in plan.nodes(rank) if isinstance(e, (Bwd, Wgrad)) and e.region == region]
        assert [e.mb for e in mine if isinstance(e, Wgrad)] == (list(range(7)) if trainable[i] else [])
        assert [e.mb for e in mine if isinstance(e, Bwd)] == (list(range(7)) if i >= 1 else [])


def test_zbv_needs_exactly_two_regions():
    model = make_model(["llm"] * 12)
    with pytest.raises(MpipeError, match=r"zbv runs exactly two chunks in a V; give two zbv regions"):
        derive(Cut((4, 8)), Schedule((Skeleton.ZBV,) * 3), model, 2, 4)
    with pytest.raises(MpipeError, match=r"has 1 zbv region\(s\)"):
        derive(Cut(()), Schedule((Skeleton.ZBV,)), model, 2, 4)
