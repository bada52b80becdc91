"""A derived order's events and edges as integer columns (:class:`~mpipe_tune.algebra._plan.OrderColumns`:
derive builds them, an order built from event objects reads them off in one pass), with the slabs.

The compiled parts of a plan (:class:`~mpipe_tune.cost._timing.CompiledOrder`,
:class:`~mpipe_tune.cost._durations.DurationModel`, :class:`~mpipe_tune.cost._memory.MemoryLayout`)
are built from these columns with array operations, so compiling a derived plan touches none of its
event objects, whatever it compiles.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpipe_tune.algebra import BARRIER, BWD, COLL, COMMS, FWD, LOSS, REDUCE, WGRAD, OrderColumns, Plan, Comm, ByLayer

__all__ = ["BARRIER", "BWD", "COLL", "COMMS", "FWD", "LOSS", "REDUCE", "WGRAD", "EventArrays"]


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
    shared: dict[Any, Any] = field(default_factory=dict, repr=False)
    """What :meth:`once` made for this order, shared by every plan of the same order object."""

    @classmethod
    def of(cls, plan: Plan) -> "EventArrays":
        c = plan.order.columns
        P = plan.num_ranks
        slab_lo = np.zeros((len(plan.placement) + 1, P), dtype=np.int64)
        slab_hi = np.zeros_like(slab_lo)
        for p in plan.placement:
            slabs = p.owner.slabs if isinstance(p.owner, ByLayer) else (p.layers,) * P
            slab_lo[p.region], slab_hi[p.region] = zip(*slabs)
        source = plan.source
        return cls(c.kind, c.region, c.rank, c.mb, c.comm, c.other_region, c.other_rank,
                   c.edge_src, c.edge_dst, c.edge_is_sequence, c.nodes, slab_lo, slab_hi,
                   source.region if source is not None else -1, _shared_by(c))

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once per order object and shared by every plan of it (see :func:`_shared_by`):
        for what reads the order alone (its columns and the region and rank counts, never the slabs).
        An array made here (or in a tuple made here) is read-only."""
        if key not in self.shared:
            made = make()
            for array in made if isinstance(made, tuple) else (made,):
                if isinstance(array, np.ndarray):
                    array.flags.writeable = False
            self.shared[key] = made
        return self.shared[key]

    def at(self, kind: int) -> np.ndarray:
        """The indices of the events of one kind."""
        return self.once(("at", kind), lambda: np.flatnonzero(self.kind == kind))

    def index_of(self, kind: int) -> np.ndarray:
        """A dense table ``[region, rank, mb] -> event index`` of one kind of stage event (-1: none)."""
        def make() -> np.ndarray:
            table = np.full((self.slab_lo.shape[0], self.slab_lo.shape[1], int(self.mb.max(initial=0)) + 1), -1,
                            dtype=np.int64)
            at = self.at(kind)
            table[self.region[at], self.rank[at], self.mb[at]] = at
            return table

        return self.once(("index_of", kind), make)

    def is_forward_transfer(self, at: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per event (of ``at``): a transfer of an activation (a Send, or a seam transfer into a later
        region: the source's Gather, a Scatter into an interior or sink transpose), whose tensor is its
        source stage's output; the other transfers carry the gradient of their destination's output."""
        def make() -> np.ndarray:
            comm, region, other = self.comm, self.region, self.other_region
            return (self.kind == COLL) & ((comm == COMMS.index(Comm.SEND)) |
                                          ((comm != COMMS.index(Comm.RECV_GRAD)) & (region < other)))

        return self.once("is_forward_transfer", make)[at]

    def is_encode(self) -> np.ndarray:
        """Per event: a forward of the transposed source region (an encode)."""
        return self.once("is_encode", lambda: (self.kind == FWD) & (self.region == self.source_region))


ORDERS_KEPT = 16
"""How many orders' shared results :func:`_shared_by` keeps (the last used)."""
_SHARED: OrderedDict[int, tuple[OrderColumns, dict[Any, Any]]] = OrderedDict()


def _shared_by(columns: OrderColumns) -> dict[Any, Any]:
    """The results :meth:`EventArrays.once` made for the order of ``columns``, by identity: derive gives
    the candidates that differ only in their slabs one order object
    (:func:`mpipe_tune.algebra._derive._order`), so what reads that order alone is made once for all of
    them. An entry holds its columns, so no other object takes their id while it is kept."""
    key = id(columns)
    entry = _SHARED.get(key)
    if entry is None:
        entry = _SHARED[key] = (columns, {})
        if len(_SHARED) > ORDERS_KEPT:
            _SHARED.popitem(last=False)
    else:
        _SHARED.move_to_end(key)
    return entry[1]
