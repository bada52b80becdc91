"""The IR ``derive`` produces: a :class:`Plan` is placement + collectives + :class:`Order`.

The order is one acyclic event graph with typed edges; ``Plan.nodes(r)`` is rank ``r``'s event list.
Collective events (Gather, Scatter, Send, RecvGrad) occupy links, not ranks, so they appear in the
graph but in no rank's list; compute events, the loss, reduces and the step barrier occupy ranks.
Consecutive events of one rank are joined by Sequence edges, so a topological order of the graph is
a deadlock-free execution. These are plain frozen values: the cost model times them, the runtime
interprets them, the plan file stores them; none of them holds seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from mpipe_tune.algebra.events import Comm, EdgeKind, Event, Group, Stage
from mpipe_tune.algebra.placement import ByLayer, RegionPlacement
from mpipe_tune.algebra.schedule import Cut, Layout, Schedule


def source_of(placement: tuple[RegionPlacement, ...]) -> RegionPlacement | None:
    """The Replicated source region (the transposed encoder) of a placement, or None: region 1 when it
    is Replicated. A source runs its owned encodes before its rank's wavefront and its backwards in the
    cooldown; an interior or sink transpose (a Replicated region after the first, see
    :func:`replicated_of`) is not a source: its events run inside the wavefront."""
    first = placement[0]
    return first if first.layout is Layout.REPLICATED else None


def replicated_of(placement: tuple[RegionPlacement, ...]) -> tuple[RegionPlacement, ...]:
    """Every Replicated region of a placement (source, interior and sink), input to loss; they share
    one owner map."""
    return tuple(p for p in placement if p.layout is Layout.REPLICATED)


@dataclass(frozen=True)
class Seam:
    src_region: int
    dst_region: int
    fwd: Comm
    bwd: Comm | None

    def __str__(self) -> str:
        bwd = self.bwd.value if self.bwd else "-"
        return f"({self.src_region},{self.dst_region}): {self.fwd.value} / {bwd}"


@dataclass(frozen=True)
class Collectives:
    seams: tuple[Seam, ...]
    reduces: tuple[tuple[int, Group], ...]


@dataclass(frozen=True)
class Order:
    events: tuple[Event, ...]
    edges: tuple[tuple[int, int, EdgeKind], ...]
    """(source index, target index, kind) into ``events``."""
    nodes: tuple[tuple[int, ...], ...]
    """Per rank, the indices of its events in the order it runs them."""
    topo: tuple[int, ...] = ()
    """A topological order of the graph (sequence edges included): a deadlock-free execution."""


@dataclass(frozen=True)
class Plan:
    cut: Cut
    schedule: Schedule
    num_ranks: int
    num_microbatches: int
    placement: tuple[RegionPlacement, ...]
    collectives: Collectives
    order: Order
    stages: tuple[Stage, ...] = field(default=())
    """Sharded stages in wavefront order; stage index = position here."""

    def nodes(self, rank: int) -> tuple[Event, ...]:
        return tuple(self.order.events[i] for i in self.order.nodes[rank])

    @cached_property
    def index(self) -> dict[Event, int]:
        return {event: i for i, event in enumerate(self.order.events)}

    def graph(self):
        """The order as a networkx DiGraph (events as nodes, ``kind`` on edges): the readable reference."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(self.order.events)
        for s, t, kind in self.order.edges:
            g.add_edge(self.order.events[s], self.order.events[t], kind=kind)
        return g

    @property
    def source(self) -> RegionPlacement | None:
        """The Replicated source region (the transposed encoder) when the plan has one (:func:`source_of`)."""
        return source_of(self.placement)

    @property
    def replicated(self) -> tuple[RegionPlacement, ...]:
        """Every Replicated region (:func:`replicated_of`)."""
        return replicated_of(self.placement)

    @property
    def inner_transposes(self) -> tuple[RegionPlacement, ...]:
        """The interior and sink transposes: Replicated regions after the first, whose events their
        owners run inside the wavefront (:mod:`mpipe_tune.algebra.transpose_order`)."""
        return tuple(p for p in self.replicated if p.region > 1)

    def sharded_regions(self) -> tuple[int, ...]:
        return tuple(p.region for p in self.placement if p.layout is Layout.SHARDED)

    def slab(self, region: int, rank: int) -> tuple[int, int]:
        """The layers ``[start, stop)`` that ``Fwd(region, rank, m)`` runs."""
        p = self.placement[region - 1]
        return p.owner.slabs[rank] if isinstance(p.owner, ByLayer) else p.layers
