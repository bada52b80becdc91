"""Step-time lower bounds from the layer tables alone (no derive, no order): what the bound search sorts by.

Per sampled step, with ``W_r`` the backbone work (forward and backward seconds of every microbatch) of
rank ``r``'s slabs of the Sharded regions:

- rank ``r``'s first forward waits for microbatch 0's forwards on ranks ``< r`` (first Sharded region),
  and after its last backward (microbatch ``M-1``'s, first Sharded region) those ranks still run theirs:
  ``fill_r + W_r + drain_r`` (a split backward, the zero-bubble skeletons', may run weight gradients
  after that last backward: there ``drain_r`` is left out);
- all the work, encodes included, shares the ``P`` ranks: ``total / P``;
- where the transposed regions' owner map is known before the step (round-robin, or a given map; and,
  once asked for, a per-step policy's map: :meth:`~mpipe_tune.search._evaluate.Evaluator.owner_bounds`),
  rank ``r`` also runs the forwards and backwards of the microbatches it owns: ``W_r + E_r``. Under full
  recomputation an encoder backward placed off the cooldown may run on another rank, so there only the
  owned forwards count.

Transfers, reduces and the optimizer update only add time, so the largest of these bounds the makespan.
The sums are prefix sums over layers, stacked over the sampled steps, so that one point's bound is a
few array operations for all its steps at once.

Memory has a bound of its own beyond the static bytes (:func:`activation_floor`): a Sharded stage's
forward keeps its saved activations until its backward, and a rank's forward of microbatch ``m`` in an
earlier region runs before, and its backward after, the same microbatch's backward in a later region,
so at that backward's start every slab of the rank holds ``m``'s saved activations (of its layers that
run a backward: only those stages have one). A plan whose static bytes plus that exceed the capacity
cannot fit, whatever its order; on MoE spaces this settles most of the fast plans that do not fit.

A cheaper bound serves first where a layer table would be the cost: recomputation only adds backward
time, so a plan with it is bounded by the tables of its setting without it (all the work, plus the
forwards full recomputation re-runs, over ``P`` ranks; :func:`full_recompute_s`). :class:`BoundOrder`
visits candidates in order of their tightest bound while computing it only for those that come on top.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mpipe_tune.algebra import Candidate, rank_slabs, Model, Layout, Schedule
from mpipe_tune.cost import LayerTable


@dataclass(frozen=True)
class BoundSums:
    """One setting's layer tables over the sampled steps, as prefix sums over layers (axis 1)."""

    work: np.ndarray
    """(steps, layers + 1): forward and backward seconds of every microbatch of layers ``[0, l)``."""
    first: np.ndarray
    """(steps, layers + 1): microbatch 0's forward seconds of layers ``[0, l)``."""
    last: np.ndarray
    """(steps, layers + 1): microbatch ``M-1``'s backward seconds of layers ``[0, l)``."""
    fwd_s: tuple[np.ndarray, ...]
    """Per step, the table's (layers, microbatches) forward seconds (the owned work's source)."""
    bwd_s: tuple[np.ndarray, ...]
    """Per step, the table's (layers, microbatches) backward seconds."""
    saved: np.ndarray | None = None
    """(steps, layers + 1, microbatches): the saved activation bytes of layers ``[0, l)`` that run a
    backward, per microbatch (None: not given; :func:`activation_floor` needs it)."""

    @classmethod
    def of(cls, fwd_s: Sequence[np.ndarray], bwd_s: Sequence[np.ndarray],
           saved_bytes: Sequence[np.ndarray] | None = None, runs_backward: np.ndarray | None = None) -> BoundSums:
        """``saved_bytes``: per step the table's (layers, microbatches) saved activation bytes, and
        ``runs_backward`` the (layers,) mask of the layers that run a backward (both or neither)."""
        def prefix(rows: list[np.ndarray]) -> np.ndarray:
            stacked = np.stack(rows)
            return np.concatenate((np.zeros((len(rows), 1)), np.cumsum(stacked, axis=1)), axis=1)

        saved = None
        if saved_bytes is not None:
            kept = np.stack([s * runs_backward[:, None] for s in saved_bytes])  # (steps, layers, M)
            saved = np.concatenate((np.zeros((kept.shape[0], 1, kept.shape[2])), np.cumsum(kept, axis=1)), axis=1)
        return cls(prefix([f.sum(axis=1) + b.sum(axis=1) for f, b in zip(fwd_s, bwd_s)]),
                   prefix([f[:, 0] for f in fwd_s]), prefix([b[:, -1] for b in bwd_s]), tuple(fwd_s), tuple(bwd_s),
                   saved)

    def owned_work(self, regions: Sequence[tuple[int, int]], forward_only: bool) -> np.ndarray:
        """(steps, microbatches): the seconds of each microbatch's events in the transposed ``regions``
        (forwards, and backwards unless ``forward_only``)."""
        out = 0.0
        for start, stop in regions:
            out = out + np.stack([f[start:stop].sum(axis=0) for f in self.fwd_s])
            if not forward_only:
                out = out + np.stack([b[start:stop].sum(axis=0) for b in self.bwd_s])
        return out


@dataclass(frozen=True)
class SlabIndex:
    """Where a plan's ranks hold their slabs, as prefix-sum indices: per Sharded region (rows) and rank
    (columns) the slab's first layer and the layer after its last."""

    lo: np.ndarray
    hi: np.ndarray
    replicated: tuple[tuple[int, int], ...]
    """The transposed (Replicated) regions' layer ranges."""
    split: bool
    """A split backward (weight gradients may run after the last backward)."""

    @classmethod
    def of(cls, schedule: Schedule, regions: Sequence[tuple[int, int]],
           slab_counts: Sequence[Sequence[int]]) -> SlabIndex:
        sharded = [r for r, layout in zip(regions, schedule.layouts()) if layout is Layout.SHARDED]
        slabs = [rank_slabs(schedule, chunk, start, counts)
                 for chunk, ((start, _), counts) in enumerate(zip(sharded, slab_counts))]
        replicated = tuple(r for r, layout in zip(regions, schedule.layouts()) if layout is Layout.REPLICATED)
        return cls(np.array([[lo for lo, _ in s] for s in slabs]), np.array([[hi for _, hi in s] for s in slabs]),
                   replicated, any(s.splits_backward for s in schedule.skeletons))


def step_bounds(sums: BoundSums, index: SlabIndex, pp: int, owned: np.ndarray | None = None,
                owners: np.ndarray | None = None) -> np.ndarray:
    """Per sampled step, a lower bound on the step time (see the module docstring). ``owned``: the
    (steps, microbatches) work of the transposed regions and ``owners`` the (steps, microbatches) rank of
    each microbatch, where the owner map is known."""
    busy = (sums.work[:, index.hi] - sums.work[:, index.lo]).sum(axis=1)  # (steps, ranks)
    lo, hi = index.lo[0], index.hi[0]
    step = sums.first[:, hi] - sums.first[:, lo]
    if not index.split:
        step = step + sums.last[:, hi] - sums.last[:, lo]
    chain = np.cumsum(step, axis=1) - step  # what runs on the ranks before r, first region
    bound = np.maximum((chain + busy).max(axis=1), sums.work[:, -1] / pp)
    if owned is not None and owners is not None:
        for s in range(len(bound)):
            loads = busy[s] + np.bincount(owners[s], weights=owned[s], minlength=pp)
            bound[s] = max(bound[s], loads.max())
    return bound


def activation_floor(sums: BoundSums, index: SlabIndex) -> np.ndarray:
    """Per rank, at least the activation bytes it holds at its peak on any sampled step (see the module
    docstring): over the steps and microbatches ``m``, the largest sum over its Sharded slabs of ``m``'s
    saved activations (of the layers that run a backward). The transposed regions' are left out: their
    owners, and where an encoder backward runs, vary."""
    per_slab = sums.saved[:, index.hi, :] - sums.saved[:, index.lo, :]  # (steps, regions, ranks, M)
    return per_slab.sum(axis=1).max(axis=(0, 2))


@dataclass(frozen=True)
class LiveSets:
    """Read off an order (no durations): per rank, which of its Sharded stages' saved activations are
    live together at the start of each event that frees some. A rank runs one event at a time in its
    order, so a forward before (or at) such an event has allocated its tensor, and a backward at or
    after it has not freed its own yet (events that free saved activations take time)."""

    tensors: tuple[np.ndarray, ...]
    """Per rank, the indices of its tensors (into the memory layout's saved activations)."""
    live: tuple[np.ndarray, ...]
    """Per rank, (instants, tensors) booleans."""

    @classmethod
    def of(cls, nodes: Sequence[np.ndarray], num_events: int, rank: np.ndarray, alloc_event: np.ndarray,
           free_event: np.ndarray, keep: np.ndarray) -> LiveSets:
        """``nodes``: per rank its events in order; per saved tensor its ``rank``, the events that
        allocate and free it, and whether to ``keep`` it (a Sharded stage's)."""
        position = np.zeros(num_events, dtype=np.int64)
        for events in nodes:
            position[events] = np.arange(len(events))
        tensors, live = [], []
        for r in range(len(nodes)):
            mine = np.flatnonzero((rank == r) & keep)
            start, stop = position[alloc_event[mine]], position[free_event[mine]]
            instants = np.unique(stop)
            tensors.append(mine)
            live.append((start[None, :] <= instants[:, None]) & (instants[:, None] <= stop[None, :]))
        return cls(tuple(tensors), tuple(live))

    def floor(self, saved_flat: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Per rank, the largest live saved bytes over its instants and the steps: ``saved_flat`` is
        (steps, (layers + 1) * microbatches), per step the per-microbatch prefix sums over the layers
        flattened, and ``lo``/``hi`` each tensor's indices in it (its slab and microbatch)."""
        out = np.zeros(len(self.tensors))
        for r, (mine, live) in enumerate(zip(self.tensors, self.live)):
            if len(mine):
                sizes = saved_flat[:, hi[mine]] - saved_flat[:, lo[mine]]  # (steps, tensors)
                out[r] = (live.astype(float) @ sizes.T).max()
        return out


def full_recompute_s(table: LayerTable, model: Model) -> float:
    """Of a table without recomputation, at least the seconds full recomputation adds to its steps: the
    forward of every layer that runs a backward, re-run before it (the encoder's feature gather, in the
    forward of its last layer under an encoder tp of its own, is not re-run: that layer is left out)."""
    rerun = replace(table, dgrad_s=np.zeros_like(table.dgrad_s), wgrad_s=np.zeros_like(table.wgrad_s),
                    bwd_overhead_s=np.zeros_like(table.bwd_overhead_s), recompute_s=table.fwd_s).backward_s(model)
    if table.layer_replicas is not None:
        rerun = rerun[np.arange(len(rerun)) != np.flatnonzero(table.layer_replicas > 1)[-1]]
    return float(rerun.sum())


class BoundOrder:
    """Candidates in increasing order of their bound (ties: the first listed first), with bounds that
    refine by levels: each candidate enters at its cheapest bound, and whenever one that can still be
    refined is on top it goes back in with its next, tighter bound. The top is taken only once final, so
    its bound bounds every candidate still in the order, and the order is that of the final bounds."""

    def __init__(self, candidates: Sequence[Candidate], levels: Callable[[Candidate], tuple[int, int]],
                 bound_at: Callable[[Candidate, int], float]) -> None:
        self.candidates, self.bound_at = candidates, bound_at
        self.heap = []
        for index, c in enumerate(candidates):
            first, last = levels(c)
            self.heap.append((bound_at(c, first), index, first, last))
        heapq.heapify(self.heap)

    def __len__(self) -> int:
        return len(self.heap)

    def peek(self) -> tuple[float, int]:
        """The least final bound and its candidate's index (refining the candidates on top until one is final)."""
        while True:
            low, index, level, last = self.heap[0]
            if level >= last:
                return low, index
            tighter = max(low, self.bound_at(self.candidates[index], level + 1))
            heapq.heapreplace(self.heap, (tighter, index, level + 1, last))

    def pop(self) -> None:
        """Take the top (after :meth:`peek`) out of the order."""
        heapq.heappop(self.heap)
