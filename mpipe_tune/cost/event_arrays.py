"""A derived order's events and edges as integer columns, read off the event objects in one pass.

The compiled parts of a plan (:class:`~mpipe_tune.cost.timing.CompiledOrder`,
:class:`~mpipe_tune.cost.durations.DurationModel`, :class:`~mpipe_tune.cost.memory.MemoryLayout`)
are built from these columns with array operations, so compiling a plan walks its event objects
once, whatever it compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
import operator
from itertools import chain, repeat
from operator import itemgetter

import numpy as np

from mpipe_tune.algebra.plan import Plan
from mpipe_tune.algebra.events import Comm, EdgeKind
from mpipe_tune.algebra.placement import ByLayer

FWD, BWD, COLL, REDUCE, LOSS, BARRIER, WGRAD = range(7)
COMMS = (Comm.SEND, Comm.RECV_GRAD, Comm.GATHER, Comm.SCATTER)
"""Transfer kinds by their code in :attr:`EventArrays.comm`."""
_SEND, _RECV_GRAD, _GATHER, _SCATTER = COMMS


def _comm_code(comm: Comm) -> int:  # by identity: hashing an Enum member runs Python code
    return 0 if comm is _SEND else 1 if comm is _RECV_GRAD else 2 if comm is _GATHER else 3

# One row per event: kind, region, rank, mb, comm, other region, other rank (-1 where none).
# A transfer's (region, rank) is its source stage, (other region, other rank) its destination.
_ROW = {
    "F": lambda e: (FWD, e[0], e[1], e[2], -1, -1, -1),
    "B": lambda e: (BWD, e[0], e[1], e[2], -1, -1, -1),
    "W": lambda e: (WGRAD, e[0], e[1], e[2], -1, -1, -1),
    "C": lambda e: (COLL, e[1][0], e[1][1], e[3], _comm_code(e[0]), e[2][0], e[2][1]),
    "R": lambda e: (REDUCE, e[0], -1 if e[2] is None else e[2], -1, -1, -1, -1),
    "L": lambda e: (LOSS, -1, -1, e[0], -1, -1, -1),
    "S": lambda e: (BARRIER, -1, -1, -1, -1, -1, -1),
}


@dataclass(frozen=True, eq=False)
class EventArrays:
    """Columns aligned with ``plan.order.events``, and the edges and per-rank lists as arrays."""

    kind: np.ndarray
    region: np.ndarray
    rank: np.ndarray
    mb: np.ndarray
    comm: np.ndarray
    other_region: np.ndarray
    other_rank: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_is_sequence: np.ndarray
    nodes: tuple[np.ndarray, ...]
    slab_lo: np.ndarray
    """``slab_lo[region, rank]``: the first layer of the slab a stage runs (``plan.slab``)."""
    slab_hi: np.ndarray
    """``slab_hi[region, rank]``: one past its last layer."""
    source_region: int
    """The transposed (Replicated) source region, or -1 without one."""

    @classmethod
    def of(cls, plan: Plan) -> "EventArrays":
        order = plan.order
        n, m = len(order.events), len(order.edges)
        rows = np.fromiter(chain.from_iterable([_ROW[e[-1]](e) for e in order.events]), dtype=np.int64,
                           count=7 * n).reshape(-1, 7)
        src = np.fromiter(map(itemgetter(0), order.edges), dtype=np.int64, count=m)
        dst = np.fromiter(map(itemgetter(1), order.edges), dtype=np.int64, count=m)
        sequence = np.fromiter(map(operator.is_, map(itemgetter(2), order.edges), repeat(EdgeKind.SEQUENCE)),
                               dtype=bool, count=m)
        P = plan.num_ranks
        slab_lo = np.zeros((len(plan.placement) + 1, P), dtype=np.int64)
        slab_hi = np.zeros_like(slab_lo)
        for p in plan.placement:
            slabs = p.owner.slabs if isinstance(p.owner, ByLayer) else (p.layers,) * P
            slab_lo[p.region], slab_hi[p.region] = zip(*slabs)
        first = plan.placement[0]
        return cls(*(np.ascontiguousarray(rows[:, k]) for k in range(7)),
                   src, dst, sequence, tuple(np.fromiter(nodes, dtype=np.int64, count=len(nodes)) for nodes in order.nodes),
                   slab_lo, slab_hi,
                   first.region if not isinstance(first.owner, ByLayer) else -1)

    def index_of(self, kind: int) -> np.ndarray:
        """A dense table ``[region, rank, mb] -> event index`` of one kind of stage event (-1: none)."""
        table = np.full((self.slab_lo.shape[0], self.slab_lo.shape[1], int(self.mb.max(initial=0)) + 1), -1,
                        dtype=np.int64)
        at = np.flatnonzero(self.kind == kind)
        table[self.region[at], self.rank[at], self.mb[at]] = at
        return table

    def is_forward_transfer(self, at: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per event (of ``at``): a transfer of an activation (a Send, or a seam transfer into a later
        region: the source's Gather, a Scatter into an interior or sink transpose), whose tensor is its
        source stage's output; the other transfers carry the gradient of their destination's output."""
        comm, region, other = self.comm[at], self.region[at], self.other_region[at]
        return (self.kind[at] == COLL) & ((comm == COMMS.index(Comm.SEND)) |
                                          ((comm != COMMS.index(Comm.RECV_GRAD)) & (region < other)))

    def is_encode(self) -> np.ndarray:
        """Per event: a forward of the transposed source region (an encode)."""
        return (self.kind == FWD) & (self.region == self.source_region)
