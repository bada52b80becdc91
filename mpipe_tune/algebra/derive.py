"""``derive(cut, schedule, model, P, M, owners) -> Plan``: placement, collectives and order.

The IR it returns (:class:`~mpipe_tune.algebra.plan.Plan`, its ``Order``) lives in
:mod:`mpipe_tune.algebra.plan`. ``derive`` is a composition of small passes, each a pure function:

1. :func:`_place`: the placement of every region (ByLayer slabs, ByMicrobatch owners);
2. :func:`_collectives`: the seam table and the reduces, gated per region by Lemma 1
   (:mod:`mpipe_tune.algebra.footprint`);
3. :func:`stage_gates`: the same gates per stage of the step, in input-to-loss order;
4. :func:`_microbatch_edges`: one microbatch's activation, turnaround, gradient and accumulate edges,
   built for microbatch 0 and repeated for every microbatch as index arrays by :func:`_every_microbatch`
   (a skeleton that splits its backwards, ``zb1p`` and ``zbv``, adds ``Bwd -> Wgrad -> reduce`` for
   every stage that reduces, in place of ``Bwd -> reduce``);
5. :func:`rank_program`: each rank's per-skeleton program (:data:`PROGRAMS`, one function per Sharded
   skeleton: a new skeleton is one entry there), lowered to its event indices by :func:`_rank_events`;
   the stages' wavefront order is :func:`wavefront_stages` (``zbv``'s second region in a V);
6. :func:`topological_order`: a deadlock-free execution of the graph.

The plain build these passes replace (every microbatch's edges and every rank's events de-duplicated
through dictionaries) is the reference of ``tests/algebra/test_derive_reference.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from itertools import chain
from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import order as programs
from mpipe_tune.algebra.events import (
    Bwd, Coll, Comm, DpReduce, EdgeKind, Event, Fwd, Group, Loss, Stage, StepBarrier, Wgrad,
)
from mpipe_tune.algebra.footprint import footprint
from mpipe_tune.algebra.model import Model
from mpipe_tune.algebra.placement import (
    ByLayer, ByMicrobatch, RegionPlacement, balanced_counts, round_robin, slabs_from_counts,
    validate_counts, validate_owners,
)
from mpipe_tune.algebra.plan import Collectives, Order, Plan, Seam, source_of
from mpipe_tune.algebra.schedule import Cut, Layout, Schedule, Skeleton, parse_schedule, validate_schedule
from mpipe_tune.errors import MpipeError, NotSupportedError

_SEAM_COMMS = {
    (Layout.REPLICATED, Layout.SHARDED): (Comm.GATHER, Comm.SCATTER),
    (Layout.SHARDED, Layout.SHARDED): (Comm.SEND, Comm.RECV_GRAD),
    (Layout.SHARDED, Layout.REPLICATED): (Comm.SCATTER, Comm.GATHER),
}


@dataclass(frozen=True)
class Owners:
    """Owner choices for derive; anything left None takes its default."""

    slab_counts: tuple[tuple[int, ...], ...] | None = None
    """Per Sharded region (in order), its slabs' layer counts in layer order: rank 0's first, except on a
    region placed on the ranks in reverse (``zbv``'s second, :func:`rank_slabs`), whose first slab is
    rank P-1's."""
    microbatch: tuple[int, ...] | None = None
    """ByMicrobatch owners of the Replicated region: rank of microbatch 0, 1, ...; default round-robin."""
    layer_weights: tuple[float, ...] | None = None
    """Per model layer, the cost used to balance default slabs; default one per layer."""


def derive(
    cut: Cut,
    schedule: Schedule,
    model: Model,
    num_ranks: int,
    num_microbatches: int,
    owners: Owners | None = None,
) -> Plan:
    """Map a valid ``(cut, schedule)`` and a model to placement, collectives and order."""
    owners = owners or Owners()
    P, M = num_ranks, num_microbatches
    if not isinstance(P, int) or P < 1:
        raise MpipeError(f"the pipeline degree P is {P!r}, but P must be an integer >= 1")
    if not isinstance(M, int) or M < 1:
        raise MpipeError(f"the microbatch count M is {M!r}, but M must be an integer >= 1")
    validate_schedule(cut, schedule, model.num_layers)
    if not any(model.trainable_bits()):
        raise MpipeError(f"model '{model.name}' has no trainable layer, so a training step has no backward; unfreeze a block")
    _validate_supported(schedule, P, M)

    placement = _place(cut, schedule, model, P, M, owners)
    region_trainable = [_trainable(model, *p.layers) for p in placement]
    collectives = _collectives(schedule, region_trainable)
    with collector_paused():
        return _build_order(cut, schedule, model, P, M, placement, collectives)


@contextmanager
def collector_paused():
    """Pause Python's cyclic garbage collector while a plan is built (derive's order, the cost model's
    compiled arrays): it is tens of thousands of new tuples and no reference cycle, and the allocations
    alone would start collections that walk them and, several times over, the caller's whole heap (at
    P=32, M=256 those took about half of a new candidate's time in the evaluator benchmark)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _trainable(model: Model, start: int, stop: int) -> bool:
    return any(model.layers[i].trainable for i in range(start, stop))


def _validate_supported(schedule: Schedule, P: int, M: int) -> None:
    layouts = schedule.layouts()
    for j, layout in enumerate(layouts[1:], start=2):
        if layout is Layout.REPLICATED:
            raise NotSupportedError(
                f"schedule '{schedule}': transpose in region {j} (interior or sink) is valid in the algebra but "
                f"not supported yet; use transpose only on region 1"
            )
    sharded = [s for s in schedule.skeletons if s.layout is Layout.SHARDED]
    if not sharded:
        raise NotSupportedError(
            f"schedule '{schedule}': a lone transpose region (the whole model replicated) is a sink transpose, "
            f"not supported yet; add a Sharded region after it, e.g. 'transpose,1f1b'"
        )
    if len(set(sharded)) > 1:
        mixed = " and ".join(sorted({s.value for s in sharded}))
        raise NotSupportedError(
            f"schedule '{schedule}': mixing {mixed} in one wavefront is not supported yet; "
            f"use the same skeleton for every Sharded region"
        )
    if sharded[0].chunk_counts is not None and len(sharded) not in sharded[0].chunk_counts:
        raise MpipeError(
            f"schedule '{schedule}' has {len(sharded)} zbv region(s), but zbv runs exactly two chunks in a V; "
            f"give two zbv regions with a cut between them, e.g. 'zbv,zbv' (or 'transpose,zbv,zbv')"
        )
    if sharded[0].runs_in_rounds and len(sharded) > 1 and not programs.is_interleavable(P, M):
        rounds = programs.num_rounds(P, M)
        below = next(m for m in range(M - 1, 0, -1) if programs.is_interleavable(P, m))
        above = next(m for m in range(M + 1, M + P + 1) if programs.is_interleavable(P, m))
        raise NotSupportedError(
            f"schedule '{schedule}' interleaves {len(sharded)} Sharded regions, which runs the microbatches in "
            f"max(1, M // P) = {rounds} rounds of equal size, so the microbatch count must be a multiple of "
            f"{rounds}; got M={M}, P={P} (use M={below} or M={above})"
        )


def _place(cut: Cut, schedule: Schedule, model: Model, P: int, M: int, owners: Owners) -> tuple[RegionPlacement, ...]:
    weights = owners.layer_weights or (1.0,) * model.num_layers
    assert len(weights) == model.num_layers, "one layer weight per model layer"
    sharded_count = sum(1 for s in schedule.skeletons if s.layout is Layout.SHARDED)
    if owners.slab_counts is not None and len(owners.slab_counts) != sharded_count:
        raise MpipeError(
            f"the slab counts give {len(owners.slab_counts)} region(s) of counts but schedule '{schedule}' has "
            f"{sharded_count} Sharded region(s); give {P} counts per Sharded region, {P * sharded_count} in all"
        )
    placement = []
    sharded_index = 0
    for j, ((start, stop), skeleton) in enumerate(zip(cut.regions(model.num_layers), schedule.skeletons), start=1):
        if skeleton.layout is Layout.REPLICATED:
            mb_owners = owners.microbatch if owners.microbatch is not None else round_robin(M, P)
            validate_owners(mb_owners, P, M)
            placement.append(RegionPlacement(j, (start, stop), Layout.REPLICATED, ByMicrobatch(tuple(mb_owners))))
            continue
        if stop - start < P:
            raise MpipeError(
                f"region {j} ({skeleton.value}) has {stop - start} layer(s) but P={P} ranks each need a slab of at "
                f"least one layer; move the cut or lower the pipeline degree"
            )
        if owners.slab_counts is not None:
            counts = tuple(owners.slab_counts[sharded_index])
            validate_counts(counts, j, stop - start, P)
        else:
            counts = balanced_counts(weights[start:stop], P)
        slabs = rank_slabs(schedule, sharded_index, start, counts)
        placement.append(RegionPlacement(j, (start, stop), Layout.SHARDED, ByLayer(slabs)))
        sharded_index += 1
    return tuple(placement)


def _collectives(schedule: Schedule, region_trainable: Sequence[bool]) -> Collectives:
    gates = footprint(region_trainable)
    layouts = schedule.layouts()
    seams = []
    for j in range(1, len(layouts)):
        fwd, bwd = _SEAM_COMMS[(layouts[j - 1], layouts[j])]
        # Region j+1 (1-based) sends its input gradient iff a region before it is trainable.
        seams.append(Seam(j, j + 1, fwd, bwd if gates.sends_grad[j] else None))
    reduces = tuple(
        (j, Group.REPLICA if layout is Layout.REPLICATED else Group.DATA)
        for j, (layout, reduce) in enumerate(zip(layouts, gates.reduces), start=1)
        if reduce
    )
    return Collectives(tuple(seams), reduces)


class _Builder:
    """Accumulates one microbatch's events and edges; events are added once and referred to by index."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.index: dict[Event, int] = {}
        self.edges: dict[tuple[int, int], EdgeKind] = {}

    def add(self, event: Event) -> int:
        i = self.index.get(event)
        if i is None:
            i = self.index[event] = len(self.events)
            self.events.append(event)
        return i

    def edge(self, src: Event, dst: Event, kind: EdgeKind) -> None:
        self.edges.setdefault((self.add(src), self.add(dst)), kind)


@dataclass(frozen=True)
class StageGates:
    """Lemma 1 per stage of the step (the source region first, then the Sharded stages in wavefront order)."""

    sends: dict[Stage, bool]
    """The stage sends its input gradient upstream."""
    has_bwd: dict[Stage, bool]
    """The stage runs a backward (it receives a gradient)."""
    reduces: dict[Stage, bool]
    """The stage reduces weight gradients over its DataGroup."""
    source_bwd: bool
    """The source region runs its backward (the cooldown)."""
    replica_reduce: DpReduce | None
    """The source region's ReplicaGroup reduce, when it has trainable layers."""


def stage_gates(model: Model, placement: tuple[RegionPlacement, ...], stages: Sequence[Stage],
                source: RegionPlacement | None) -> StageGates:
    """The footprint gates of every stage, from the trainable bits of its layers and their order only."""
    unit_bits = ([_trainable(model, *source.layers)] if source else []) + [
        _trainable(model, *placement[j - 1].owner.slabs[r]) for j, r in stages
    ]
    gates = footprint(unit_bits)
    offset = 1 if source else 0
    return StageGates(
        sends={s: gates.sends_grad[i + offset] for i, s in enumerate(stages)},
        has_bwd={s: gates.receives_grad[i + offset] for i, s in enumerate(stages)},
        reduces={s: gates.reduces[i + offset] for i, s in enumerate(stages)},
        source_bwd=bool(source) and gates.receives_grad[0],
        replica_reduce=DpReduce(source.region, Group.REPLICA) if source and gates.reduces[0] else None,
    )


def _microbatch_edges(b: _Builder, m: int, stages: Sequence[Stage], source: RegionPlacement | None,
                      gates: StageGates, split: bool = False) -> None:
    """Microbatch ``m``'s dataflow: encode and gather, forwards and sends to the loss, then backwards
    with their gradient transfers, accumulates and the scatter back to the encoder's owner. With
    ``split`` a stage that reduces runs its weight gradient as its own event after its backward (the
    output gradient it reads) and that event feeds the reduce."""
    last = stages[-1]
    fwds = [Fwd(j, r, m) for j, r in stages]
    if source:
        owner = source.owner.owners[m]
        enc = Fwd(source.region, owner, m)
        gather = Coll(Comm.GATHER, (source.region, owner), stages[0], m)
        b.edge(enc, gather, EdgeKind.ACTIVATION)
        b.edge(gather, fwds[0], EdgeKind.ACTIVATION)
    for (s, t), f_s, f_t in zip(zip(stages, stages[1:]), fwds, fwds[1:]):
        send = Coll(Comm.SEND, s, t, m)
        b.edge(f_s, send, EdgeKind.ACTIVATION)
        b.edge(send, f_t, EdgeKind.ACTIVATION)
    loss = Loss(m)
    b.edge(fwds[-1], loss, EdgeKind.ACTIVATION)
    if gates.has_bwd[last]:
        b.edge(loss, Bwd(*last, m), EdgeKind.TURNAROUND)
    for i in reversed(range(len(stages))):
        s = stages[i]
        if not gates.has_bwd[s]:
            continue
        bwd = Bwd(*s, m)
        b.edge(fwds[i], bwd, EdgeKind.ACTIVATION)
        if gates.reduces[s] and split:
            weights = Wgrad(*s, m)
            b.edge(bwd, weights, EdgeKind.GRADIENT)
            b.edge(weights, DpReduce(s[0], Group.DATA, s[1]), EdgeKind.ACCUMULATE)
        elif gates.reduces[s]:
            b.edge(bwd, DpReduce(s[0], Group.DATA, s[1]), EdgeKind.ACCUMULATE)
        if not gates.sends[s]:
            continue
        if i > 0:
            grad = Coll(Comm.RECV_GRAD, s, stages[i - 1], m)
            b.edge(bwd, grad, EdgeKind.GRADIENT)
            b.edge(grad, Bwd(*stages[i - 1], m), EdgeKind.GRADIENT)
        else:
            assert source is not None
            owner = source.owner.owners[m]
            scatter = Coll(Comm.SCATTER, s, (source.region, owner), m)
            enc_bwd = Bwd(source.region, owner, m)
            b.edge(bwd, scatter, EdgeKind.GRADIENT)
            b.edge(scatter, enc_bwd, EdgeKind.GRADIENT)
            b.edge(Fwd(source.region, owner, m), enc_bwd, EdgeKind.ACTIVATION)
            if gates.replica_reduce:
                b.edge(enc_bwd, gates.replica_reduce, EdgeKind.ACCUMULATE)


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
"""Per Sharded skeleton, ``(rank, P, M, v) -> program`` (see :mod:`mpipe_tune.algebra.order`)."""


def rank_program(skeleton: Skeleton, rank: int, P: int, M: int, v: int) -> programs.Program:
    """Rank ``rank``'s ``(op, chunk, mb)`` program in a wavefront of ``v`` regions of ``skeleton``."""
    return PROGRAMS[skeleton](rank, P, M, v)


def wavefront_stages(skeleton: Skeleton, sharded: Sequence[int], P: int) -> list[Stage]:
    """The Sharded stages in wavefront order: every region's ranks in increasing order, except that
    ``zbv`` places its second region in a V, on the ranks in decreasing order (rank r runs stages r and
    2P-1-r, so the last stage, and the loss, are on rank 0; :func:`_place` gives rank P-1 that
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


def _rank_events(rank: int, program: programs.Program, sharded: Sequence[int], source: RegionPlacement | None,
                 gates: StageGates, last: Stage, flow: _Flow, barrier: int) -> tuple[int, ...]:
    """A rank's event list (as indices: ``flow.events``, then the barrier): its encodes, its program's forwards (the loss
    after the last stage's), gated backwards and weight gradients (split skeletons), its encoder cooldown, its
    reduces and the barrier."""
    seq: list[int] = []
    mine = source.owner.microbatches_of(rank) if source else ()
    if source:
        encode = flow.per_microbatch(Fwd(source.region, source.owner.owners[0], 0))
        seq.extend(encode[m] for m in mine)
    fwd = [flow.per_microbatch(Fwd(j, rank, 0)) for j in sharded]
    bwd = [flow.per_microbatch(Bwd(j, rank, 0)) if gates.has_bwd[(j, rank)] else None for j in sharded]
    weights = [flow.per_microbatch(Wgrad(j, rank, 0)) if Wgrad(j, rank, 0) in flow.template else None
               for j in sharded]
    loss = flow.per_microbatch(Loss(0)) if (sharded[-1], rank) == last else None
    for op, chunk, m in program:
        if op == "F":
            seq.append(fwd[chunk][m])
            if loss is not None and chunk == len(sharded) - 1:
                seq.append(loss[m])
        elif op == "B" and bwd[chunk] is not None:
            seq.append(bwd[chunk][m])
        elif op == "W" and weights[chunk] is not None:
            seq.append(weights[chunk][m])
    if gates.source_bwd:
        encoder_bwd = flow.per_microbatch(Bwd(source.region, source.owner.owners[0], 0))
        seq.extend(encoder_bwd[m] for m in mine)
    if gates.replica_reduce is not None:
        seq.append(flow.index_of(gates.replica_reduce))
    seq.extend(flow.index_of(DpReduce(j, Group.DATA, rank)) for j in sharded if gates.reduces[(j, rank)])
    seq.append(barrier)
    return tuple(seq)


def _build_order(
    cut: Cut, schedule: Schedule, model: Model, P: int, M: int,
    placement: tuple[RegionPlacement, ...], collectives: Collectives,
) -> Plan:
    source = source_of(placement)
    sharded = [p.region for p in placement if p.layout is Layout.SHARDED]
    v = len(sharded)
    skeleton = next(s for s in schedule.skeletons if s.layout is Layout.SHARDED)
    stages = wavefront_stages(skeleton, sharded, P)
    gates = stage_gates(model, placement, stages, source)

    template = _Builder()
    _microbatch_edges(template, 0, stages, source, gates, skeleton.splits_backward)
    flow = _every_microbatch(template, M, source)
    barrier = len(flow.events)
    reduces = [flow.index_of(e) for e in template.events if isinstance(e, DpReduce)]

    nodes = tuple(_rank_events(r, rank_program(skeleton, r, P, M, v), sharded, source, gates, stages[-1], flow,
                               barrier)
                  for r in range(P))
    src = np.concatenate((flow.src, reduces)).astype(np.int64)
    dst = np.concatenate((flow.dst, [barrier] * len(reduces))).astype(np.int64)
    seq_src, seq_dst = _sequence_edges(nodes, src, dst)
    src, dst = np.concatenate((src, seq_src)), np.concatenate((dst, seq_dst))
    kinds = flow.kinds + [EdgeKind.SEQUENCE] * (len(reduces) + len(seq_src))
    events = (*flow.events, StepBarrier())

    edges = tuple(zip(src.tolist(), dst.tolist(), kinds))
    topo = _kahn(len(events), src, dst)
    assert topo is not None, "derive built a cyclic order"
    order = Order(events=events, edges=edges, nodes=nodes, topo=tuple(topo))
    return Plan(cut, schedule, P, M, placement, collectives, order, tuple(stages))


@dataclass(frozen=True)
class _Flow:
    """The dataflow edges of every microbatch: events in order of first use, edges as index columns."""

    events: list[Event]
    src: np.ndarray
    dst: np.ndarray
    kinds: list[EdgeKind]
    template: dict[Event, int]
    """Microbatch 0's events (the reduces among them): their column in ``ids``."""
    ids: np.ndarray
    """``ids[m, k]``: the index in ``events`` of template event ``k`` as it is in microbatch ``m``."""

    def per_microbatch(self, event: Event) -> list[int]:
        """Per microbatch m, the index of microbatch 0's ``event`` as it is in microbatch m."""
        return self.ids[:, self.template[event]].tolist()

    def index_of(self, shared: Event) -> int:
        """The index of an event every microbatch shares (a reduce)."""
        return self.template[shared]


def _every_microbatch(template: _Builder, M: int, source: RegionPlacement | None) -> _Flow:
    """Microbatch 0's dataflow (``template``) repeated for microbatches 0..M-1, as derive would add them one
    microbatch after another: every microbatch has the same events and edges but its own ``mb`` (and, on
    the source region, its own owner); only the reduces are shared, first met in microbatch 0."""
    first = template.events
    shared = [isinstance(e, DpReduce) for e in first]
    own = [k for k, is_shared in enumerate(shared) if not is_shared]
    width = len(own)
    ids = np.empty((M, len(first)), dtype=np.int64)
    ids[0] = np.arange(len(first))
    ids[1:, own] = len(first) + width * np.arange(M - 1)[:, None] + np.arange(width)
    ids[1:, np.flatnonzero(shared)] = np.flatnonzero(shared)
    rest: list[Event] = [None] * (width * (M - 1))  # type: ignore[list-item]
    owners = source.owner.owners if source else ()
    for position, k in enumerate(own):
        rest[position::width] = _for_microbatches(first[k], range(1, M), owners, source.region if source else 0)
    t_src, t_dst = np.array(list(template.edges), dtype=np.int64).reshape(-1, 2).T
    assert not any(shared[s] and shared[t] for s, t in zip(t_src, t_dst)), "every edge has a per-microbatch end"
    return _Flow(first + rest, ids[:, t_src].ravel(), ids[:, t_dst].ravel(), list(template.edges.values()) * M,
                 template.index, ids)


_new = tuple.__new__  # builds an event from its fields without the named tuple's Python-level __new__


def _for_microbatches(event: Event, mbs: range, owners: Sequence[int], source_region: int) -> list[Event]:
    """Microbatch 0's ``event`` as it is in each microbatch of ``mbs``: the same event with that ``mb``,
    run by (or sent from or to) that microbatch's owner when it is on the source region."""
    cls, tag = type(event), event[-1]
    if tag == "L":
        return [_new(cls, (m, tag)) for m in mbs]
    if tag in "FBW":
        region, rank = event[0], event[1]
        if region == source_region:
            return [_new(cls, (region, owners[m], m, tag)) for m in mbs]
        return [_new(cls, (region, rank, m, tag)) for m in mbs]
    comm, s, t = event[0], event[1], event[2]
    if s[0] == source_region:
        return [_new(cls, (comm, (s[0], owners[m]), t, m, tag)) for m in mbs]
    if t[0] == source_region:
        return [_new(cls, (comm, s, (t[0], owners[m]), m, tag)) for m in mbs]
    return [_new(cls, (comm, s, t, m, tag)) for m in mbs]


def _sequence_edges(nodes: Sequence[Sequence[int]], src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's Sequence edges (consecutive events, rank after rank) that no earlier edge joins already."""
    flat = np.fromiter(chain.from_iterable(nodes), dtype=np.int64, count=sum(map(len, nodes)))
    last = np.cumsum([len(n) for n in nodes]) - 1
    joined = np.ones(len(flat), dtype=bool)
    joined[last] = False  # a rank's last event starts no Sequence edge
    a = flat[joined]
    c = flat[np.flatnonzero(joined) + 1]
    # Keep a pair where it is the first of its key among the earlier edges' keys and the pairs before it.
    keys = np.concatenate((src << 32 | dst, a << 32 | c))
    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    first = np.zeros(len(keys), dtype=bool)
    first[by_key[np.concatenate(([True], sorted_keys[1:] != sorted_keys[:-1]))]] = True
    keep = first[len(src):]
    return a[keep], c[keep]


def topological_order(num_events: int, edges: Sequence[tuple[int, int, EdgeKind]]) -> list[int] | None:
    """Kahn's algorithm, lowest index first among ready events; None when the graph has a cycle."""
    src = np.fromiter((e[0] for e in edges), dtype=np.int64, count=len(edges))
    dst = np.fromiter((e[1] for e in edges), dtype=np.int64, count=len(edges))
    return _kahn(num_events, src, dst)


def _kahn(num_events: int, src: np.ndarray, dst: np.ndarray) -> list[int] | None:
    """:func:`topological_order` over edge columns: the ready events are a stack, initially every source
    with the lowest index on top; an event's successors are released in the order of its edges."""
    by_source = np.argsort(src, kind="stable")
    succ = dst[by_source].tolist()
    ptr = np.zeros(num_events + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=num_events), out=ptr[1:])
    ptr = ptr.tolist()
    indegree = np.bincount(dst, minlength=num_events).tolist()
    ready = np.flatnonzero(np.array(indegree) == 0)[::-1].tolist()
    order: list[int] = []
    pop, push, run = ready.pop, ready.append, order.append
    while ready:
        i = pop()
        run(i)
        for t in succ[ptr[i]:ptr[i + 1]]:
            indegree[t] -= 1
            if not indegree[t]:
                push(t)
    return order if len(order) == num_events else None
