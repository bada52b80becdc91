"""Where each rank runs the encoder backwards it owns: the placement of ``Bwd(source, owner, m)`` in its order.

With a trainable transposed encoder (``transpose,...`` as the source region), microbatch ``m``'s
encoder backward runs on ``m``'s owner once the Scatter of the first backbone stage's input gradient
has brought it there. Which point of the owner's static order it takes is a choice:

- ``cooldown`` (the default, and derive's only order before the choice existed): after the rank's
  last backbone event, in increasing ``m``, before its reduces;
- ``earliest``: at the first point of the owner's order where its gradient has arrived and the rank
  is idle, both read off the programs' **unit-time steps**, not off durations: every backbone forward
  and backward (of a Sharded stage) takes one step, an encoder backward one step, and transfers,
  encodes and the loss none; each event starts as soon as its rank is free and its inputs are done
  (the longest path with those unit durations). The gradient of ``m`` has *arrived* when the first
  backbone stage's backward of ``m`` has finished. The owner's idle gaps are the steps between two of
  its backbone events where it runs nothing; the encoder backwards it owns take, in increasing
  ``m``, one step each of the first gap that still has a step free after their arrival, and those
  that find none run in the cooldown;
- ``optimised``: slots chosen with the cost model (:mod:`mpipe_tune.cost._encoder_backward`), given
  to derive as explicit :attr:`EncoderBackward.slots`.

A placement is a **slot** per microbatch: how many of its owner's backbone compute events (the
forwards and backwards of the rank's Sharded stages, in program order) run before the encoder
backward. The cooldown is the slot equal to the rank's backbone event count; encoder backwards in
one slot run in increasing ``m``. A slot is *legal* when none of the backbone events after it leads
to the first stage's backward of ``m`` (else the order would wait on itself): the first stage's
backwards all run on rank 0, one after another, so legal slots are jointly deadlock-free.

**On another rank** (:attr:`EncoderBackward.ranks`). Under full recomputation the owner of ``m``
keeps nothing of its encode for the backward that could not be re-created from ``m``'s images, and
every rank holds the replicated encoder's weights; so ``Bwd(source, r, m)`` may run on a rank ``r``
other than ``m``'s owner: ``r`` reads ``m``'s images, re-runs its encode and back-propagates the
gradient, which the Scatter after the first stage's backward of ``m`` now brings to ``r``. The owner
still runs the encode whose output the Gather ships, and keeps nothing of it for a backward. A slot
then counts ``r``'s backbone events and is legal by the same rule, read on ``r``. The argument above
still holds: a placed encoder backward feeds only its rank's next event and the reduce, and its one
predecessor off its rank besides the Scatter is the owner's encode of ``m``, which waits for nothing
but the owner's earlier encodes (every slot is after a rank's encodes); so a cycle through it would
pass through the first stage's backward of ``m``, which a legal slot excludes. Which recomputation
allows a move is the candidate's to say (:meth:`~mpipe_tune.algebra._candidate.Candidate.validate`);
``cooldown`` and ``earliest`` keep every encoder backward on its owner.

>>> EncoderBackward("earliest")
EncoderBackward(placement='earliest', slots=None, ranks=None)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra._events import Comm, EdgeKind
from mpipe_tune.algebra._topology import kahn_order
from mpipe_tune.errors import MpipeError

COOLDOWN, EARLIEST, OPTIMISED = "cooldown", "earliest", "optimised"
PLACEMENTS = (COOLDOWN, EARLIEST, OPTIMISED)
"""The placements of the encoder backwards a candidate may name."""


def validate_placement(placement: str) -> None:
    """One line naming the placement when it is not one of :data:`PLACEMENTS`."""
    if placement not in PLACEMENTS:
        raise MpipeError(f"encoder backward placement {placement!r} is not a placement; use one of "
                         f"{', '.join(PLACEMENTS)}")


def runs_encoder_backward(plan) -> bool:
    """Whether a derived plan runs encoder backwards (its transposed source region is trainable)."""
    source = plan.source
    return source is not None and any(e[-1] == "B" and e[0] == source.region for e in plan.order.events)


@dataclass(frozen=True)
class EncoderBackward:
    """The encoder backward placement derive builds: a policy, or explicit slots (which win)."""

    placement: str = COOLDOWN
    """One of :data:`PLACEMENTS`; ``optimised`` needs :attr:`slots` (the cost model chooses them)."""
    slots: tuple[int, ...] | None = None
    """Per microbatch, the backbone compute events its rank (:attr:`ranks`) runs before its encoder backward."""
    ranks: tuple[int, ...] | None = None
    """Per microbatch, the rank that runs its encoder backward (module docstring: it needs explicit
    :attr:`slots`); ``None``: each microbatch's owner."""

    def validate(self, num_microbatches: int, has_encoder_backward: bool, num_ranks: int) -> None:
        validate_placement(self.placement)
        if self.ranks is not None:
            if self.slots is None:
                raise MpipeError("the encoder backward ranks are given without slots; give each microbatch's slot on "
                                 "its rank too (the optimised placement chooses both)")
            if len(self.ranks) != num_microbatches:
                raise MpipeError(f"the encoder backward ranks list {len(self.ranks)} entries, but M={num_microbatches} "
                                 f"microbatches need one each")
            for m, r in enumerate(self.ranks):
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < num_ranks:
                    raise MpipeError(f"the encoder backward rank {r!r} of microbatch {m} is not a pipeline rank "
                                     f"0..{num_ranks - 1}")
        if self.slots is None:
            if self.placement == OPTIMISED and has_encoder_backward:
                raise MpipeError("the optimised encoder backward placement chooses its slots with the cost model "
                                 "(predict and the search do); give the slots, or use cooldown or earliest")
            return
        if not has_encoder_backward:
            raise MpipeError("encoder backward slots are given, but the plan runs no encoder backward (no trainable "
                             "transposed region); drop the slots")
        if len(self.slots) != num_microbatches:
            raise MpipeError(f"the encoder backward slots list {len(self.slots)} entries, but M={num_microbatches} "
                             f"microbatches need one each")

    @property
    def is_cooldown(self) -> bool:
        return self.slots is None and self.placement == COOLDOWN

    def ranks_for(self, owners: Sequence[int]) -> tuple[int, ...]:
        """Per microbatch, the rank that runs its encoder backward: :attr:`ranks`, else its owner."""
        return tuple(owners) if self.ranks is None else self.ranks


def moved_count(ranks: Sequence[int] | None, owners: Sequence[int]) -> int:
    """How many encoder backwards ``ranks`` runs on another rank than ``owners`` (None: none)."""
    return 0 if ranks is None else sum(r != o for r, o in zip(ranks, owners))


def moved_events(events: Sequence, ranks: Sequence[int], *, source_region: int) -> list:
    """``events`` with each encoder backward ``Bwd(source, owner, m)`` on ``ranks[m]`` and the Scatter that
    feeds it (the first stage's input gradient) reaching ``(source, ranks[m])``: the same indices."""
    out = list(events)
    for i, e in enumerate(events):
        tag = e[-1]
        if tag == "B" and e[0] == source_region:
            out[i] = type(e)(source_region, ranks[e[2]], e[2])
        elif tag == "C" and e[2][0] == source_region and e[0] is Comm.SCATTER:
            out[i] = type(e)(e[0], e[1], (source_region, ranks[e[3]]), e[3])
    return out


@dataclass(frozen=True, eq=False)
class BackboneSteps:
    """A plan's backbone in unit-time steps (see the module docstring), and what placing its encoder
    backwards needs: it does not depend on the owner map (encodes take no step)."""

    compute: tuple[np.ndarray, ...]
    """Per rank, its backbone compute events (event indices) in program order."""
    start: tuple[np.ndarray, ...]
    """Per rank, the unit-time step at which each of :attr:`compute` starts."""
    arrival: np.ndarray
    """Per microbatch, the step at which its gradient reaches the owner (the first stage's backward ends)."""
    encoder_bwd: np.ndarray
    """Per microbatch, its encoder backward's event index."""
    first_bwd: np.ndarray
    """Per microbatch, the first backbone stage's backward (event index)."""
    is_encoder_bwd: np.ndarray
    is_backbone: np.ndarray
    is_tail: np.ndarray
    """Per event: an encoder backward; a backbone compute event; a reduce or the step barrier (a rank's tail)."""
    pred_ptr: np.ndarray
    pred_idx: np.ndarray
    """The backbone graph's predecessor lists (dataflow, and each rank's order without encoder backwards)."""

    @property
    def num_ranks(self) -> int:
        return len(self.compute)

    def cooldown_slots(self, owners: Sequence[int]) -> tuple[int, ...]:
        """Every encoder backward after its owner's last backbone event."""
        return tuple(len(self.compute[r]) for r in owners)

    def earliest_slots(self, owners: Sequence[int]) -> tuple[int, ...]:
        """The ``earliest`` placement for ``owners`` (see the module docstring)."""
        slots = list(self.cooldown_slots(owners))
        arrival = self.arrival.tolist()
        for r in range(self.num_ranks):
            start = self.start[r].tolist()
            finish = [s + 1 for s in start]
            free: dict[int, int] = {}  # gap before compute event k -> its first step still free
            for m in (m for m, owner in enumerate(owners) if owner == r):
                for k in range(bisect_left(start, arrival[m] + 1), len(start)):
                    at = max(free.get(k, finish[k - 1] if k else 0), arrival[m])
                    if at + 1 <= start[k]:
                        slots[m], free[k] = k, at + 1
                        break
        return tuple(slots)

    def min_slots(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """Per microbatch, its smallest legal slot on ``ranks[m]`` (the rank that runs its encoder
        backward: its owner, or another under recomputation): one past the last backbone event of
        that rank that leads to the first stage's backward of that microbatch."""
        n = len(self.is_backbone)
        rank_of, position = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for r, compute in enumerate(self.compute):
            rank_of[compute], position[compute] = r, np.arange(len(compute))
        # The first stage's backwards run on one rank, one after another: each one's ancestors hold
        # the earlier ones', so one walk, in that rank's order, visits each event once.
        assert len(set(rank_of[self.first_bwd].tolist())) == 1, "the first stage's backwards run on one rank"
        ptr, pred, rank_list, pos_list = (self.pred_ptr.tolist(), self.pred_idx.tolist(), rank_of.tolist(),
                                          position.tolist())
        seen = [False] * n
        reached = [0] * self.num_ranks
        out = [0] * len(self.first_bwd)
        for m in np.argsort(position[self.first_bwd], kind="stable").tolist():
            stack = [int(self.first_bwd[m])]
            while stack:
                e = stack.pop()
                if seen[e]:
                    continue
                seen[e] = True
                if rank_list[e] >= 0:
                    reached[rank_list[e]] = max(reached[rank_list[e]], pos_list[e] + 1)
                stack.extend(pred[ptr[e]:ptr[e + 1]])
            out[m] = reached[ranks[m]]
        return tuple(out)

    def validate_slots(self, slots: Sequence[int], ranks: Sequence[int]) -> None:
        """One line naming the first microbatch whose slot on ``ranks[m]`` is out of range or would deadlock."""
        for m, (slot, r) in enumerate(zip(slots, ranks)):
            if not isinstance(slot, int) or not 0 <= slot <= len(self.compute[r]):
                raise MpipeError(f"encoder backward slot {slot!r} of microbatch {m} is outside 0..{len(self.compute[r])} "
                                 f"(rank {r}, which runs it, runs {len(self.compute[r])} backbone events)")
        lowest = self.min_slots(ranks)
        for m, (slot, low) in enumerate(zip(slots, lowest)):
            if slot < low:
                raise MpipeError(f"encoder backward slot {slot} of microbatch {m} on rank {ranks[m]} comes before its "
                                 f"gradient can arrive (the rank's backbone event {slot} leads to it), so the order "
                                 f"would deadlock; use a slot of at least {low}")

    def place(self, nodes: Sequence[Sequence[int]], ranks: Sequence[int], slots: Sequence[int]) -> tuple[np.ndarray, ...]:
        """``nodes`` with every encoder backward moved to its slot on ``ranks[m]`` (its owner, or the
        rank it moved to)."""
        slots_array = np.asarray(slots, dtype=np.int64)
        owner_array = np.asarray(ranks, dtype=np.int64)
        out = []
        for r, rank_nodes in enumerate(nodes):
            rank_nodes = np.asarray(rank_nodes, dtype=np.int64)
            base = rank_nodes[~self.is_encoder_bwd[rank_nodes]]
            owned = np.flatnonzero(owner_array == r)
            where = np.append(np.flatnonzero(self.is_backbone[base]), np.argmax(self.is_tail[base]))
            out.append(np.insert(base, where[slots_array[owned]], self.encoder_bwd[owned]))
        return tuple(out)


def backbone_steps(src: np.ndarray, dst: np.ndarray, nodes: Sequence[Sequence[int]], *, is_encoder_bwd: np.ndarray,
                   is_backbone: np.ndarray, is_tail: np.ndarray, encoder_bwd: np.ndarray,
                   first_bwd: np.ndarray) -> BackboneSteps:
    """The unit-time steps of a plan's backbone. ``src``/``dst``: its dataflow edges (no Sequence
    edge); ``nodes``: each rank's order, wherever its encoder backwards are in it (they are left out);
    the masks are per event; ``encoder_bwd``/``first_bwd``: per microbatch, its encoder backward and
    the first backbone stage's backward."""
    n = len(is_backbone)
    chains = [np.asarray(r, dtype=np.int64) for r in nodes]
    chains = [c[~is_encoder_bwd[c]] for c in chains]
    all_src = np.concatenate([src] + [c[:-1] for c in chains]).astype(np.int64)
    all_dst = np.concatenate([dst] + [c[1:] for c in chains]).astype(np.int64)
    by_target = np.argsort(all_dst, kind="stable")
    pred_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(all_dst, minlength=n), out=pred_ptr[1:])
    pred_idx = all_src[by_target]
    finish = _unit_finish(n, all_src, all_dst, pred_ptr, pred_idx, is_backbone.astype(np.int64))
    compute = tuple(c[is_backbone[c]] for c in chains)
    return BackboneSteps(
        compute=compute, start=tuple(finish[c] - 1 for c in compute), arrival=finish[first_bwd],
        encoder_bwd=np.asarray(encoder_bwd, dtype=np.int64), first_bwd=np.asarray(first_bwd, dtype=np.int64),
        is_encoder_bwd=is_encoder_bwd, is_backbone=is_backbone, is_tail=is_tail, pred_ptr=pred_ptr, pred_idx=pred_idx)


def _unit_finish(n: int, src: np.ndarray, dst: np.ndarray, pred_ptr: np.ndarray, pred_idx: np.ndarray,
                 steps: np.ndarray) -> np.ndarray:
    """Finish step of every event: ``steps[e]`` after the latest of its predecessors, in topological order."""

    order = kahn_order(n, src, dst)
    assert order is not None, "the backbone order is cyclic"
    ptr, pred, duration = pred_ptr.tolist(), pred_idx.tolist(), steps.tolist()
    finish = [0] * n
    for e in order:
        finish[e] = duration[e] + max((finish[p] for p in pred[ptr[e]:ptr[e + 1]]), default=0)
    return np.array(finish, dtype=np.int64)


def steps_of(events: Sequence, src: np.ndarray, dst: np.ndarray, nodes: Sequence[Sequence[int]], *,
             source_region: int, first_stage: tuple[int, int], num_microbatches: int) -> BackboneSteps:
    """:func:`backbone_steps` of an order given as its events (a tuple's last field is its kind tag, a
    stage event's first two its region and rank, its third its microbatch), its dataflow edges
    ``src``/``dst`` and its ranks' lists; ``first_stage``: the first backbone stage (region, rank)."""
    tags = np.array([e[-1] for e in events])
    stage = (tags == "F") | (tags == "B")
    region, rank, mb = (np.array([e[k] if e[-1] in "FB" else -1 for e in events], dtype=np.int64) for k in range(3))
    encoder = (tags == "B") & (region == source_region)
    first = (tags == "B") & (region == first_stage[0]) & (rank == first_stage[1])
    encoder_bwd, first_bwd = (np.full(num_microbatches, -1, dtype=np.int64) for _ in range(2))
    encoder_bwd[mb[encoder]], first_bwd[mb[first]] = np.flatnonzero(encoder), np.flatnonzero(first)
    return backbone_steps(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64), nodes,
                          is_encoder_bwd=encoder, is_backbone=stage & (region != source_region),
                          is_tail=(tags == "R") | (tags == "S"), encoder_bwd=encoder_bwd, first_bwd=first_bwd)


def plan_steps(plan) -> BackboneSteps:
    """:func:`steps_of` a derived plan (one with a transposed source region)."""
    dataflow = [(s, t) for s, t, kind in plan.order.edges if kind is not EdgeKind.SEQUENCE]
    src, dst = (np.array([e[k] for e in dataflow], dtype=np.int64) for k in (0, 1))
    return steps_of(plan.order.events, src, dst, plan.order.nodes, source_region=plan.source.region,
                    first_stage=plan.stages[0], num_microbatches=plan.num_microbatches)


def arrange(choice: EncoderBackward, nodes: Sequence[Sequence[int]], events: Sequence, src: np.ndarray,
            dst: np.ndarray, *, source_region: int, first_stage: tuple[int, int],
            owners: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """derive's pass: ``nodes`` (the cooldown order) with the encoder backwards where ``choice`` puts
    them, each on its owner or on the rank ``choice.ranks`` names; the other arguments as
    :func:`steps_of` takes them."""
    steps = steps_of(events, src, dst, nodes, source_region=source_region, first_stage=first_stage,
                     num_microbatches=len(owners))
    ranks = choice.ranks_for(owners)
    if choice.slots is not None:
        steps.validate_slots(choice.slots, ranks)
        slots = choice.slots
    else:
        slots = steps.earliest_slots(owners) if choice.placement == EARLIEST else steps.cooldown_slots(owners)
    return tuple(tuple(rank_nodes.tolist()) for rank_nodes in steps.place(nodes, ranks, slots))
