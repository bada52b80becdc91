"""Data-parallel communication overlapped with compute, as Megatron-LM and torchtitan run it.

A slab's gradient reduce is issued in buckets while its last backward (of the step's last microbatch)
produces the gradients, and runs on a communication stream while the rank computes on; with the
distributed optimizer (ZeRO-1) the reduce is a reduce-scatter and the updated parameters come back
by an all-gather that the next step's forward waits on bucket by bucket. Only what the compute does
not hide is on the critical path. The closed forms, per pipeline rank, in seconds of the rank's own
compute (its events in its order; the idle time of its bubbles is not counted as cover, which makes
the exposed remainder an upper bound):

- Reduce (backward side). The rank's slabs ``k = 1..v`` in the order their last backward runs; ``a_k``
  the compute from the start of slab ``k``'s last backward to the end of the rank's compute, ``w_k``
  that backward's own seconds, ``R_k`` the reduce (all-reduce, or reduce-scatter with ZeRO-1) and
  ``q_k = min(1, bucket / slab parameters)`` the share of one bucket. With times relative to the end
  of compute, ``f_k = max(f_{k-1} + R_k, -a_k + q_k w_k + R_k, -a_k + w_k + q_k R_k)``: a slab's
  reduce starts once its first bucket is full and no earlier than the previous slab's is done, and
  its last bucket only leaves when its backward ends (with a split backward, the zero-bubble
  skeletons', the slab's last weight-gradient event is that backward). Exposed: ``max(0, f_v)``.
- All-gather (forward side, ZeRO-1 only). The slabs in the order their first forward runs; ``b_k`` the
  compute before that forward, ``x_k`` its seconds, ``A_k`` the all-gather, issued back to back at the
  step's start (``g_k = A_1 + ... + A_k``). The forward is delayed by
  ``D = max(0, max_k max(g_{k-1} + q_k A_k - b_k, g_k - b_k - x_k))``: each slab's first bucket must have
  arrived when its first forward starts, and all of it before that forward ends.

A rank's exposed total (``max(0, f_v) + D``) is charged on one of its data-parallel reduce events (the
one first in the plan's event list; its reduces run back to back after its last backward, so only
their sum matters), the rest of its reduces on 0. ReplicaGroup reduces
(a transposed encoder's, reduced over every rank) stay whole: their last backward is the rank's last
compute, so nothing but its own last bucket would cover them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import BWD, FWD, GROUPS, REDUCE, WGRAD, Plan, DpReduce, Group

_COMPUTE = (FWD, BWD, WGRAD)


def exposed_reduce_s(ready_before_end_s, last_backward_s, reduce_s, bucket_share) -> float:
    """Seconds the bucketed reduces of a rank's slabs run past the end of its compute (the reduce
    side of the module's closed form); arguments per slab, in the order the slabs finish.

    >>> exposed_reduce_s([1.0], [0.5], [0.3], [0.1])  # hidden by the second half of the last backward
    0.0
    >>> round(exposed_reduce_s([0.5], [0.5], [0.8], [0.25]), 12)  # starts 0.125 s in, runs 0.8 s
    0.425
    """
    finish = -np.inf
    for a, w, r, q in zip(ready_before_end_s, last_backward_s, reduce_s, bucket_share):
        finish = max(finish + r, -a + q * w + r, -a + w + q * r)
    return max(0.0, float(finish))


def exposed_gather_s(compute_before_s, first_forward_s, gather_s, bucket_share) -> float:
    """Seconds the next step's forward waits on the parameter all-gathers (the forward side of the
    module's closed form); arguments per slab, in the order the slabs first run a forward.

    >>> exposed_gather_s([0.0, 1.0], [1.0, 1.0], [0.4, 0.4], [0.5, 0.5])  # only the first bucket waits
    0.2
    """
    delay = gathered = 0.0
    for b, x, g, q in zip(compute_before_s, first_forward_s, gather_s, bucket_share):
        delay = max(delay, gathered + q * g - b, gathered + g - b - x)
        gathered += g
    return delay


@dataclass(frozen=True)
class _RankReduces:
    compute: np.ndarray
    """The rank's compute events (Fwd, Bwd, Wgrad) in its order."""
    reduce_positions: np.ndarray
    """Indices (into the plan's reduces) of this rank's DataGroup reduces, in the order their last
    backward runs."""
    last_backward: np.ndarray
    """Per reduce, the position in ``compute`` of its slab's last backward."""
    first_forward: np.ndarray
    """Per reduce, the position in ``compute`` of its slab's first forward."""


class DataParallelOverlap:
    """The compiled form of a plan's reduce overlap: which compute events cover which reduce."""

    def __init__(self, plan: Plan, reduces: list[tuple[int, DpReduce]], slab_params: np.ndarray,
                 bucket_params: float, sharded_optimizer: bool) -> None:
        c = plan.order.columns  # the events' kinds, regions and groups: no event objects needed
        kind, region, group = c.kind.tolist(), c.region.tolist(), c.group.tolist()
        data = GROUPS.index(Group.DATA)
        self.reduce_idx = np.array([i for i, _ in reduces], dtype=np.int64)
        self.share = np.minimum(1.0, bucket_params / np.maximum(slab_params, 1.0))
        self.sharded_optimizer = sharded_optimizer
        self.ranks: list[_RankReduces] = []
        position = {i: k for k, (i, _) in enumerate(reduces)}
        for ids in plan.order.nodes:
            compute = [i for i in ids if kind[i] in _COMPUTE]
            entries = []
            for i in ids:
                if not (kind[i] == REDUCE and group[i] == data):
                    continue
                mine = [p for p, e in enumerate(compute) if region[e] == region[i]]
                backwards = [p for p in mine if kind[compute[p]] != FWD] or mine
                forwards = [p for p in mine if kind[compute[p]] == FWD]
                entries.append((backwards[-1], position[i], forwards[0]))
            if entries:
                entries.sort()
                last, where, first = (np.array(column, dtype=np.int64) for column in zip(*entries))
                self.ranks.append(_RankReduces(np.array(compute, dtype=np.int64), where, last, first))

    def exposed(self, durations: np.ndarray, reduce_s: np.ndarray, gather_s: np.ndarray) -> np.ndarray:
        """Per reduce event (aligned with the plan's reduces), the seconds it keeps on its rank's
        critical path, given every compute event's ``durations``, each reduce's whole ``reduce_s`` (an
        all-reduce's; with ZeRO-1 the reduce-scatter's and the all-gather's) and of it ``gather_s``, the
        all-gather's (ZeRO-1; else 0)."""
        out = reduce_s.astype(float).copy()
        for rank in self.ranks:
            k = rank.reduce_positions
            whole = reduce_s[k]
            if not whole.any():
                continue
            seconds = durations[rank.compute]
            after = np.cumsum(seconds[::-1])[::-1]  # compute from each position to the end
            before = np.concatenate(([0.0], np.cumsum(seconds)[:-1]))  # compute before each position
            gathers = gather_s[k]  # 0 without a distributed optimizer
            total = exposed_reduce_s(after[rank.last_backward], seconds[rank.last_backward], whole - gathers,
                                     self.share[k])
            if self.sharded_optimizer:
                order = np.argsort(rank.first_forward, kind="stable")
                total += exposed_gather_s(before[rank.first_forward[order]], seconds[rank.first_forward[order]],
                                          gathers[order], self.share[k][order])
            out[k] = 0.0
            out[k[np.argmin(self.reduce_idx[k])]] = total
        return out


def compile_overlap(plan: Plan, reduces: list[tuple[int, DpReduce]], model, table, options) -> DataParallelOverlap | None:
    """The plan's :class:`DataParallelOverlap` (None when ``options.overlap_dp_comm`` is off): each
    reduce's slab parameters per tensor-parallel rank set its bucket share."""
    if not options.overlap_dp_comm or not reduces:
        return None
    trainable = np.array(model.trainable_bits(), dtype=bool)
    params = []
    for _, event in reduces:
        start, stop = plan.slab(event.region, 0 if event.rank is None else event.rank)
        params.append(float(table.param_count[start:stop][trainable[start:stop]].sum()) / options.degrees.tp)
    return DataParallelOverlap(plan, reduces, np.array(params), options.dp_bucket_params, options.shard_optimizer)
