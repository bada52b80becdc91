"""The IR ``derive`` produces: a :class:`Plan` is placement + collectives + :class:`Order`.

The order is one acyclic event graph with typed edges; ``Plan.nodes(r)`` is rank ``r``'s event list.
Collective events (Gather, Scatter, Send, RecvGrad) occupy links, not ranks, so they appear in the
graph but in no rank's list; compute events, the loss, reduces and the step barrier occupy ranks.
Consecutive events of one rank are joined by Sequence edges, so a topological order of the graph is
a deadlock-free execution. These are plain frozen values: the cost model times them, the runtime
interprets them, the plan file stores them; none of them holds seconds. An order is also its integer
columns (:class:`OrderColumns`), which derive builds and the cost model compiles; each view is made
from the other on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from operator import itemgetter

import numpy as np

from mpipe_tune.algebra._events import (
    Bwd, Coll, Comm, DpReduce, EdgeKind, Event, Fwd, Group, Loss, Stage, StepBarrier, Wgrad,
)
from mpipe_tune.algebra._placement import ByLayer, RegionPlacement
from mpipe_tune.algebra._schedule import Cut, Layout, Schedule


def source_of(placement: tuple[RegionPlacement, ...]) -> RegionPlacement | None:
    """The Replicated source region (the transposed encoder) of a placement, or None: region 1 when it
    is Replicated. A source runs its owned encodes before its rank's wavefront and its backwards in the
    cooldown; an interior or sink transpose (a Replicated region after the first, see
    :func:`replicated_of`) is not a source: its events run inside the wavefront."""
    first = placement[0]
    return first if is_source(first) else None


def is_source(region: RegionPlacement) -> bool:
    """Whether ``region`` is a placement's source: region 1, Replicated (the one definition of "the
    encoder is region 1" that :func:`source_of` and ``derive`` read)."""
    return region.region == 1 and region.layout is Layout.REPLICATED


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


FWD, BWD, COLL, REDUCE, LOSS, BARRIER, WGRAD = range(7)
"""Event kinds by their code in :attr:`OrderColumns.kind`."""
COMMS = (Comm.SEND, Comm.RECV_GRAD, Comm.GATHER, Comm.SCATTER)
"""Transfer kinds by their code in :attr:`OrderColumns.comm`."""
GROUPS = (Group.REPLICA, Group.DATA)
"""Reduce groups by their code in :attr:`OrderColumns.group`."""
EDGE_KINDS = tuple(EdgeKind)
"""Edge kinds by their code in :attr:`OrderColumns.edge_kind`."""
_SEND, _RECV_GRAD, _GATHER, _SCATTER = COMMS
_SEQUENCE = EDGE_KINDS.index(EdgeKind.SEQUENCE)


def _comm_code(comm: Comm) -> int:  # by identity: hashing an Enum member runs Python code
    return 0 if comm is _SEND else 1 if comm is _RECV_GRAD else 2 if comm is _GATHER else 3


# One row per event: kind, region, rank, mb, comm, other region, other rank, group (-1 where none).
# A transfer's (region, rank) is its source stage, (other region, other rank) its destination.
_ROW = {
    "F": lambda e: (FWD, e[0], e[1], e[2], -1, -1, -1, -1),
    "B": lambda e: (BWD, e[0], e[1], e[2], -1, -1, -1, -1),
    "W": lambda e: (WGRAD, e[0], e[1], e[2], -1, -1, -1, -1),
    "C": lambda e: (COLL, e[1][0], e[1][1], e[3], _comm_code(e[0]), e[2][0], e[2][1], -1),
    "R": lambda e: (REDUCE, e[0], -1 if e[2] is None else e[2], -1, -1, -1, -1, 0 if e[1] is Group.REPLICA else 1),
    "L": lambda e: (LOSS, -1, -1, e[0], -1, -1, -1, -1),
    "S": lambda e: (BARRIER, -1, -1, -1, -1, -1, -1, -1),
}


def event_rows(events: Sequence[Event]) -> np.ndarray:
    """The events as an ``(n, 8)`` integer table, one row per event (the columns of :class:`OrderColumns`)."""
    return np.fromiter(chain.from_iterable([_ROW[e[-1]](e) for e in events]), dtype=np.int64,
                       count=8 * len(events)).reshape(-1, 8)


_new = tuple.__new__  # builds an event from its fields without the named tuple's Python-level __new__


def events_of_rows(kind: Sequence[int], region: Sequence[int], rank: Sequence[int], mb: Sequence[int],
                   comm: Sequence[int], other_region: Sequence[int], other_rank: Sequence[int],
                   group: Sequence[int]) -> list[Event]:
    """The event objects of column rows (the inverse of :func:`event_rows`), given as Python int lists."""
    out: list[Event] = []
    push = out.append
    for k, j, r, m, c, oj, orank, g in zip(kind, region, rank, mb, comm, other_region, other_rank, group):
        if k == FWD:
            push(_new(Fwd, (j, r, m, "F")))
        elif k == BWD:
            push(_new(Bwd, (j, r, m, "B")))
        elif k == COLL:
            push(_new(Coll, (COMMS[c], (j, r), (oj, orank), m, "C")))
        elif k == WGRAD:
            push(_new(Wgrad, (j, r, m, "W")))
        elif k == LOSS:
            push(_new(Loss, (m, "L")))
        elif k == REDUCE:
            push(_new(DpReduce, (j, GROUPS[g], None if r < 0 else r, "R")))
        else:
            push(StepBarrier())
    return out


@dataclass(frozen=True, eq=False)
class OrderColumns:
    """An order as read-only integer arrays: one row per event (aligned with ``Order.events``), one per
    edge, and the per-rank lists and topological order as index arrays."""

    kind: np.ndarray
    """Per event, its kind's code (:data:`FWD`, :data:`BWD`, ...)."""
    region: np.ndarray
    """A stage event's region, a transfer's source region, a reduce's region; -1 for the others."""
    rank: np.ndarray
    """A stage event's rank, a transfer's source rank, a DataGroup reduce's rank; -1 for the others."""
    mb: np.ndarray
    """The microbatch of a stage event, a transfer and a loss; -1 for the others."""
    comm: np.ndarray
    """A transfer's code in :data:`COMMS`; -1 for the others."""
    other_region: np.ndarray
    """A transfer's destination region; -1 for the others."""
    other_rank: np.ndarray
    """A transfer's destination rank; -1 for the others."""
    group: np.ndarray
    """A reduce's code in :data:`GROUPS`; -1 for the others."""
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_kind: np.ndarray
    """Per edge, its kind's code in :data:`EDGE_KINDS`."""
    nodes: tuple[np.ndarray, ...]
    topo: np.ndarray
    """A topological order (empty for an order built without one)."""

    @classmethod
    def of(cls, events: Sequence[Event], edges: Sequence[tuple[int, int, EdgeKind]],
           nodes: Sequence[Sequence[int]], topo: Sequence[int]) -> "OrderColumns":
        """The columns of an order given as objects (one Python pass over its events and edges)."""
        codes = {kind: code for code, kind in enumerate(EDGE_KINDS)}
        rows = event_rows(events)
        m = len(edges)
        return cls(*(rows[:, k].copy() for k in range(8)),
                   np.fromiter(map(itemgetter(0), edges), dtype=np.int64, count=m),
                   np.fromiter(map(itemgetter(1), edges), dtype=np.int64, count=m),
                   np.fromiter((codes[e[2]] for e in edges), dtype=np.int64, count=m),
                   tuple(np.array(n, dtype=np.int64).reshape(-1) for n in nodes),
                   np.array(topo, dtype=np.int64).reshape(-1))

    def __post_init__(self) -> None:
        for a in (*vars(self).values(), *self.nodes):
            if isinstance(a, np.ndarray):
                a.flags.writeable = False

    @property
    def edge_is_sequence(self) -> np.ndarray:
        return self.edge_kind == _SEQUENCE


class Order:
    """The event graph: ``events``, ``edges`` (source index, target index, kind) into ``events``, per
    rank the indices of its events in the order it runs them (``nodes``), and a topological order of
    the graph, Sequence edges included: a deadlock-free execution (``topo``).

    An order is one immutable value with two equal views, each made from the other on first use:
    the objects (``Order(events, edges, nodes, topo)``) and :class:`OrderColumns`
    (:meth:`from_columns`, as ``derive`` builds it: the cost model compiles the columns and never
    needs the objects). Equality is the objects'.
    """

    def __init__(self, events: tuple[Event, ...], edges: tuple[tuple[int, int, EdgeKind], ...],
                 nodes: tuple[tuple[int, ...], ...], topo: tuple[int, ...] = ()) -> None:
        vars(self).update(events=events, edges=edges, nodes=nodes, topo=topo)

    @classmethod
    def from_columns(cls, columns: OrderColumns, nodes: tuple[tuple[int, ...], ...] | None = None) -> "Order":
        """The order of ``columns`` (``nodes``: its per-rank lists as tuples, where the caller has them)."""
        out = cls.__new__(cls)
        vars(out)["columns"] = columns
        if nodes is not None:
            vars(out)["nodes"] = nodes
        return out

    def __setattr__(self, name, value):
        raise AttributeError(f"Order is immutable: cannot set {name}")

    @cached_property
    def events(self) -> tuple[Event, ...]:
        c = self.columns
        return tuple(events_of_rows(*(a.tolist() for a in (c.kind, c.region, c.rank, c.mb, c.comm, c.other_region,
                                                            c.other_rank, c.group))))

    @cached_property
    def edges(self) -> tuple[tuple[int, int, EdgeKind], ...]:
        c = self.columns
        return tuple(zip(c.edge_src.tolist(), c.edge_dst.tolist(), map(EDGE_KINDS.__getitem__, c.edge_kind.tolist())))

    @cached_property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(n.tolist()) for n in self.columns.nodes)

    @cached_property
    def topo(self) -> tuple[int, ...]:
        return tuple(self.columns.topo.tolist())

    @cached_property
    def columns(self) -> OrderColumns:
        return OrderColumns.of(self.events, self.edges, self.nodes, self.topo)

    def events_at(self, at: Sequence[int] | np.ndarray) -> list[Event]:
        """The events at indices ``at`` (made from the columns alone when the objects are not made yet)."""
        if "events" in vars(self):
            return [self.events[i] for i in at]
        c = self.columns
        return events_of_rows(*(a[at].tolist() for a in (c.kind, c.region, c.rank, c.mb, c.comm, c.other_region,
                                                         c.other_rank, c.group)))

    def _key(self) -> tuple:
        return (self.events, self.edges, self.nodes, self.topo)

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, Order) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Order(events={self.events!r}, edges={self.edges!r}, nodes={self.nodes!r}, topo={self.topo!r})"

    def __reduce__(self):
        return Order, self._key()


@dataclass(frozen=True)
class Plan:
    """What ``derive`` produces for one cut, schedule, model, P and M: the placement of every region on
    the ranks (slabs or owners), the collectives at the seams, the stages in wavefront order and the
    per-rank order of events with its edges. Immutable, and free of seconds (timings live in the cost
    model's reports)."""

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
        owners run inside the wavefront (:mod:`mpipe_tune.algebra._transpose_order`)."""
        return tuple(p for p in self.replicated if p.region > 1)

    def sharded_regions(self) -> tuple[int, ...]:
        return tuple(p.region for p in self.placement if p.layout is Layout.SHARDED)

    def slab(self, region: int, rank: int) -> tuple[int, int]:
        """The layers ``[start, stop)`` that ``Fwd(region, rank, m)`` runs."""
        p = self.placement[region - 1]
        return p.owner.slabs[rank] if isinstance(p.owner, ByLayer) else p.layers
