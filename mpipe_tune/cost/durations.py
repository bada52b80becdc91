"""Durations of every event of a derived order.

- ``Fwd``/``Bwd`` of a stage: the sum over its slab (a Replicated region: all its layers) of the
  layer table's forward, or footprint-gated backward, seconds for that microbatch.
- ``Coll``: ``alpha + beta * n`` with ``n`` the output bytes of the last layer before the seam, on
  the intra- or inter-node link by where the two pipeline ranks sit; free on one rank.
- ``DpReduce``: the part that the rank's compute does not hide (:mod:`~mpipe_tune.cost.overlap`; all
  of it with ``overlap_dp_comm`` off) of a ring all-reduce of the region's (or slab's) trainable
  gradient bytes over its group:
  DataGroup = the ``dp * cp`` data- and context-parallel ranks of a slab, ReplicaGroup = every
  pipeline rank times those. With expert parallelism a slab's routed-expert gradients (``1/ep`` of
  them per rank) are all-reduced over the experts' own data-parallel group of ``dp * cp / ep``
  ranks, after the rest. A distributed
  optimizer (ZeRO-1) reduce-scatters the gradients and all-gathers the parameters instead: the same
  bytes over the same ring, half of them each. Gradients travel in ``grad_reduce_dtype``.
- ``Loss`` and ``StepBarrier`` cost nothing (the LM head layer carries the loss's work).
- The optimizer update of each rank is added to its last event before the barrier
  (:mod:`mpipe_tune.cost.update`).

Ranks are laid out with tensor parallelism innermost, then context, data and pipeline, so pipeline
rank ``r`` starts at device ``r * tp * cp * dp`` and ``devices_per_node`` decides which links are
inter-node.

:class:`DurationModel` compiles a plan once into index arrays, so that durations for a new layer
table (another workload) are a few numpy gathers, with no per-event Python on the hot path.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.events import Bwd, Coll, Comm, DpReduce, Fwd, Group
from mpipe_tune.algebra.model import Model
from mpipe_tune.cost.layers import CostOptions, LayerTable
from mpipe_tune.cost.overlap import compile_overlap
from mpipe_tune.cost.profile import HardwareProfile, estimate_collective_s
from mpipe_tune.cost.update import estimate_update_s, update_charges

_LINK_OF_COMM = {Comm.SEND: "p2p", Comm.RECV_GRAD: "p2p", Comm.GATHER: "gather", Comm.SCATTER: "scatter"}


class DurationModel:
    """A plan's events as arrays: which slab and microbatch each compute event reads, which tensor
    each transfer carries and at what alpha-beta rate, and the fixed cost of each reduce."""

    def __init__(self, plan: Plan, model: Model, profile: HardwareProfile, options: CostOptions) -> None:
        self.model = model
        events = plan.order.events
        n = len(events)
        devices_per_rank = options.tp_degree * options.cp_degree * options.dp_degree
        self.fwd_idx, self.bwd_idx, self.coll_idx = [], [], []
        fwd_slab, bwd_slab, coll_tensor = [], [], []
        alpha, beta = [], []
        self._reduces: list[tuple[int, DpReduce]] = []
        for i, event in enumerate(events):
            if isinstance(event, Fwd):
                self.fwd_idx.append(i)
                fwd_slab.append((*plan.slab(event.region, event.rank), event.mb))
            elif isinstance(event, Bwd):
                self.bwd_idx.append(i)
                bwd_slab.append((*plan.slab(event.region, event.rank), event.mb))
            elif isinstance(event, Coll) and event.src[1] != event.dst[1]:
                producer = event.src if event.comm in (Comm.SEND, Comm.GATHER) else event.dst
                self.coll_idx.append(i)
                coll_tensor.append((plan.slab(*producer)[1] - 1, event.mb))
                node_src = (event.src[1] * devices_per_rank) // profile.devices_per_node
                node_dst = (event.dst[1] * devices_per_rank) // profile.devices_per_node
                link = profile.link(_LINK_OF_COMM[event.comm], inter_node=node_src != node_dst)
                alpha.append(link.alpha_s)  # a point-to-point transfer: alpha + beta * n
                beta.append(link.beta_s_per_byte)
            elif isinstance(event, DpReduce):
                self._reduces.append((i, event))
        # Flat indices into the (layers + 1, M) prefix sums and the (layers, M) boundary table.
        M = plan.num_microbatches
        fwd_slab = np.array(fwd_slab, dtype=np.int64).reshape(-1, 3)
        bwd_slab = np.array(bwd_slab, dtype=np.int64).reshape(-1, 3)
        coll_tensor = np.array(coll_tensor, dtype=np.int64).reshape(-1, 2)
        self.fwd_hi, self.fwd_lo = fwd_slab[:, 1] * M + fwd_slab[:, 2], fwd_slab[:, 0] * M + fwd_slab[:, 2]
        self.bwd_hi, self.bwd_lo = bwd_slab[:, 1] * M + bwd_slab[:, 2], bwd_slab[:, 0] * M + bwd_slab[:, 2]
        self.coll_flat = coll_tensor[:, 0] * M + coll_tensor[:, 1]
        self.fwd_idx = np.array(self.fwd_idx, dtype=np.int64)
        self.bwd_idx = np.array(self.bwd_idx, dtype=np.int64)
        self.coll_idx = np.array(self.coll_idx, dtype=np.int64)
        self.alpha = np.array(alpha)
        self.beta = np.array(beta)
        self.num_events = n
        self.plan, self.profile, self.options = plan, profile, options
        self._reduce_s: np.ndarray | None = None  # depends on parameter counts only: computed once
        self._update: tuple[np.ndarray, np.ndarray] | None = None  # the optimizer update, likewise

    def durations(self, table: LayerTable) -> np.ndarray:
        """Seconds per event, aligned with ``plan.order.events``."""
        out = np.zeros(self.num_events)
        fwd = _prefix(table.fwd_s)
        bwd = _prefix(table.backward_s(self.model))
        if self._reduce_s is None:
            reduce_options = replace(self.options, grad_bytes_per_param=float(self.options.grad_reduce_bytes()))
            self._reduce_s = np.array([_reduce_s(self.plan, e, self.model, table, self.profile, reduce_options)
                                       for _, e in self._reduces])
            self._reduce_idx = np.array([i for i, _ in self._reduces], dtype=np.int64)
            self._overlap = compile_overlap(self.plan, self._reduces, self.model, table, self.options)
        fwd, bwd = fwd.ravel(), bwd.ravel()
        out[self.fwd_idx] = fwd[self.fwd_hi] - fwd[self.fwd_lo]
        out[self.bwd_idx] = bwd[self.bwd_hi] - bwd[self.bwd_lo]
        out[self.coll_idx] = self.alpha + self.beta * table.boundary_bytes.ravel()[self.coll_flat]
        reduce_s = self._reduce_s if self._overlap is None else self._overlap.exposed(out, self._reduce_s)
        out[self._reduce_idx] = reduce_s
        if self._update is None:  # parameter counts only, like the reduces
            self._update = update_charges(self.plan, estimate_update_s(self.plan, self.model, table, self.profile,
                                                                       self.options))
        out[self._update[0]] += self._update[1]
        return out


def estimate_durations(
    plan: Plan, model: Model, table: LayerTable, profile: HardwareProfile, options: CostOptions
) -> np.ndarray:
    """Seconds per event, aligned with ``plan.order.events``."""
    return DurationModel(plan, model, profile, options).durations(table)


def _prefix(per_layer: np.ndarray) -> np.ndarray:
    out = np.zeros((per_layer.shape[0] + 1, per_layer.shape[1]))
    np.cumsum(per_layer, axis=0, out=out[1:])
    return out


def _reduce_s(plan: Plan, event: DpReduce, model: Model, table: LayerTable, profile: HardwareProfile, options: CostOptions) -> float:
    start, stop = plan.slab(event.region, 0 if event.rank is None else event.rank)
    trainable = np.array(model.trainable_bits()[start:stop], dtype=bool)
    ranks = options.dp_degree * options.cp_degree  # the data- and context-parallel ranks of a slab
    if table.layer_replicas is not None:  # the encoder's own degree: its gradients reduce on their own
        encoder = trainable & (table.layer_replicas[start:stop] > 1)
        encoder_bytes = float(table.param_count[start:stop][encoder].sum()) / options.encoder_tp
        group = options.encoder_replicas * (plan.num_ranks * ranks if event.group is Group.REPLICA else ranks)
        span = options.tp_degree * (plan.num_ranks * ranks if event.group is Group.REPLICA else ranks)
        encoder_s = _all_reduce_s(profile, encoder_bytes * options.grad_bytes_per_param, group, span)
        return encoder_s + _reduce_s(plan, event, model, replace(table, layer_replicas=None, param_count=np.where(
            table.layer_replicas > 1, 0.0, table.param_count)), profile, options)
    params = float(table.param_count[start:stop][trainable].sum()) / options.tp_degree
    experts = float(table.expert_params()[start:stop][trainable].sum()) / options.tp_degree
    if event.group is Group.DATA and options.ep_degree > 1 and experts > 0:
        dense = _all_reduce_s(profile, (params - experts) * options.grad_bytes_per_param, ranks,
                              options.tp_degree * ranks)
        expert_group = ranks // options.ep_degree
        return dense + _all_reduce_s(profile, experts / options.ep_degree * options.grad_bytes_per_param,
                                     expert_group, options.tp_degree * ranks)
    size_bytes = params * options.grad_bytes_per_param
    if event.group is Group.REPLICA:
        group_size = plan.num_ranks * ranks
        span_devices = plan.num_ranks * options.tp_degree * ranks
    else:
        group_size = ranks
        span_devices = options.tp_degree * ranks
    return _all_reduce_s(profile, size_bytes, group_size, span_devices)


def _all_reduce_s(profile: HardwareProfile, size_bytes: float, group_size: int, span_devices: int) -> float:
    """An all-reduce over ``group_size`` ranks whose devices span ``span_devices`` (one every
    ``span_devices / group_size`` devices): :func:`hierarchical_all_reduce_s`."""
    return hierarchical_all_reduce_s(profile, size_bytes, group_size, span_devices // group_size)


def hierarchical_all_reduce_s(profile: HardwareProfile, size_bytes: float, group_size: int, stride: int) -> float:
    """An all-reduce over ``group_size`` ranks placed one every ``stride`` devices, as NCCL runs it
    across nodes: with ``k`` members on each node (``devices_per_node / stride``, at most the group),
    a ring reduce-scatter inside each node, a ring all-reduce of each rank's ``1/k`` share across the
    nodes over the rank's own inter-node link, and a ring all-gather inside the node. One node: the
    intra-node ring all-reduce; one member per node: the inter-node ring all-reduce of everything.

    >>> from mpipe_tune.specs import load_profile
    >>> h100 = load_profile("h100-sxm")
    >>> flat = hierarchical_all_reduce_s(h100, 8e9, 16, 8)  # tp8: one member per node
    >>> split = hierarchical_all_reduce_s(h100, 8e9, 16, 1)  # two full nodes: 8 NICs share the bytes
    >>> round(flat / split, 1)
    5.9
    """
    if group_size == 1:
        return 0.0
    per_node = max(1, min(group_size, profile.devices_per_node // stride)) if stride <= profile.devices_per_node else 1
    nodes = -(-group_size // per_node)
    intra = profile.link("all_reduce", inter_node=False)
    if nodes == 1:
        return estimate_collective_s(intra, "all_reduce", size_bytes, group_size)
    inter = profile.link("all_reduce", inter_node=True)
    return (estimate_collective_s(intra, "all_reduce", size_bytes, per_node)
            + estimate_collective_s(inter, "all_reduce", size_bytes / per_node, nodes))
