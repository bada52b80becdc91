"""Interleaved orders against torch's: derive's per-rank Fwd/Bwd events equal the compute actions of
``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B`` for every M torch accepts.

torch's schedule is built from stub stages (no process group): its ``__init__`` computes
``pipeline_order`` (rank -> actions, ``None`` for idle steps) from the stages' ``group_size``,
``group_rank`` and ``num_stages`` only, and validates it. Stage index = rank + (j-1)·P for the j-th
Sharded region.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpipe_tune.algebra import Bwd, Cut, Fwd, Schedule, Skeleton, derive, is_interleavable
from mpipe_tune.errors import NotSupportedError

from conftest import make_model

pytest.importorskip("torch")
from torch.distributed.pipelining.schedules import (  # noqa: E402
    ScheduleInterleaved1F1B, ScheduleLoopedBFS, _format_pipeline_order,
)


def torch_order(schedule_class, P: int, M: int, v: int) -> dict[int, list[str]]:
    """Rank -> torch's compute actions as text (``5F2``: stage 5, forward, microbatch 2)."""
    out = {}
    for rank in range(P):
        stages = [SimpleNamespace(num_stages=P * v, group_size=P, group_rank=rank) for _ in range(v)]
        order = schedule_class(stages, M).pipeline_order
        out[rank] = [str(a) for a in order[rank] if a is not None]
    return out


def derived_order(skeleton: Skeleton, P: int, M: int, v: int) -> dict[int, list[str]]:
    """Rank -> derive's Fwd/Bwd events in torch's action text."""
    model = make_model(["llm"] * (P * v))
    plan = derive(Cut(tuple(P * j for j in range(1, v))), Schedule((skeleton,) * v), model, P, M)
    stage_index = {stage: i for i, stage in enumerate(plan.stages)}
    out = {}
    for rank in range(P):
        out[rank] = [
            f"{stage_index[(e.region, e.rank)]}{'F' if isinstance(e, Fwd) else 'B'}{e.mb}"
            for e in plan.nodes(rank) if isinstance(e, (Fwd, Bwd))
        ]
    return out


def grid(P: int, M: int, v: int) -> str:
    return _format_pipeline_order({r: ScheduleInterleaved1F1B(
        [SimpleNamespace(num_stages=P * v, group_size=P, group_rank=r) for _ in range(v)], M).pipeline_order[r]
        for r in range(P)})


CASES = [
    (P, M, v)
    for v in (2, 3)
    for P in (2, 3, 4)
    for M in range(1, 3 * P + 1)
    if is_interleavable(P, M)
]


def test_the_cases_cover_multiples_of_p_and_not_and_every_round_count():
    assert any(M % P == 0 for P, M, _ in CASES) and any(M % P for P, M, _ in CASES)
    assert {max(1, M // P) for P, M, _ in CASES} == {1, 2, 3}
    assert (4, 6, 2) in CASES and (4, 10, 3) in CASES and (4, 3, 2) in CASES  # M < P and P < M < 2P
    assert (4, 4, 2) in CASES  # M == P: the last ranks alternate before every forward has run, as in torch


@pytest.mark.parametrize("P,M,v", CASES, ids=lambda x: str(x))
def test_interleaved_order_equals_torchs_rank_by_rank(P, M, v):
    ours, theirs = derived_order(Skeleton.ONE_F_ONE_B, P, M, v), torch_order(ScheduleInterleaved1F1B, P, M, v)
    for rank in range(P):
        assert ours[rank] == theirs[rank], f"rank {rank} differs from torch's order:\n{grid(P, M, v)}"


@pytest.mark.parametrize("P,M", [(2, 5), (2, 7), (3, 7), (4, 9), (4, 11), (4, 13)])
def test_m_that_torch_refuses_is_refused_with_the_nearest_counts(P, M):
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_order(ScheduleInterleaved1F1B, P, M, 2)
    with pytest.raises(NotSupportedError, match=rf"multiple of {M // P}; got M={M}, P={P} \(use M=\d+ or M=\d+\)"):
        derived_order(Skeleton.ONE_F_ONE_B, P, M, 2)


@pytest.mark.parametrize("P,M,v", [(2, 3, 2), (4, 6, 2), (3, 4, 3)])
def test_interleaved_gpipe_is_torchs_looped_bfs_with_backwards_in_microbatch_order(P, M, v):
    """``gpipe,gpipe`` runs any M. It matches torch's ``ScheduleLoopedBFS`` except that its
    backwards on each stage run in microbatch order, where looped BFS runs them last first."""
    ours, theirs = derived_order(Skeleton.GPIPE, P, M, v), torch_order(ScheduleLoopedBFS, P, M, v)
    for rank in range(P):
        forwards = [a for a in theirs[rank] if "F" in a]
        backwards = [a for a in theirs[rank] if "B" in a]
        in_order = [b for i in range(0, len(backwards), M) for b in reversed(backwards[i:i + M])]
        assert ours[rank] == forwards + in_order
