"""Durations of every event of a derived order.

- ``Fwd``/``Bwd`` of a stage: the sum over its slab (a Replicated region: all its layers) of the
  layer table's forward, or footprint-gated backward, seconds for that microbatch.
- ``Coll``: ``alpha + beta * n`` with ``n`` the output bytes of the last layer before the seam, on
  the intra- or inter-node link by where the two pipeline ranks sit; free on one rank.
- ``DpReduce``: ring all-reduce of the region's (or slab's) trainable gradient bytes over its group:
  DataGroup = the ``dp`` replicas of a slab, ReplicaGroup = every pipeline rank times ``dp``.
- ``Loss`` and ``StepBarrier`` cost nothing (the LM head layer carries the loss's work).

Ranks are laid out with tensor parallelism innermost, then data, then pipeline, so pipeline rank
``r`` starts at device ``r * tp * dp`` and ``devices_per_node`` decides which links are inter-node.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.events import Bwd, Coll, Comm, DpReduce, Fwd, Group
from mpipe_tune.algebra.model import Model
from mpipe_tune.cost.layers import CostOptions, LayerTable
from mpipe_tune.cost.profile import HardwareProfile, estimate_collective_s

_LINK_OF_COMM = {Comm.SEND: "p2p", Comm.RECV_GRAD: "p2p", Comm.GATHER: "gather", Comm.SCATTER: "scatter"}


def estimate_durations(
    plan: Plan, model: Model, table: LayerTable, profile: HardwareProfile, options: CostOptions
) -> np.ndarray:
    """Seconds per event, aligned with ``plan.order.events``."""
    fwd_prefix = _prefix(table.fwd_s)
    bwd_prefix = _prefix(table.backward_s(model))
    devices_per_rank = options.tp_degree * options.dp_degree
    durations = np.zeros(len(plan.order.events))
    for i, event in enumerate(plan.order.events):
        if isinstance(event, (Fwd, Bwd)):
            start, stop = plan.slab(event.region, event.rank)
            prefix = fwd_prefix if isinstance(event, Fwd) else bwd_prefix
            durations[i] = prefix[stop, event.mb] - prefix[start, event.mb]
        elif isinstance(event, Coll):
            durations[i] = _transfer_s(plan, event, table, profile, devices_per_rank)
        elif isinstance(event, DpReduce):
            durations[i] = _reduce_s(plan, event, model, table, profile, options)
    return durations


def _prefix(per_layer: np.ndarray) -> np.ndarray:
    return np.vstack((np.zeros((1, per_layer.shape[1])), np.cumsum(per_layer, axis=0)))


def _node_of(rank: int, devices_per_rank: int, devices_per_node: int) -> int:
    return (rank * devices_per_rank) // devices_per_node


def _transfer_s(plan: Plan, event: Coll, table: LayerTable, profile: HardwareProfile, devices_per_rank: int) -> float:
    src_rank, dst_rank = event.src[1], event.dst[1]
    if src_rank == dst_rank:
        return 0.0
    forward = event.comm in (Comm.SEND, Comm.GATHER)
    producer = event.src if forward else event.dst  # the stage whose output the tensor is
    last_layer = plan.slab(*producer)[1] - 1
    size_bytes = float(table.boundary_bytes[last_layer, event.mb])
    inter = _node_of(src_rank, devices_per_rank, profile.devices_per_node) != _node_of(
        dst_rank, devices_per_rank, profile.devices_per_node
    )
    link = profile.link(_LINK_OF_COMM[event.comm], inter_node=inter)
    return estimate_collective_s(link, "p2p", size_bytes, 2)


def _reduce_s(plan: Plan, event: DpReduce, model: Model, table: LayerTable, profile: HardwareProfile, options: CostOptions) -> float:
    start, stop = plan.slab(event.region, 0 if event.rank is None else event.rank)
    trainable = np.array(model.trainable_bits()[start:stop], dtype=bool)
    params = float(table.param_count[start:stop][trainable].sum()) / options.tp_degree
    size_bytes = params * options.grad_bytes_per_param
    if event.group is Group.REPLICA:
        group_size = plan.num_ranks * options.dp_degree
        span_devices = plan.num_ranks * options.tp_degree * options.dp_degree
    else:
        group_size = options.dp_degree
        span_devices = options.tp_degree * options.dp_degree
    if group_size == 1:
        return 0.0
    link = profile.link("all_reduce", inter_node=span_devices > profile.devices_per_node)
    return estimate_collective_s(link, "all_reduce", size_bytes, group_size)
