"""Each Sharded skeleton's per-rank programs and how a wavefront lays its stages and slabs on the
ranks: what :func:`~mpipe_tune.algebra._derive.derive` lowers into events (split out of it).

A program is a rank's ``(op, chunk, mb)`` steps (:mod:`mpipe_tune.algebra._order`); a wavefront of
``v`` Sharded regions of one skeleton runs chunk ``k``'s slab of every rank, in rank order, except
``zbv``'s second region, placed on the ranks in a V (decreasing rank order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from mpipe_tune.algebra import _order as programs
from mpipe_tune.algebra._placement import slabs_from_counts
from mpipe_tune.algebra._plan import Stage
from mpipe_tune.algebra._schedule import Layout, Schedule, Skeleton, parse_schedule


def _one_f_one_b_program(rank: int, P: int, M: int, v: int) -> programs.Program:
    return programs.one_f_one_b(rank, P, M) if v == 1 else programs.interleaved_one_f_one_b(rank, P, M, v)


def _gpipe_program(rank: int, P: int, M: int, v: int) -> programs.Program:
    return programs.gpipe(M, v)


def _zb1p_program(rank: int, P: int, M: int, v: int) -> programs.Program:
    return programs.zero_bubble_h1(rank, P, M, v)


def _zbv_program(rank: int, P: int, M: int, v: int) -> programs.Program:
    assert v == 2, "zbv runs two chunks"
    return programs.zero_bubble_v(rank, P, M)


PROGRAMS: dict[Skeleton, Callable[[int, int, int, int], programs.Program]] = {
    Skeleton.ONE_F_ONE_B: _one_f_one_b_program,
    Skeleton.GPIPE: _gpipe_program,
    Skeleton.ZB1P: _zb1p_program,
    Skeleton.ZBV: _zbv_program,
}
"""Per Sharded skeleton, ``(rank, P, M, v) -> program`` (see :mod:`mpipe_tune.algebra._order`)."""


def rank_program(skeleton: Skeleton, rank: int, P: int, M: int, v: int) -> programs.Program:
    """Rank ``rank``'s ``(op, chunk, mb)`` program in a wavefront of ``v`` regions of ``skeleton``."""
    return PROGRAMS[skeleton](rank, P, M, v)


def wavefront_stages(skeleton: Skeleton, sharded: Sequence[int], P: int) -> list[Stage]:
    """The Sharded stages in wavefront order: every region's ranks in increasing order, except that
    ``zbv`` places its second region in a V, on the ranks in decreasing order (rank r runs stages r and
    2P-1-r, so the last stage, and the loss, are on rank 0; :func:`~mpipe_tune.algebra._derive.derive` gives rank P-1 that
    region's first slab).

    >>> wavefront_stages(Skeleton.ZBV, [1, 2], 2)
    [(1, 0), (1, 1), (2, 1), (2, 0)]
    """
    ranks = [range(P)] * len(sharded)
    for k in _reversed_chunks(skeleton):
        ranks[k] = range(P - 1, -1, -1)
    return [(j, r) for j, order in zip(sharded, ranks) for r in order]


def _reversed_chunks(skeleton: Skeleton) -> frozenset[int]:
    """The chunks (positions among a wavefront's Sharded regions) placed on the ranks in reverse:
    ``zbv``'s second."""
    return frozenset({1}) if skeleton is Skeleton.ZBV else frozenset()


def rank_slabs(schedule: Schedule, chunk: int, start: int, counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per rank, its slab of the ``chunk``-th Sharded region (0-based) that starts at layer ``start``,
    from the slabs' layer counts in layer order: dealt to ranks 0, 1, ..., or to P-1, ..., 0 on a
    chunk placed in reverse (``zbv``'s second).

    >>> rank_slabs(parse_schedule("zbv,zbv"), 1, 4, (1, 3))
    ((5, 8), (4, 5))
    """
    slabs = slabs_from_counts(start, counts)
    skeleton = next(s for s in schedule.skeletons if s.layout is Layout.SHARDED)
    return slabs[::-1] if chunk in _reversed_chunks(skeleton) else slabs


_OPS = "FBW"  # a program step's op by its code in :func:`_programs`


@lru_cache(maxsize=64)
def _programs(skeleton: Skeleton, P: int, M: int, v: int) -> tuple[np.ndarray, ...]:
    """Every rank's program (:func:`rank_program`), rank after rank, as columns: rank, op (its code in
    :data:`_OPS`), chunk, mb. A pure function of its arguments, kept for the last 64 of them."""
    steps = [(r, _OPS.index(op), chunk, m) for r in range(P) for op, chunk, m in rank_program(skeleton, r, P, M, v)]
    columns = np.array(steps, dtype=np.int64).reshape(-1, 4).T.copy()
    columns.flags.writeable = False
    return tuple(columns)
