"""``derive(cut, schedule, model, P, M, owners) -> Plan``: placement, collectives and order.

The IR it returns (:class:`~mpipe_tune.algebra._plan.Plan`, its ``Order``) lives in
:mod:`mpipe_tune.algebra._plan`. ``derive`` is a composition of small passes, each a pure function:

1. :func:`_place`: the placement of every region (ByLayer slabs, ByMicrobatch owners);
2. :func:`_collectives`: the seam table and the reduces, gated per region by Lemma 1
   (:mod:`mpipe_tune.algebra._footprint`);
3. :func:`stage_gates`: the same gates per unit of the step's chain (each Replicated region, each
   Sharded stage), in input-to-loss order;
4. :func:`_microbatch_edges`: one microbatch's activation, turnaround, gradient and accumulate edges,
   built for microbatch 0 and repeated for every microbatch as event rows and edge index columns by
   :func:`_every_microbatch` (a skeleton that splits its backwards, ``zb1p`` and ``zbv``, adds
   ``Bwd -> Wgrad -> reduce`` for every stage that reduces, in place of ``Bwd -> reduce``);
5. :func:`rank_program`: each rank's per-skeleton program (:data:`PROGRAMS`, one function per Sharded
   skeleton: a new skeleton is one entry there), lowered to its event indices for every rank at once by
   :func:`_rank_events`;
   its owned encoder backwards then move where the placement puts them, on their owners or, under
   recomputation, on other ranks (:func:`mpipe_tune.algebra._encoder_backward.arrange`,
   :func:`~mpipe_tune.algebra._encoder_backward.moved_events`; the cooldown leaves them where they are);
   an interior or sink transpose's events are then placed into their owners' lists where their data
   arrives (:func:`mpipe_tune.algebra._transpose_order.place_owned_events`);
   the stages' wavefront order is :func:`wavefront_stages` (``zbv``'s second region in a V);
6. :func:`topological_order`: a deadlock-free execution of the graph (Kahn's, a kernel).

The order is built as columns (:class:`~mpipe_tune.algebra._plan.OrderColumns`): the event, edge and
list tuples of :class:`~mpipe_tune.algebra._plan.Order` are made from them on first use, and the cost
model compiles the columns without them. Steps 3-6 read the placement only through the owner map and
the units' trainable bits (not the Sharded slabs, except around an interior or sink transpose), so
:func:`_order` keeps the last orders it built by those inputs: candidates that differ only in their
slabs (as a search's do) share one order object. Microbatch 0's dataflow and the programs are kept
the same way, as pure functions of their arguments.

Every Replicated region of a schedule (a source, interior or sink transpose) shares the one owner map
``Owners.microbatch``: microbatch ``m``'s work in each of them runs on rank ``owners[m]``. One map is
what a candidate, the plan file and the owner policies carry, and it keeps a microbatch's replicated
activations on one rank.

The plain build these passes replace (every microbatch's edges and every rank's events de-duplicated
through dictionaries) is the reference of ``tests/algebra/test_derive_reference.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from contextlib import contextmanager
from functools import cached_property, lru_cache
from dataclasses import dataclass, replace

import numpy as np

from mpipe_tune.algebra import _encoder_backward as encoder_backwards, _order as programs
from mpipe_tune.algebra._transpose_order import place_owned_events
from mpipe_tune.algebra._events import (
    Bwd, Coll, Comm, DpReduce, EdgeKind, Event, Fwd, Group, Loss, Stage, StepBarrier, Wgrad,
)
from mpipe_tune.algebra._footprint import footprint
from mpipe_tune.algebra._model import Model
from mpipe_tune.algebra._placement import (
    ByLayer, ByMicrobatch, RegionPlacement, balanced_counts, round_robin, validate_counts, validate_owners,
)
from mpipe_tune.algebra._plan import (
    BARRIER, COLL, EDGE_KINDS, REDUCE, Collectives, Order, OrderColumns, Plan, Seam, event_rows, events_of_rows,
    is_source, replicated_of, source_of,
)
from mpipe_tune.algebra._schedule import Cut, Layout, Schedule, Skeleton, validate_schedule
from mpipe_tune.algebra._stages import (  # noqa: F401  (PROGRAMS, rank_program: derive's public names before the split)
    _OPS, PROGRAMS, _programs, rank_program, rank_slabs, wavefront_stages,
)
from mpipe_tune.algebra._topology import sequence_edges, sort_topologically, topological_order  # noqa: F401
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
    """ByMicrobatch owners of every Replicated region (one map, shared): rank of microbatch 0, 1, ...;
    default round-robin."""
    layer_weights: tuple[float, ...] | None = None
    """Per model layer, the cost used to balance default slabs; default one per layer."""


def derive(
    cut: Cut,
    schedule: Schedule,
    model: Model,
    num_ranks: int,
    num_microbatches: int,
    owners: Owners | None = None,
    encoder_backward: encoder_backwards.EncoderBackward | None = None,
) -> Plan:
    """Map a valid ``(cut, schedule)`` and a model to placement, collectives and order; ``encoder_backward``
    places the owned encoder backwards (:mod:`mpipe_tune.algebra._encoder_backward`; default: the cooldown)."""
    owners = owners or Owners()
    encoder_backward = encoder_backward or encoder_backwards.EncoderBackward()
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
        return _build_order(cut, schedule, model, P, M, placement, collectives, encoder_backward)


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


Unit = tuple[int, "int | None"]
"""One link of a microbatch's chain: a Sharded stage ``(region, rank)``, or a Replicated region
``(region, None)`` (run by the microbatch's owner)."""


def unit_chain(placement: Sequence[RegionPlacement], stages: Sequence[Stage]) -> tuple[Unit, ...]:
    """The units a microbatch passes through, input to loss: the regions in order, a Sharded region
    as its stages (in rank order, as in ``stages``), a Replicated region as one unit."""
    by_region: dict[int, list[Unit]] = {}
    for j, r in stages:
        by_region.setdefault(j, []).append((j, r))
    return tuple(u for p in placement
                 for u in (by_region[p.region] if p.layout is Layout.SHARDED else [(p.region, None)]))


@dataclass(frozen=True)
class StageGates:
    """Lemma 1 per unit of the step's chain (:func:`unit_chain`: the Replicated regions and the Sharded
    stages, input to loss); a Sharded stage's key is its ``(region, rank)``, a Replicated region's
    ``(region, None)``."""

    chain: tuple[Unit, ...]
    sends: dict[Unit, bool]
    """The unit sends its input gradient upstream."""
    has_bwd: dict[Unit, bool]
    """The unit runs a backward (it receives a gradient)."""
    reduces: dict[Unit, bool]
    """The unit reduces weight gradients (a stage over its DataGroup, a Replicated region over the ReplicaGroup)."""
    source_bwd: bool
    """The source region runs its backward (the cooldown)."""
    replica_reduce: DpReduce | None
    """The source region's ReplicaGroup reduce, when it has trainable layers."""

    def reduce_of(self, unit: Unit) -> DpReduce:
        region, rank = unit
        return DpReduce(region, Group.REPLICA) if rank is None else DpReduce(region, Group.DATA, rank)


def stage_gates(model: Model, placement: tuple[RegionPlacement, ...], stages: Sequence[Stage]) -> StageGates:
    """The footprint gates of every unit, from the trainable bits of its layers and their order only."""
    chain = unit_chain(placement, stages)
    source = source_of(placement)
    return gates_of(chain, unit_bits(model, placement, chain), source.region if source else None)


def unit_bits(model: Model, placement: tuple[RegionPlacement, ...], chain: Sequence[Unit]) -> tuple[bool, ...]:
    """Per unit of ``chain``, whether any of its layers is trainable."""
    return tuple(_trainable(model, *(placement[j - 1].layers if r is None else placement[j - 1].owner.slabs[r]))
                 for j, r in chain)


def gates_of(chain: tuple[Unit, ...], bits: Sequence[bool], source_region: int | None) -> StageGates:
    """:func:`stage_gates` from the units' trainable ``bits`` and the Replicated source region (None without one)."""
    gates = footprint(bits)
    source = source_region is not None
    return StageGates(
        chain=chain,
        sends=dict(zip(chain, gates.sends_grad)),
        has_bwd=dict(zip(chain, gates.receives_grad)),
        reduces=dict(zip(chain, gates.reduces)),
        source_bwd=source and gates.receives_grad[0],
        replica_reduce=DpReduce(source_region, Group.REPLICA) if source and gates.reduces[0] else None,
    )


def _link_comms(upstream: Unit, downstream: Unit) -> tuple[Comm, Comm]:
    """The forward and backward transfer between two consecutive units: Send / RecvGrad inside a
    region or between Sharded regions, else the seam's pair (:data:`_SEAM_COMMS`)."""
    layout = [Layout.REPLICATED if u[1] is None else Layout.SHARDED for u in (upstream, downstream)]
    return _SEAM_COMMS[(layout[0], layout[1])]


def _microbatch_edges(b: _Builder, m: int, gates: StageGates, owners: Sequence[int], split: bool = False) -> None:
    """Microbatch ``m``'s dataflow along the chain: forwards and the transfers between them to the
    loss, then the gated backwards with their gradient transfers and accumulates. A Replicated unit
    runs on ``owners[m]``. With ``split`` a Sharded stage that reduces runs its weight gradient as its
    own event after its backward (the output gradient it reads) and that event feeds the reduce."""
    chain = gates.chain
    at = [(j, owners[m] if r is None else r) for j, r in chain]
    fwds = [Fwd(*s, m) for s in at]
    for i in range(1, len(chain)):
        comm = Coll(_link_comms(chain[i - 1], chain[i])[0], at[i - 1], at[i], m)
        b.edge(fwds[i - 1], comm, EdgeKind.ACTIVATION)
        b.edge(comm, fwds[i], EdgeKind.ACTIVATION)
    loss = Loss(m)
    b.edge(fwds[-1], loss, EdgeKind.ACTIVATION)
    if gates.has_bwd[chain[-1]]:
        b.edge(loss, Bwd(*at[-1], m), EdgeKind.TURNAROUND)
    for i in reversed(range(len(chain))):
        u = chain[i]
        if not gates.has_bwd[u]:
            continue
        bwd = Bwd(*at[i], m)
        b.edge(fwds[i], bwd, EdgeKind.ACTIVATION)
        if gates.reduces[u] and split and u[1] is not None:
            weights = Wgrad(*at[i], m)
            b.edge(bwd, weights, EdgeKind.GRADIENT)
            b.edge(weights, gates.reduce_of(u), EdgeKind.ACCUMULATE)
        elif gates.reduces[u]:
            b.edge(bwd, gates.reduce_of(u), EdgeKind.ACCUMULATE)
        if not gates.sends[u]:
            continue
        grad = Coll(_link_comms(chain[i - 1], u)[1], at[i], at[i - 1], m)
        b.edge(bwd, grad, EdgeKind.GRADIENT)
        b.edge(grad, Bwd(*at[i - 1], m), EdgeKind.GRADIENT)


def _rank_events(skeleton: Skeleton, P: int, M: int, sharded: Sequence[int], source: RegionPlacement | None,
                 gates: StageGates, flow: _Flow, barrier: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's event list (as indices: ``flow.events``, then the barrier): its encodes, its program's forwards
    (the loss after the last stage's), gated backwards and weight gradients (split skeletons), its encoder cooldown,
    its reduces and the barrier. The programs are lowered to event indices for every rank at once: a step runs
    template event ``column[rank, op, chunk]`` (-1: none, a gated backward) as it is in its microbatch."""
    rank, op, chunk, mb = _programs(skeleton, P, M, len(sharded))
    column = np.full((P, len(_OPS), len(sharded)), -1, dtype=np.int64)
    for r in range(P):
        for c, j in enumerate(sharded):
            column[r, 0, c] = flow.template[Fwd(j, r, 0)]
            if gates.has_bwd[(j, r)]:
                column[r, 1, c] = flow.template[Bwd(j, r, 0)]
            column[r, 2, c] = flow.template.get(Wgrad(j, r, 0), -1)
    k = column[rank, op, chunk]
    steps = np.full((len(k), 2), -1, dtype=np.int64)  # per step: its event, then the loss after the last forward
    steps[:, 0] = np.where(k >= 0, flow.ids[mb, k], -1)
    last_stage, last_rank = gates.chain[-1]
    if last_stage == sharded[-1]:
        loss = (op == 0) & (chunk == len(sharded) - 1) & (rank == last_rank)
        steps[loss, 1] = flow.ids[mb[loss], flow.template[Loss(0)]]
    keep = (steps >= 0).ravel()
    steps, of_rank = steps.ravel()[keep], np.repeat(rank, 2)[keep]
    bounds = np.searchsorted(of_rank, np.arange(P + 1)).tolist()
    steps = steps.tolist()
    owned: list[list[int]] = [[] for _ in range(P)]  # per rank, the microbatches it owns, in increasing order
    if source:
        owners = source.owner.owners
        encode = flow.per_microbatch(Fwd(source.region, owners[0], 0))
        encoder_bwd = flow.per_microbatch(Bwd(source.region, owners[0], 0)) if gates.source_bwd else None
        for m, r in enumerate(owners):
            owned[r].append(m)
    nodes = []
    for r, mine in enumerate(owned):
        seq = [encode[m] for m in mine]
        seq += steps[bounds[r]:bounds[r + 1]]
        if gates.source_bwd:
            seq += [encoder_bwd[m] for m in mine]
        if gates.replica_reduce is not None:
            seq.append(flow.index_of(gates.replica_reduce))
        seq.extend(flow.index_of(DpReduce(j, Group.DATA, r)) for j in sharded if gates.reduces[(j, r)])
        seq.append(barrier)
        nodes.append(tuple(seq))
    return tuple(nodes)


def _build_order(
    cut: Cut, schedule: Schedule, model: Model, P: int, M: int,
    placement: tuple[RegionPlacement, ...], collectives: Collectives,
    encoder_backward: encoder_backwards.EncoderBackward,
) -> Plan:
    sharded = [p.region for p in placement if p.layout is Layout.SHARDED]
    replicated = replicated_of(placement)
    skeleton = next(s for s in schedule.skeletons if s.layout is Layout.SHARDED)
    stages = tuple(wavefront_stages(skeleton, sharded, P))
    chain = unit_chain(placement, stages)
    inner = any(p.region > 1 for p in replicated)  # Plan.inner_transposes: placed by their layers' costs
    order = _order(schedule, P, M, replicated, chain, unit_bits(model, placement, chain), encoder_backward,
                   placement if inner else None)
    return Plan(cut, schedule, P, M, placement, collectives, order, stages)


ORDERS_KEPT = 16
"""How many orders :func:`_order` keeps (the last used)."""


@lru_cache(maxsize=ORDERS_KEPT)
def _order(schedule: Schedule, P: int, M: int, replicated: tuple[RegionPlacement, ...], chain: tuple[Unit, ...],
           bits: tuple[bool, ...], encoder_backward: encoder_backwards.EncoderBackward,
           placement: tuple[RegionPlacement, ...] | None) -> Order:
    """The order of a placement, from what it reads and nothing else: the schedule, P and M, the Replicated
    regions (their owner map), the step's chain of units with their trainable bits (the footprint gates),
    the encoder backward placement and, with an interior or sink transpose, the whole ``placement`` (its
    events go where the layer counts put them). The Sharded slabs themselves are not read, so the
    candidates that differ only there (other slabs, other cuts with the same gates) share one order:
    it is an immutable value, built once and kept for the last :data:`ORDERS_KEPT` of them."""
    source = replicated[0] if replicated and is_source(replicated[0]) else None
    sharded = [j for j, s in enumerate(schedule.skeletons, start=1) if s.layout is Layout.SHARDED]
    owners = replicated[0].owner.owners if replicated else ()
    skeleton = next(s for s in schedule.skeletons if s.layout is Layout.SHARDED)
    stages = wavefront_stages(skeleton, sharded, P)
    gates = gates_of(chain, bits, source.region if source else None)

    template = _template(chain, bits, source.region if source else None, owners[:1], skeleton.splits_backward)
    flow = _every_microbatch(template, M, owners, frozenset(p.region for p in replicated))
    barrier = len(flow.rows)
    reduces = [flow.index_of(e) for e in template.events if isinstance(e, DpReduce)]

    nodes = _rank_events(skeleton, P, M, sharded, source, gates, flow, barrier)
    encoder_backward.validate(M, gates.source_bwd, P)
    inner = [p for p in replicated if p.region > 1]  # Plan.inner_transposes
    if gates.source_bwd and not encoder_backward.is_cooldown:
        if inner:
            raise NotSupportedError(
                f"schedule '{schedule}': placing the encoder backwards ({encoder_backward.placement}) beside an "
                f"interior or sink transpose is not supported yet; use the cooldown placement with this schedule")
        if encoder_backward.ranks is not None:  # moved backwards: their events and Scatters on their new ranks
            flow = flow.with_events(encoder_backwards.moved_events(flow.events, encoder_backward.ranks,
                                                                   source_region=source.region))
        nodes = encoder_backwards.arrange(
            encoder_backward, nodes, (*flow.events, StepBarrier()), flow.src, flow.dst, source_region=source.region,
            first_stage=stages[0], owners=source.owner.owners)
    if inner:
        nodes = _place_owned(nodes, flow, barrier, placement, gates, inner)
    src = np.concatenate((flow.src, reduces)).astype(np.int64)
    dst = np.concatenate((flow.dst, [barrier] * len(reduces))).astype(np.int64)
    seq_src, seq_dst = sequence_edges(nodes, src, dst)
    src, dst = np.concatenate((src, seq_src)), np.concatenate((dst, seq_dst))
    kinds = np.concatenate((flow.kinds, np.full(len(reduces) + len(seq_src), _SEQUENCE, dtype=np.int64)))
    rows = np.concatenate((flow.rows, [[BARRIER] + [-1] * 7])).T.copy()  # one contiguous row per column

    topo = sort_topologically(len(rows[0]), src, dst)
    assert topo is not None, "derive built a cyclic order"
    columns = OrderColumns(*rows, src, dst, kinds, tuple(np.array(n, dtype=np.int64) for n in nodes), topo)
    return Order.from_columns(columns, nodes=nodes)


_SEQUENCE = EDGE_KINDS.index(EdgeKind.SEQUENCE)


def _place_owned(nodes: tuple[tuple[int, ...], ...], flow: _Flow, barrier: int, placement: tuple[RegionPlacement, ...],
                 gates: StageGates, owned_regions: Sequence[RegionPlacement]) -> tuple[tuple[int, ...], ...]:
    """The ranks' lists with the interior and sink transposes' events placed by their owners
    (:func:`~mpipe_tune.algebra._transpose_order.place_owned_events`): each region's forwards and gated
    backwards, a sink's losses, and each trainable region's ReplicaGroup reduce before the barrier."""
    regions = {p.region for p in owned_regions}
    sink = gates.chain[-1][1] is None
    events = flow.events
    # Proxy durations (:mod:`~mpipe_tune.algebra._transpose_order`): a Sharded stage's forward one unit
    # (the balanced pipeline its slabs aim at), an owned region's its layers over the mean slab's, a
    # backward twice its forward; a source's encodes none (Mpipe hides them in the warmup idle time).
    sharded_layers = [stop - start for p in placement if isinstance(p.owner, ByLayer) for start, stop in p.owner.slabs]
    unit = {p.region: (p.layers[1] - p.layers[0]) * len(sharded_layers) / sum(sharded_layers) for p in owned_regions}
    owned: dict[int, int] = {}
    weight = np.zeros(barrier + 1)
    for i, e in enumerate(events):
        tag = e[-1]
        if tag in "FB":
            p = placement[e[0] - 1]
            forward = 1.0 if isinstance(p.owner, ByLayer) else unit.get(e[0], 0.0)
            weight[i] = forward if tag == "F" else 2 * forward
            if e[0] in regions:
                owned[i] = e[1]
        elif tag == "L" and sink:
            owned[i] = placement[-1].owner.owners[e[0]]
    is_tail = np.zeros(barrier + 1, dtype=bool)
    is_tail[barrier] = True
    is_tail[[i for i, e in enumerate(events) if isinstance(e, DpReduce)]] = True
    extra = [flow.index_of(gates.reduce_of((p.region, None))) for p in owned_regions if gates.reduces[(p.region, None)]]
    return place_owned_events(nodes, barrier + 1, flow.src, flow.dst, owned, weight, is_tail, extra)


@dataclass(frozen=True)
class _Flow:
    """The dataflow edges of every microbatch: events in order of first use as rows (``event_rows``),
    edges as index columns."""

    rows: np.ndarray
    """One row per event (:func:`~mpipe_tune.algebra._plan.event_rows`)."""
    src: np.ndarray
    dst: np.ndarray
    kinds: np.ndarray
    """Per edge, its kind's code in :data:`~mpipe_tune.algebra._plan.EDGE_KINDS`."""
    template: dict[Event, int]
    """Microbatch 0's events (the reduces among them): their column in ``ids``."""
    ids: np.ndarray
    """``ids[m, k]``: the index in ``events`` of template event ``k`` as it is in microbatch ``m``."""

    @cached_property
    def events(self) -> list[Event]:
        """The events as objects (made on first use: only the placements that read events need them)."""
        return events_of_rows(*self.rows.T.tolist())

    def with_events(self, events: list[Event]) -> "_Flow":
        """The same flow with ``events`` (the same indices) in place of its own: moved encoder backwards."""
        out = replace(self, rows=event_rows(events))
        vars(out)["events"] = events
        return out

    def per_microbatch(self, event: Event) -> list[int]:
        """Per microbatch m, the index of microbatch 0's ``event`` as it is in microbatch m."""
        return self.ids[:, self.template[event]].tolist()

    def index_of(self, shared: Event) -> int:
        """The index of an event every microbatch shares (a reduce)."""
        return self.template[shared]


_REGION, _RANK, _MB, _OTHER_REGION, _OTHER_RANK = 1, 2, 3, 5, 6  # columns of an event row
_EDGE_CODES = {kind: code for code, kind in enumerate(EDGE_KINDS)}


@dataclass(frozen=True)
class _Template:
    """Microbatch 0's dataflow (:func:`_microbatch_edges`): its events in order of first use, as objects
    and as rows, and its edges as index columns with their kinds' codes."""

    events: list[Event]
    index: dict[Event, int]
    rows: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    kinds: np.ndarray


@lru_cache(maxsize=64)
def _template(chain: tuple[Unit, ...], bits: tuple[bool, ...], source_region: int | None, first_owner: tuple[int, ...],
              split: bool) -> _Template:
    """Microbatch 0's dataflow along ``chain`` with its units' trainable ``bits``, its Replicated units run by
    ``first_owner`` (microbatch 0's owner, or none); ``split``: split backwards. A pure function of its
    arguments, kept for the last 64 of them."""
    b = _Builder()
    _microbatch_edges(b, 0, gates_of(chain, bits, source_region), first_owner, split)
    src, dst = np.array(list(b.edges), dtype=np.int64).reshape(-1, 2).T
    kinds = np.fromiter(map(_EDGE_CODES.__getitem__, b.edges.values()), dtype=np.int64, count=len(b.edges))
    rows = event_rows(b.events)
    for a in (rows, src, dst, kinds):
        a.flags.writeable = False
    return _Template(b.events, b.index, rows, src, dst, kinds)


def _every_microbatch(template: _Template, M: int, owners: Sequence[int], replicated: frozenset[int]) -> _Flow:
    """Microbatch 0's dataflow (``template``) repeated for microbatches 0..M-1, as derive would add them one
    microbatch after another: every microbatch has the same events and edges but its own ``mb`` and, on
    the ``replicated`` regions, its own owner: the rank of a stage event there, and the end there of a
    transfer (a transfer has at most one such end: normal form puts no two Replicated regions side by
    side). Only the reduces are shared, first met in microbatch 0."""
    first = template.rows
    shared = first[:, 0] == REDUCE
    own = np.flatnonzero(~shared)
    width = len(own)
    ids = np.empty((M, len(first)), dtype=np.int64)
    ids[0] = np.arange(len(first))
    ids[1:, own] = len(first) + width * np.arange(M - 1)[:, None] + np.arange(width)
    ids[1:, shared] = np.flatnonzero(shared)
    per_mb = first[own]
    rest = np.repeat(per_mb[None], M - 1, axis=0)  # rest[m - 1, k]: template event own[k] in microbatch m
    rest[:, :, _MB] = np.arange(1, M)[:, None]
    if replicated:
        owner = np.asarray(owners, dtype=np.int64)[1:, None]
        regions = per_mb[:, [_REGION, _OTHER_REGION]]
        is_replicated = np.zeros(regions.max() + 2, dtype=bool)  # by region; the last entry: region -1
        is_replicated[list(replicated)] = True
        on = is_replicated[regions]
        rest[:, on[:, 0], _RANK] = owner
        rest[:, on[:, 1] & (per_mb[:, 0] == COLL), _OTHER_RANK] = owner
    t_src, t_dst = template.src, template.dst
    assert not (shared[t_src] & shared[t_dst]).any(), "every edge has a per-microbatch end"
    return _Flow(np.concatenate((first, rest.reshape(-1, first.shape[1]))), ids[:, t_src].ravel(),
                 ids[:, t_dst].ravel(), np.tile(template.kinds, M), template.index, ids)
