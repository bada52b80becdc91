"""A compiled plan: derive once, then evaluate any layer table with array passes only.

:class:`CompiledPlan` holds a derived plan as three compiled parts, each an array form of one
readable pass: the order (:class:`~mpipe_tune.cost._timing.CompiledOrder`: topological order,
predecessors, ranks), the durations (:class:`~mpipe_tune.cost._durations.DurationModel`: slab
and tensor indices, link rates, reduce costs) and the live tensors
(:class:`~mpipe_tune.cost._memory.MemoryLayout`). ``predict`` and the search's evaluator both read
a step through it: :meth:`~CompiledPlan.timeline`, :meth:`~CompiledPlan.memory`,
:meth:`~CompiledPlan.static_bytes`, and :meth:`~CompiledPlan.makespan` for the search's hot loop.

**Owner maps without re-deriving.** The transposed region's owner map decides only which rank runs
each microbatch's encode ``Fwd(1, owner, m)`` and its backward, and which rank the Gather leaves
and the Scatter reaches. :meth:`~CompiledPlan.with_owners` moves exactly those events: each rank's
list becomes its owned encodes, its unchanged backbone program, its owned encoder backwards and
its unchanged reduces; the graph keeps every non-sequence edge and takes the new ranks' sequence
edges; the moved transfers take their new link's rate (free on one rank) and the moved tensors
their new rank; the data-parallel reduces' overlap (:mod:`~mpipe_tune.cost._overlap`), which reads
the ranks' orders, is compiled again for them. Event indices stay those of ``derive`` with the new
owners (derive numbers events by microbatch, whoever owns it), so the result equals a fresh derive
and predict; :attr:`CompiledPlan.plan` builds that plan itself when asked. A plan with an interior or
sink transpose places that region's events inside the wavefront by its owners
(:mod:`mpipe_tune.algebra._transpose_order`), so a new owner map there is derived and compiled again.

**Encoder backwards placed without re-deriving.** :meth:`~CompiledPlan.rearranged` also moves each
owned encoder backward to a slot (:mod:`mpipe_tune.algebra._encoder_backward`) instead of the
cooldown, on its owner or (full recomputation) on another rank, whose Scatter then takes that
rank's link and whose saved bytes live there during the backward only
(:mod:`~mpipe_tune.cost._memory`); :meth:`~CompiledPlan.with_encoder_backward` does that alone; the
result again equals derive with those slots and ranks. :attr:`~CompiledPlan.backbone_steps` (the unit-time steps the slots are
read against) does not depend on the owners, so it is found once per derived plan.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

import numpy as np

from mpipe_tune.algebra import (
    Order, Owners, Plan, collector_paused, derive, sequence_edges, sort_topologically, OPTIMISED, BackboneSteps,
    EncoderBackward, plan_steps, Bwd, Coll, Comm, EdgeKind, Fwd, Model, ByLayer, ByMicrobatch, validate_owners,
    EDGE_KINDS, OrderColumns, replicated_of,
)
from mpipe_tune.cost import _kernels as kernels
from mpipe_tune.cost._durations import DurationModel, TableSums, table_sums
from mpipe_tune.cost._event_arrays import BARRIER, BWD, COLL, COMMS, REDUCE, EventArrays
from mpipe_tune.cost._layers import CostOptions, LayerTable
from mpipe_tune.cost._memory import MemoryLayout, MemoryReport, estimate_static_bytes
from mpipe_tune.cost._profile import HardwareProfile
from mpipe_tune.cost._sharding_events import sharding_events
from mpipe_tune.cost._timing import CompiledOrder, Timeline


class CompiledPlan:
    """One derived plan with its cost arrays, for one model, profile and set of cost options."""

    def __init__(self, plan: Plan, model: Model, profile: HardwareProfile, options: CostOptions) -> None:
        self.derived, self.model, self.profile, self.options = plan, model, profile, options
        """``derived``: the plan as derive built it (a re-timed plan's differs from it in its owners)."""
        self._plan: Plan | None = plan
        self.owners = _owners(plan)
        """The transposed region's owner map (rank of microbatch 0, 1, ...); None without one."""
        self.encoder_ranks = _encoder_ranks(plan)
        """Per microbatch, the rank of its encoder backward (its owner unless moved); None without any."""
        with collector_paused():
            self.arrays = EventArrays.of(plan)
            self.order = self.arrays.once("compiled order", lambda: CompiledOrder(plan, self.arrays))
            self.durations_model = DurationModel(plan, model, profile, options, self.arrays)
            self.memory_layout = MemoryLayout(plan, self.arrays)
        self.sharding = sharding_events(self.arrays, plan.num_microbatches, model, profile, options)
        """The per-microbatch sharding actions (ZeRO-2, ZeRO-3 resharding after forward), timed as nodes of
        their own (:mod:`~mpipe_tune.cost._sharding_events`); None without any."""
        self._pack: tuple[DurationModel, CompiledOrder, tuple[np.ndarray, ...] | bool | None] | None = None
        """(:attr:`durations_model`, :attr:`order`, their arrays as one kernel call reads them): see :meth:`_packed`."""
        self._timed: tuple[CompiledOrder, object, CompiledOrder] | None = None
        """(:attr:`order`, :attr:`sharding`, the order with those actions): made on first use, for that pair
        (a copy for other options or owners shares the attribute until then)."""
        self._moves: _OwnerMoves | None = None
        self._static: tuple[np.ndarray, tuple[float, ...]] | None = None

    def for_options(self, options: CostOptions) -> "CompiledPlan":
        """The same plan compiled for other cost options (degrees, dtype, recompute): the order and
        its live tensors are shared, the durations recompiled."""
        if options == self.options:
            return self
        assert self.owners == _owners(self.derived), "compile other options before re-timing owners"
        out = CompiledPlan.__new__(CompiledPlan)
        out.__dict__.update(self.__dict__)
        out.options, out._static = options, None
        out.durations_model = DurationModel(self.derived, self.model, self.profile, options, self.arrays)
        out.sharding = sharding_events(self.arrays, self.derived.num_microbatches, self.model, self.profile, options)
        return out

    @property
    def plan(self) -> Plan:
        """The plan this compiles: derive's, or for a re-timed owner map the plan that derive builds
        for it (made on first use: the re-timed arrays do not need it)."""
        if self._plan is None:
            self._plan = self._moves.plan(self)
        return self._plan

    @property
    def num_events(self) -> int:
        return self.order.num_events

    def durations(self, table: LayerTable | TableSums) -> np.ndarray:
        """Seconds per event (aligned with the plan's events) for one layer table."""
        return self.durations_model.durations(table)

    def makespan(self, table: LayerTable | TableSums) -> float:
        """The step time alone: durations and one longest-path pass (the search's hot loop), in one kernel
        call where the durations are that one pass (:func:`~mpipe_tune.cost._kernels.step_makespan`)."""
        if self.sharding is not None:
            return self.timed_order().makespan(self._with_actions(table))
        sums = table if isinstance(table, TableSums) else table_sums(table, self.model)
        packed = self._packed(sums.table)
        if packed is None:
            return self.order.makespan(self.durations(sums))
        ints, rates, durations, finish = packed
        order = self.order
        return float(kernels.step_makespan(sums.fwd_prefix, sums.bwd_prefix, sums.boundary_bytes, ints, rates,
                                           order.topo, order.pred_ptr, order.pred_idx, durations, finish))

    def _packed(self, table: LayerTable) -> tuple[np.ndarray, ...] | None:
        """:meth:`~mpipe_tune.cost._durations.DurationModel.packed` and two scratch arrays, for the (durations,
        order) pair (a copy for other options or owners has its own pair); None on the pair's first use (a plan
        timed once, a cold candidate or a new owner map, takes the two passes rather than pay for the packing)
        or where it cannot pack."""
        model, order = self.durations_model, self.order
        if self._pack is None or self._pack[0] is not model or self._pack[1] is not order:
            self._pack = (model, order, False)
            return None
        if self._pack[2] is False:
            part = model.packed(table)
            if part is not None:
                part = (*part, np.empty(order.num_events), np.empty(order.num_events))
            self._pack = (model, order, part)
        return self._pack[2]

    def timeline(self, table: LayerTable | TableSums) -> Timeline:
        """The step's timeline: the events' start, finish and seconds (aligned with the plan's events), the
        ranks' busy time with their sharding actions' in it."""
        if self.sharding is None:
            return self.order.timeline(self.durations(table))
        timeline = self.timed_order().timeline(self._with_actions(table))
        n = self.num_events
        return replace(timeline, start_s=timeline.start_s[:n], finish_s=timeline.finish_s[:n],
                       durations_s=timeline.durations_s[:n], actions_s=timeline.durations_s[n:],
                       actions_start_s=timeline.start_s[n:], actions_at=self.sharding.at)

    def timed_order(self) -> CompiledOrder:
        """The order the step is timed on: :attr:`order` with the sharding actions as nodes of their own
        (:meth:`~mpipe_tune.cost._timing.CompiledOrder.with_actions`), or :attr:`order` without any."""
        if self.sharding is None:
            return self.order
        if self._timed is None or self._timed[0] is not self.order or self._timed[1] is not self.sharding:
            self._timed = (self.order, self.sharding, self.order.with_actions(self.sharding.at, self.sharding.after))
        return self._timed[2]

    def _with_actions(self, table: LayerTable | TableSums) -> np.ndarray:
        """The events' seconds, then the sharding actions'."""
        durations = self.durations(table)
        return np.concatenate((durations, self.sharding.seconds(table, durations)))

    def static_bytes(self, table: LayerTable) -> tuple[float, ...]:
        """Per rank, weights, gradients and optimizer state (parameter counts only: cached)."""
        if self._static is None or self._static[0] is not table.param_count:
            self._static = (table.param_count, estimate_static_bytes(self.derived, self.model, table, self.options))
        return self._static[1]

    def memory(self, table: LayerTable, timeline: Timeline) -> MemoryReport:
        """Per-rank static and activation memory on ``timeline`` (one of this plan's)."""
        return self.memory_layout.report(self.static_bytes(table), table, timeline,
                                         self.profile.memory_capacity_bytes)

    def with_owners(self, owners: tuple[int, ...]) -> "CompiledPlan":
        """The same plan with the transposed region's microbatches owned by ``owners`` (rank of
        microbatch 0, 1, ...), re-timed without deriving again (see the module docstring)."""
        assert self.owners is not None, "only a plan with a transposed region has an owner map"
        owners = tuple(owners)
        if owners == self.owners:
            return self
        validate_owners(owners, self.derived.num_ranks, self.derived.num_microbatches)
        return self.rearranged(owners)

    def rearranged(self, owners: tuple[int, ...], encoder_backward_slots: tuple[int, ...] | None = None,
                   encoder_backward_ranks: tuple[int, ...] | None = None) -> "CompiledPlan":
        """The same plan with ``owners`` (as :meth:`with_owners`) and its encoder backwards at
        ``encoder_backward_slots`` (:mod:`~mpipe_tune.algebra._encoder_backward`; None: the cooldown)
        on ``encoder_backward_ranks`` (None: their owners)."""
        if self.derived.inner_transposes:
            return self._derived_for(tuple(owners), encoder_backward_slots, encoder_backward_ranks)
        if self._moves is None:
            self._moves = _OwnerMoves(self)
        return self._moves.apply(self, tuple(owners), encoder_backward_slots, encoder_backward_ranks)

    def with_encoder_backward(self, slots: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> "CompiledPlan":
        """The same plan and owners with the encoder backwards at ``slots`` on ``ranks`` (None: their
        owners), re-timed without deriving again."""
        assert self.owners is not None, "only a plan with a transposed region has encoder backwards to place"
        return self.rearranged(self.owners, tuple(slots), ranks)

    def order_with_encoder_backward(self, slots: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> CompiledOrder:
        """The order alone of :meth:`with_encoder_backward` (what a search over slots times, with the
        durations of one arrangement held fixed)."""
        if self.derived.inner_transposes:
            return self._derived_for(self.owners, tuple(slots), ranks).order
        if self._moves is None:
            self._moves = _OwnerMoves(self)
        return self._moves.order(self, self.owners, tuple(slots), ranks)[1]

    @cached_property
    def backbone_steps(self) -> BackboneSteps:
        """The plan's backbone in unit-time steps (owner-independent: derived once, shared by re-timed copies)."""
        return plan_steps(self.derived)

    @cached_property
    def has_encoder_backward(self) -> bool:
        """Whether the plan runs encoder backwards (a trainable transposed region)."""
        a = self.arrays
        return a.source_region >= 0 and bool(((a.kind == BWD) & (a.region == a.source_region)).any())

    def _derived_for(self, owners: tuple[int, ...], encoder_backward_slots: tuple[int, ...] | None,
                     encoder_backward_ranks: tuple[int, ...] | None = None) -> "CompiledPlan":
        """This plan derived again with ``owners`` (the same slabs) and the encoder backwards at
        ``encoder_backward_slots`` (None: the cooldown) on ``encoder_backward_ranks``, compiled for the
        same options."""
        d = self.derived
        slabs = tuple(p.owner.counts() for p in d.placement if isinstance(p.owner, ByLayer))
        placement = None if encoder_backward_slots is None else EncoderBackward(
            OPTIMISED, tuple(encoder_backward_slots), encoder_backward_ranks)
        plan = derive(d.cut, d.schedule, self.model, d.num_ranks, d.num_microbatches,
                      Owners(slab_counts=slabs, microbatch=owners), placement)
        return CompiledPlan(plan, self.model, self.profile, self.options)

    def events(self):
        """The events (with their ranks under :attr:`owners`), aligned with every per-event array."""
        events = self.derived.order.events
        if self.owners == _owners(self.derived) and self.encoder_ranks == _encoder_ranks(self.derived):
            return events
        region = self.derived.source.region
        ranks = self.encoder_ranks or self.owners
        out = list(events)
        for i, event in enumerate(events):
            if isinstance(event, Fwd) and event.region == region:
                out[i] = Fwd(region, self.owners[event.mb], event.mb)
            elif isinstance(event, Bwd) and event.region == region:
                out[i] = Bwd(region, ranks[event.mb], event.mb)
            elif isinstance(event, Coll) and event.comm is Comm.GATHER and event.src[0] == region:
                out[i] = Coll(event.comm, (region, self.owners[event.mb]), event.dst, event.mb)
            elif isinstance(event, Coll) and event.comm is Comm.SCATTER and event.dst[0] == region:
                out[i] = Coll(event.comm, event.src, (region, ranks[event.mb]), event.mb)
        return tuple(out)


def _owners(plan: Plan) -> tuple[int, ...] | None:
    """The owner map every Replicated region of ``plan`` shares; None without one."""
    replicated = replicated_of(plan.placement)
    return replicated[0].owner.owners if replicated else None


def _encoder_ranks(plan: Plan) -> tuple[int, ...] | None:
    """Per microbatch, the rank that runs its encoder backward in ``plan``; None without encoder backwards."""
    source = plan.source
    if source is None:
        return None
    c = plan.order.columns  # the columns: no event objects needed
    backwards = np.flatnonzero((c.kind == BWD) & (c.region == source.region))
    if not len(backwards):
        return None
    ranks = np.empty(plan.num_microbatches, dtype=np.int64)
    ranks[c.mb[backwards]] = c.rank[backwards]
    return tuple(ranks.tolist())


class _OwnerMoves:
    """What an owner change moves in one compiled plan, found once: per microbatch its encode and
    encoder backward; per rank its events that stay; the edges that stay; the Gathers and Scatters
    of the transposed region and the live tensors of its encodes."""

    def __init__(self, compiled: CompiledPlan) -> None:
        a = compiled.arrays
        M = compiled.derived.num_microbatches
        source = a.source_region
        encode = a.is_encode()
        encoder_bwd = (a.kind == BWD) & (a.region == source)
        self.encode = np.full(M, -1, dtype=np.int64)
        self.encode[a.mb[encode]] = np.flatnonzero(encode)
        self.encoder_bwd = np.full(M, -1, dtype=np.int64)
        self.encoder_bwd[a.mb[encoder_bwd]] = np.flatnonzero(encoder_bwd)
        self.has_encoder_bwd = bool(encoder_bwd.any())
        # Per rank: its backbone program, and where its reduces and barrier begin.
        moved = encode | encoder_bwd
        tail = (a.kind == REDUCE) | (a.kind == BARRIER)
        self.kept = [nodes[~moved[nodes]] for nodes in a.nodes]
        self.tail_at = [int(np.argmax(tail[kept])) for kept in self.kept]
        # Edges that are not per-rank sequence edges (derive adds those last, so a shared pair keeps
        # its first kind; a Sequence edge into the barrier is a reduce's, and stays).
        self.keep = ~a.edge_is_sequence | (a.kind[a.edge_dst] == BARRIER)
        self.edge_src, self.edge_dst = a.edge_src[self.keep], a.edge_dst[self.keep]
        # The moved transfers, by their position in the duration model: a Gather leaves the owner,
        # a Scatter reaches it.
        coll = a.kind == COLL
        self.gather = np.flatnonzero(coll & (a.comm == COMMS.index(Comm.GATHER)) & (a.region == source))
        self.scatter = np.flatnonzero(coll & (a.comm == COMMS.index(Comm.SCATTER)) & (a.other_region == source))
        coll_idx = compiled.durations_model.coll_idx
        self.positions = np.concatenate((np.searchsorted(coll_idx, self.gather), np.searchsorted(coll_idx, self.scatter)))
        self.comm = a.comm[np.concatenate((self.gather, self.scatter))]
        # The moved live tensors: an encode's output until the Gather (on the owner), and what it saves
        # for its backward (on the backward's rank: from the encode, or from the backward moved off it).
        layout = compiled.memory_layout
        after_saved = np.arange(layout.num_saved, len(layout.alloc_event))
        self.tensors = after_saved[encode[layout.alloc_event[after_saved]]]
        self.tensor_mb = a.mb[layout.alloc_event[self.tensors]]
        saved = np.arange(layout.num_saved)
        self.saved = saved[encoder_bwd[layout.free_event[saved]]]
        self.saved_mb = a.mb[layout.free_event[self.saved]]

    def order(self, compiled: CompiledPlan, owners: tuple[int, ...], slots: tuple[int, ...] | None,
              ranks: tuple[int, ...] | None = None) -> tuple[list[np.ndarray], CompiledOrder]:
        """Each rank's list for ``owners`` (its encoder backwards at ``slots``, None: the cooldown, on
        ``ranks``, None: their owners) and their order."""
        assert ranks is None or slots is not None, "encoder backwards on other ranks take explicit slots"
        owner = np.array(owners, dtype=np.int64)
        nodes = []
        for r, (kept, at) in enumerate(zip(self.kept, self.tail_at)):
            owned = np.flatnonzero(owner == r)
            backward = self.encoder_bwd[owned] if self.has_encoder_bwd else kept[:0]
            nodes.append(np.concatenate((self.encode[owned], kept[:at], backward, kept[at:])))
        if slots is not None:
            nodes = list(compiled.backbone_steps.place(nodes, owners if ranks is None else ranks, slots))
        src = np.concatenate([self.edge_src] + [x[:-1] for x in nodes])
        dst = np.concatenate([self.edge_dst] + [x[1:] for x in nodes])
        old = compiled.order
        return nodes, CompiledOrder.from_arrays(old.num_events, src, dst, nodes, old.encode, old.first_forward,
                                                old.has_source)

    def apply(self, compiled: CompiledPlan, owners: tuple[int, ...], slots: tuple[int, ...] | None,
              ranks: tuple[int, ...] | None = None) -> CompiledPlan:
        a = compiled.arrays
        owner = np.array(owners, dtype=np.int64)
        rank = owner if ranks is None else np.array(ranks, dtype=np.int64)
        _, order = self.order(compiled, owners, slots, ranks)
        src_rank = np.concatenate((owner[a.mb[self.gather]], a.rank[self.scatter]))
        dst_rank = np.concatenate((a.other_rank[self.gather], rank[a.mb[self.scatter]]))
        alpha, beta = compiled.durations_model.links(self.comm, src_rank, dst_rank)
        out = CompiledPlan.__new__(CompiledPlan)
        out.__dict__.update(compiled.__dict__)
        out.owners, out._plan = owners, None
        out.encoder_ranks = tuple(rank.tolist()) if self.has_encoder_bwd else None
        out.order = order
        out.durations_model = compiled.durations_model.with_links(self.positions, alpha, beta, lambda: out.plan)
        layout, mb = compiled.memory_layout, self.saved_mb
        alloc = np.where(rank[mb] == owner[mb], self.encode[mb], self.encoder_bwd[mb])
        out.memory_layout = layout.moved(np.concatenate((self.tensors, self.saved)),
                                         np.concatenate((owner[self.tensor_mb], rank[mb])),
                                         np.concatenate((layout.alloc_event[self.tensors], alloc)))
        return out

    def plan(self, retimed: CompiledPlan) -> Plan:
        """The plan derive builds for ``retimed``'s owners, from the re-timed arrays: the derived events'
        columns with the moved events on their new ranks, the kept edges and then each rank's Sequence
        edges in derive's order (:func:`~mpipe_tune.algebra._derive.sequence_edges`)."""
        derived = retimed.derived
        c = derived.order.columns
        owner = np.array(retimed.owners, dtype=np.int64)
        backward_rank = np.array(retimed.encoder_ranks or retimed.owners, dtype=np.int64)  # its owner unless moved
        rank, other_rank = c.rank.copy(), c.other_rank.copy()
        rank[self.encode] = owner[c.mb[self.encode]]
        rank[self.gather] = owner[c.mb[self.gather]]  # leaves the owner
        backwards = self.encoder_bwd[self.encoder_bwd >= 0]
        rank[backwards] = backward_rank[c.mb[backwards]]
        other_rank[self.scatter] = backward_rank[c.mb[self.scatter]]  # reaches the encoder backward
        nodes = retimed.order.nodes
        seq_src, seq_dst = sequence_edges(nodes, self.edge_src, self.edge_dst)
        src, dst = np.concatenate((self.edge_src, seq_src)), np.concatenate((self.edge_dst, seq_dst))
        kinds = np.concatenate((c.edge_kind[self.keep], np.full(len(seq_src), EDGE_KINDS.index(EdgeKind.SEQUENCE))))
        topo = sort_topologically(len(c.kind), src, dst)
        order = Order.from_columns(OrderColumns(c.kind, c.region, rank, c.mb, c.comm, c.other_region, other_rank,
                                                c.group, src, dst, kinds, tuple(n.copy() for n in nodes), topo))
        source = derived.source
        placement = tuple(replace(p, owner=ByMicrobatch(retimed.owners)) if p is source else p for p in derived.placement)
        return replace(derived, placement=placement, order=order)
