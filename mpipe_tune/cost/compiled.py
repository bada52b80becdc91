"""A compiled plan: derive once, then evaluate any layer table with array passes only.

:class:`CompiledPlan` holds a derived plan as three compiled parts, each an array form of one
readable pass: the order (:class:`~mpipe_tune.cost.timing.CompiledOrder`: topological order,
predecessors, ranks), the durations (:class:`~mpipe_tune.cost.durations.DurationModel`: slab
and tensor indices, link rates, reduce costs) and the live tensors
(:class:`~mpipe_tune.cost.memory.MemoryLayout`). ``predict`` and the search's evaluator both read
a step through it: :meth:`~CompiledPlan.timeline`, :meth:`~CompiledPlan.memory`,
:meth:`~CompiledPlan.static_bytes`, and :meth:`~CompiledPlan.makespan` for the search's hot loop.

**Owner maps without re-deriving.** The transposed region's owner map decides only which rank runs
each microbatch's encode ``Fwd(1, owner, m)`` and its backward, and which rank the Gather leaves
and the Scatter reaches. :meth:`~CompiledPlan.with_owners` moves exactly those events: each rank's
list becomes its owned encodes, its unchanged backbone program, its owned encoder backwards and
its unchanged reduces; the graph keeps every non-sequence edge and takes the new ranks' sequence
edges; the moved transfers take their new link's rate (free on one rank) and the moved tensors
their new rank. Event indices stay those of ``derive`` with the new owners (derive numbers events
by microbatch, whoever owns it), so the result equals a fresh derive and predict.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.events import Bwd, Coll, Comm, DpReduce, EdgeKind, Fwd, StepBarrier
from mpipe_tune.algebra.model import Model
from mpipe_tune.algebra.placement import ByMicrobatch, validate_owners
from mpipe_tune.algebra.schedule import Layout
from mpipe_tune.cost.durations import DurationModel, TableSums, table_sums
from mpipe_tune.cost.layers import CostOptions, LayerTable
from mpipe_tune.cost.memory import MemoryLayout, MemoryReport, estimate_static_bytes
from mpipe_tune.cost.profile import HardwareProfile
from mpipe_tune.cost.timing import CompiledOrder, Timeline


class CompiledPlan:
    """One derived plan with its cost arrays, for one model, profile and set of cost options."""

    def __init__(self, plan: Plan, model: Model, profile: HardwareProfile, options: CostOptions) -> None:
        self.plan, self.model, self.profile, self.options = plan, model, profile, options
        self.owners = _owners(plan)
        """The transposed region's owner map (rank of microbatch 0, 1, ...); None without one."""
        self.order = CompiledOrder(plan)
        self.durations_model = DurationModel(plan, model, profile, options)
        self.memory_layout = MemoryLayout(plan)
        self._moves: _OwnerMoves | None = None
        self._static: tuple[np.ndarray, tuple[float, ...]] | None = None

    def for_options(self, options: CostOptions) -> "CompiledPlan":
        """The same plan compiled for other cost options (degrees, dtype, recompute): the order and
        its live tensors are shared, the durations recompiled."""
        if options == self.options:
            return self
        out = CompiledPlan.__new__(CompiledPlan)
        out.__dict__.update(self.__dict__)
        out.options, out._static = options, None
        out.durations_model = DurationModel(self.plan, self.model, self.profile, options)
        return out

    @property
    def num_events(self) -> int:
        return self.order.num_events

    def sums(self, table: LayerTable | TableSums) -> TableSums:
        return table if isinstance(table, TableSums) else table_sums(table, self.model)

    def durations(self, table: LayerTable | TableSums) -> np.ndarray:
        """Seconds per event (aligned with the plan's events) for one layer table."""
        return self.durations_model.durations(table)

    def makespan(self, table: LayerTable | TableSums) -> float:
        """The step time alone: durations and one longest-path pass (the search's hot loop)."""
        return self.order.makespan(self.durations(table))

    def timeline(self, table: LayerTable | TableSums) -> Timeline:
        return self.order.timeline(self.durations(table))

    def static_bytes(self, table: LayerTable) -> tuple[float, ...]:
        """Per rank, weights, gradients and optimizer state (parameter counts only: cached)."""
        if self._static is None or self._static[0] is not table.param_count:
            self._static = (table.param_count, estimate_static_bytes(self.plan, self.model, table, self.options))
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
        validate_owners(owners, self.plan.num_ranks, self.plan.num_microbatches)
        if self._moves is None:
            self._moves = _OwnerMoves(self)
        return self._moves.apply(self, owners)

    def events(self):
        """The events (with their ranks under :attr:`owners`), aligned with every per-event array."""
        events = self.plan.order.events
        if self.owners == _owners(self.plan):
            return events
        region = self.plan.placement[0].region
        out = list(events)
        for i, event in enumerate(events):
            if isinstance(event, (Fwd, Bwd)) and event.region == region:
                out[i] = type(event)(region, self.owners[event.mb], event.mb)
            elif isinstance(event, Coll) and event.comm is Comm.GATHER and event.src[0] == region:
                out[i] = Coll(event.comm, (region, self.owners[event.mb]), event.dst, event.mb)
            elif isinstance(event, Coll) and event.comm is Comm.SCATTER and event.dst[0] == region:
                out[i] = Coll(event.comm, event.src, (region, self.owners[event.mb]), event.mb)
        return tuple(out)


def _owners(plan: Plan) -> tuple[int, ...] | None:
    first = plan.placement[0]
    return first.owner.owners if first.layout is Layout.REPLICATED and isinstance(first.owner, ByMicrobatch) else None


class _OwnerMoves:
    """What an owner change moves in one compiled plan, found once: per microbatch its encode, its
    encoder backward, its Gather and Scatter; per rank its events that stay; the edges that stay."""

    def __init__(self, compiled: CompiledPlan) -> None:
        plan = compiled.plan
        events = plan.order.events
        region = plan.placement[0].region
        M = plan.num_microbatches
        self.encode = np.full(M, -1, dtype=np.int64)
        self.encoder_bwd = np.full(M, -1, dtype=np.int64)
        gather, scatter = {}, {}
        for i, e in enumerate(events):
            if isinstance(e, Fwd) and e.region == region:
                self.encode[e.mb] = i
            elif isinstance(e, Bwd) and e.region == region:
                self.encoder_bwd[e.mb] = i
            elif isinstance(e, Coll) and e.comm is Comm.GATHER and e.src[0] == region:
                gather[i] = e
            elif isinstance(e, Coll) and e.comm is Comm.SCATTER and e.dst[0] == region:
                scatter[i] = e
        moved = set(self.encode.tolist()) | set(self.encoder_bwd.tolist())
        # Per rank: its backbone program, and where its reduces and barrier begin.
        self.kept: list[np.ndarray] = []
        self.tail_at: list[int] = []
        for nodes in plan.order.nodes:
            kept = [i for i in nodes if i not in moved]
            self.kept.append(np.array(kept, dtype=np.int64))
            self.tail_at.append(next(k for k, i in enumerate(kept) if isinstance(events[i], (DpReduce, StepBarrier))))
        # Edges that are not per-rank sequence edges (derive adds those last, so a shared pair keeps
        # its first kind; a Sequence edge into the barrier is a reduce's, and stays).
        keep = [(s, t) for s, t, kind in plan.order.edges
                if kind is not EdgeKind.SEQUENCE or isinstance(events[t], StepBarrier)]
        self.edges = np.array(keep, dtype=np.int64).reshape(-1, 2)
        # The moved transfers, by their position in the duration model, with the rank they stay at.
        position = {int(i): k for k, i in enumerate(compiled.durations_model.coll_idx)}
        self.transfers = [(position[i], e.comm, e.mb, e.dst[1] if e.comm is Comm.GATHER else e.src[1])
                          for i, e in {**gather, **scatter}.items()]
        # The moved live tensors: an encode's saved activations and its output until the Gather.
        layout = compiled.memory_layout
        self.tensors = np.flatnonzero(np.isin(layout.alloc_event, self.encode))
        self.tensor_mb = {int(i): mb for mb, i in enumerate(self.encode.tolist())}
        self.has_encoder_bwd = bool((self.encoder_bwd >= 0).all())

    def apply(self, compiled: CompiledPlan, owners: tuple[int, ...]) -> CompiledPlan:
        P = compiled.plan.num_ranks
        owned = [[m for m in range(len(owners)) if owners[m] == r] for r in range(P)]
        nodes = []
        for r in range(P):
            kept, at = self.kept[r], self.tail_at[r]
            backward = self.encoder_bwd[owned[r]] if self.has_encoder_bwd else kept[:0]
            nodes.append(np.concatenate((self.encode[owned[r]], kept[:at], backward, kept[at:])))
        sequence = [np.stack((x[:-1], x[1:]), axis=1) for x in nodes]
        edges = np.concatenate([self.edges, *sequence])
        old = compiled.order
        order = CompiledOrder.from_arrays(old.num_events, np.ascontiguousarray(edges[:, 0]),
                                          np.ascontiguousarray(edges[:, 1]), nodes, old.encode,
                                          old.first_forward, old.has_source)
        durations = compiled.durations_model
        positions, alpha, beta = [], [], []
        for k, comm, mb, other in self.transfers:
            a, b = ((durations.link(compiled.profile, comm, owners[mb], other)) if comm is Comm.GATHER
                    else durations.link(compiled.profile, comm, other, owners[mb]))
            positions.append(k)
            alpha.append(a)
            beta.append(b)
        layout = compiled.memory_layout
        ranks = np.array([owners[self.tensor_mb[int(i)]] for i in layout.alloc_event[self.tensors]], dtype=np.int64)
        out = CompiledPlan.__new__(CompiledPlan)
        out.__dict__.update(compiled.__dict__)
        out.owners = owners
        out.order = order
        out.durations_model = durations.with_links(np.array(positions, dtype=np.int64), np.array(alpha),
                                                   np.array(beta))
        out.memory_layout = layout.moved(self.tensors, ranks)
        return out
