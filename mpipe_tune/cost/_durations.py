"""Durations of every event of a derived order.

- ``Fwd``/``Bwd`` of a stage: the sum over its slab (a Replicated region: all its layers) of the
  layer table's forward, or footprint-gated backward, seconds for that microbatch.
- A split backward (the zero-bubble skeletons): ``Wgrad`` is the slab's weight-gradient seconds
  (trainable layers' ``wgrad_s``: for a matmul its weight GEMM, about the forward GEMM's FLOPs), and
  its ``Bwd`` the rest of the backward (input gradients, attention core included, the per-call overhead
  and any recomputation): the two add up to the unsplit backward.
- ``Coll``: ``alpha + beta * n`` with ``n`` the output bytes of the last layer before the seam, on
  the intra- or inter-node link by where the two pipeline ranks sit; free on one rank.
- ``DpReduce``: the part that the rank's compute does not hide (:mod:`~mpipe_tune.cost._overlap`; all
  of it with ``overlap_dp_comm`` off) of a ring all-reduce of the region's (or slab's) trainable
  gradient bytes over its group:
  DataGroup = the ``dp * cp`` data- and context-parallel ranks of a slab, ReplicaGroup = every
  pipeline rank times those. With expert parallelism a slab's routed-expert gradients (``1/ep`` of
  them per rank) are all-reduced over the experts' own data-parallel group of ``dp * cp / ep``
  ranks, after the rest. A distributed
  optimizer (ZeRO-1) reduce-scatters the gradients and all-gathers the parameters instead: the same
  bytes over the same ring, half of the all-reduce's time each, or each on its own measured link where the
  profile measured both (:func:`~mpipe_tune.cost._profile.sharded_half_s`). Gradients (and here the
  gathered weights) travel in ``grad_reduce_dtype``. Where the framework copies them through flat buffers
  (``flat_buffer_copies``: torch DDP, this project's executor) that memory traffic is added to the reduce.
- ZeRO-2 and ZeRO-3 resharding after forward: the reduces keep ZeRO-1's timing (the last microbatch's
  reduce-scatters, the first microbatch's gathers); the per-microbatch gathers and reduce-scatters are
  sharding actions timed as nodes of their own beside the events
  (:mod:`~mpipe_tune.cost._sharding_events`), not in these durations; ZeRO-3 keeping its weights through
  the step is ZeRO-1's timing.
- The reduces' overlap with compute is scaled by the profile's ``comm_compute_overlap`` ``phi``:
  ``phi * exposed + (1 - phi) * whole`` (1, the default: the bucketed overlap as it is).
- ``Loss`` and ``StepBarrier`` cost nothing (the LM head layer carries the loss's work).
- The optimizer update of each rank is added to its last event before the barrier
  (:mod:`mpipe_tune.cost._update`).

Ranks are laid out with tensor parallelism innermost, then context, data and pipeline, so pipeline
rank ``r`` starts at device ``r * tp * cp * dp``, and ``devices_per_package`` and ``devices_per_node`` decide
which link class a transfer between two ranks takes.

:class:`DurationModel` compiles a plan once into index arrays, so that durations for a new layer
table (another workload) are one compiled pass (:func:`mpipe_tune.cost._kernels.event_durations`)
over the table's prefix sums (:func:`table_sums`, computed once per table), with no per-event Python.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from mpipe_tune.algebra import Plan, Comm, DpReduce, Group, Model
from mpipe_tune.cost import _kernels as kernels
from mpipe_tune.cost._event_arrays import BWD, COLL, COMMS, FWD, REDUCE, WGRAD, EventArrays
from mpipe_tune.cost._layers import CostOptions, LayerTable
from mpipe_tune.cost._memory import prefix_sums
from mpipe_tune.cost._overlap import compile_overlap
from mpipe_tune.cost._profile import PACKAGE_LINK_CLASS, HardwareProfile, hierarchical_all_reduce_s, sharded_half_s
from mpipe_tune.cost._update import estimate_update_s, update_charges

_LINK_OF_COMM = {Comm.SEND: "p2p", Comm.RECV_GRAD: "p2p", Comm.GATHER: "gather", Comm.SCATTER: "scatter"}
_LINK_CLASSES = (PACKAGE_LINK_CLASS, "intra_node", "inter_node")
"""A transfer's link class by its code in :meth:`DurationModel.links`."""


@dataclass(frozen=True, eq=False)
class TableSums:
    """A layer table as the duration pass reads it: per-microbatch prefix sums over layers of the
    forward and footprint-gated backward seconds, flattened to ``(layers + 1) * M``, and the
    boundary bytes flattened to ``layers * M``."""

    table: LayerTable
    fwd_prefix: np.ndarray
    bwd_prefix: np.ndarray
    boundary_bytes: np.ndarray
    wgrad_prefix: np.ndarray | None = None
    """The same prefix sums of the weight-gradient seconds (:meth:`LayerTable.weight_grad_s`)."""


def table_sums(table: LayerTable, model: Model) -> TableSums:
    """The prefix sums of ``table`` (once per table: a search reuses each sampled step's table)."""
    return TableSums(table, prefix_sums(table.fwd_s), prefix_sums(table.backward_s(model)),
                     np.ascontiguousarray(table.boundary_bytes, dtype=float).ravel(),
                     prefix_sums(table.weight_grad_s(model)))


class DurationModel:
    """A plan's events as arrays: which slab and microbatch each compute event reads, which tensor
    each transfer carries and at what alpha-beta rate (zero on one rank), and the fixed cost of each
    reduce."""

    def __init__(self, plan: Plan, model: Model, profile: HardwareProfile, options: CostOptions,
                 arrays: EventArrays | None = None) -> None:
        a = arrays or EventArrays.of(plan)
        M = plan.num_microbatches
        self.model, self.plan, self.profile, self.options = model, plan, profile, options
        self.devices_per_rank = options.degrees.tp * options.degrees.cp * options.degrees.dp
        self.num_events = len(a.kind)
        # Flat indices into the (layers + 1, M) prefix sums and the (layers, M) boundary table.
        self.fwd_idx, self.fwd_hi, self.fwd_lo = _slab_indices(a, FWD, M)
        self.bwd_idx, self.bwd_hi, self.bwd_lo = _slab_indices(a, BWD, M)
        self.wgrad_idx, self.wgrad_hi, self.wgrad_lo = _slab_indices(a, WGRAD, M)
        self.wgrad_bwd = a.once("wgrad bwd", lambda: a.index_of(BWD)[a.region[self.wgrad_idx], a.rank[self.wgrad_idx],
                                                                   a.mb[self.wgrad_idx]] if len(self.wgrad_idx) else self.wgrad_idx)
        """Per ``Wgrad`` event, its stage's ``Bwd`` for the same microbatch (which runs the rest)."""
        self.coll_idx = a.at(COLL)
        comm, region, rank, mb, src_rank, dst_rank = a.once("transfers", lambda: _transfers(a, self.coll_idx))
        self.coll_flat = (a.slab_hi[region, rank] - 1) * M + mb
        self._comm, self._src_rank = comm, src_rank
        self.alpha, self.beta = self.links(comm, src_rank, dst_rank)
        self.reduce_idx = a.at(REDUCE)
        self._reduces = a.once("reduces", lambda: list(zip(self.reduce_idx.tolist(),
                                                           plan.order.events_at(self.reduce_idx))))
        self._reduce_s: np.ndarray | None = None  # depends on parameter counts only: computed once
        self._gather_s: np.ndarray | None = None
        """Of each reduce's seconds, the weights' all-gather (a distributed optimizer's; else 0)."""
        self._overlap = None
        """The reduces' overlap with compute (:mod:`~mpipe_tune.cost._overlap`), compiled with them."""
        self._update: tuple[np.ndarray, np.ndarray] | None = None
        """The optimizer update: (events, seconds), parameter counts and the ranks' orders only, so once."""
        self.order_plan: Callable[[], Plan] = lambda: plan
        """The plan whose per-rank orders the overlap reads (a re-timed plan's differ from ``plan``'s)."""

    def links(self, comm: np.ndarray, src_rank: np.ndarray, dst_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per transfer (codes of :data:`~mpipe_tune.cost._event_arrays.COMMS`, pipeline ranks),
        ``alpha_s`` and ``beta_s_per_byte``: the link class of the two ranks' first devices (inside one package,
        one node, or across nodes); (0, 0) on one rank."""
        per_node, per_package = self.profile.devices_per_node, self.profile.devices_per_package
        src, dst = src_rank * self.devices_per_rank, dst_rank * self.devices_per_rank
        link_class = np.where(src // per_node != dst // per_node, 2, np.where(
            (per_package > 1) & (src // per_package == dst // per_package), 0, 1))
        cross = src_rank != dst_rank
        pair = 3 * comm + link_class  # (transfer kind, link class) as one code
        alpha, beta = np.zeros(3 * len(COMMS) + 1), np.zeros(3 * len(COMMS) + 1)  # the last entry: on one rank
        for code in np.flatnonzero(np.bincount(pair[cross], minlength=3 * len(COMMS))).tolist():
            link = self.profile.link(_LINK_OF_COMM[COMMS[code // 3]], link_class=_LINK_CLASSES[code % 3])
            alpha[code], beta[code] = link.alpha_s, link.beta_s_per_byte  # a point-to-point transfer: alpha + beta * n
        pair = np.where(cross, pair, 3 * len(COMMS))
        return alpha[pair], beta[pair]

    def with_links(self, positions: np.ndarray, alpha: np.ndarray, beta: np.ndarray,
                   order_plan: Callable[[], Plan]) -> "DurationModel":
        """A copy whose transfers at ``positions`` (into :attr:`coll_idx`) run at new rates and whose
        ranks run the orders of ``order_plan()``: the same events moved between ranks (see
        :meth:`mpipe_tune.cost._compiled.CompiledPlan.with_owners`)."""
        out = copy.copy(self)
        out.alpha, out.beta = self.alpha.copy(), self.beta.copy()
        out.alpha[positions], out.beta[positions] = alpha, beta
        out.order_plan, out._reduce_s, out._overlap, out._update = order_plan, None, None, None
        return out

    def transfer_seconds(self, table: TableSums, event: int, dst_ranks: np.ndarray) -> np.ndarray:
        """Seconds of transfer ``event`` (an event index) were it to reach each of ``dst_ranks`` from its
        source rank in the derived plan (zero on one rank): what moving its consumer to another rank
        costs (a Scatter into the transposed region: its source, the first stage, moves with no owner map)."""
        position = int(np.searchsorted(self.coll_idx, event))
        assert self.coll_idx[position] == event, "a transfer event"
        comm = np.full(len(dst_ranks), self._comm[position])
        alpha, beta = self.links(comm, np.full(len(dst_ranks), self._src_rank[position]), np.asarray(dst_ranks))
        return alpha + beta * table.boundary_bytes[self.coll_flat[position]]

    def durations(self, table: LayerTable | TableSums) -> np.ndarray:
        """Seconds per event, aligned with ``plan.order.events``."""
        sums = table if isinstance(table, TableSums) else table_sums(table, self.model)
        out = np.empty(self.num_events)
        kernels.event_durations(sums.fwd_prefix, sums.bwd_prefix, sums.boundary_bytes, self.fwd_idx, self.fwd_hi,
                                self.fwd_lo, self.bwd_idx, self.bwd_hi, self.bwd_lo, self.coll_idx, self.coll_flat,
                                self.alpha, self.beta, self.reduce_idx, self.reduce_seconds(sums.table), out)
        if len(self.wgrad_idx):  # split backwards: the weight gradients move from the Bwd to the Wgrad
            weights = sums.wgrad_prefix[self.wgrad_hi] - sums.wgrad_prefix[self.wgrad_lo]
            out[self.wgrad_idx] = weights
            out[self.wgrad_bwd] = np.maximum(out[self.wgrad_bwd] - weights, 0.0)
        if self._overlap is not None:  # reads the compute events' durations only; phi: the share compute hides
            phi = self.profile.overlap_share
            exposed = self._overlap.exposed(out, self._reduce_s, self._gather_s)
            out[self.reduce_idx] = phi * exposed + (1.0 - phi) * self._reduce_s
        events, seconds = self.update(sums.table)
        out[events] += seconds
        return out

    def update(self, table: LayerTable) -> tuple[np.ndarray, np.ndarray]:
        """The optimizer update as (events, seconds), each rank's on its last event (:func:`update_charges`):
        parameter counts and the ranks' orders only, so once (a re-timed plan's ranks run other orders)."""
        if self._update is None:
            plan = self.order_plan()
            self._update = update_charges(plan, estimate_update_s(plan, self.model, table, self.profile, self.options))
        return self._update

    def packed(self, table: LayerTable) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`durations` as :func:`~mpipe_tune.cost._kernels.step_makespan` reads it: (the section sizes,
        then the index arrays, as int64; the transfers' alphas and betas, the reduces' and updates' seconds);
        None where the durations take more than that pass (split backwards, reduces overlapped with compute).
        ``table``: one of the plan's tables (its parameter counts)."""
        if len(self.wgrad_idx) or self._overlap is not None:
            return None
        reduce_s = self.reduce_seconds(table)
        events, seconds = self.update(table)
        sizes = [len(self.fwd_idx), len(self.bwd_idx), len(self.coll_idx), len(self.reduce_idx), len(events)]
        ints = np.concatenate([np.asarray(sizes, dtype=np.int64)] + [np.asarray(a, dtype=np.int64) for a in (
            self.fwd_idx, self.fwd_hi, self.fwd_lo, self.bwd_idx, self.bwd_hi, self.bwd_lo, self.coll_idx,
            self.coll_flat, self.reduce_idx, events)])
        rates = np.concatenate([np.asarray(a, dtype=float) for a in (self.alpha, self.beta, reduce_s, seconds)])
        return ints, rates

    def reduce_seconds(self, table: LayerTable) -> np.ndarray:
        """Seconds of each reduce (aligned with :attr:`reduce_idx`): parameter counts only, so once."""
        if self._reduce_s is None:
            reduce_options = _reduce_options(self.options)
            timed = np.array([_reduce_s(self.plan, e, self.model, table, self.profile, reduce_options)
                              for _, e in self._reduces], dtype=float).reshape(-1, 2)
            self._reduce_s, self._gather_s = timed[:, 0].copy(), timed[:, 1].copy()
            # The overlap only moves data-parallel reduce time around: without any, there is none.
            data = [k for k, (_, e) in enumerate(self._reduces) if e.group is Group.DATA]
            if self._reduce_s[data].any():
                self._overlap = compile_overlap(self.order_plan(), self._reduces, self.model, table, self.options)
        return self._reduce_s


def _slab_indices(a: EventArrays, kind: int, M: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The events of one compute kind, and the flat prefix-sum indices of their slab's end and start."""
    at = a.at(kind)
    region, rank, mb = a.once(("stages", kind), lambda: (a.region[at], a.rank[at], a.mb[at]))
    return at, a.slab_hi[region, rank] * M + mb, a.slab_lo[region, rank] * M + mb


def _transfers(a: EventArrays, at: np.ndarray) -> tuple[np.ndarray, ...]:
    """Of the transfers ``at``: their kinds, the stage and microbatch of the tensor each carries (the source's
    output for an activation, else the destination's output's gradient), and their source and destination ranks."""
    forward = a.is_forward_transfer(at)
    region = np.where(forward, a.region[at], a.other_region[at])
    rank = np.where(forward, a.rank[at], a.other_rank[at])
    return a.comm[at], region, rank, a.mb[at], a.rank[at], a.other_rank[at]


def _reduce_s(plan: Plan, event: DpReduce, model: Model, table: LayerTable, profile: HardwareProfile,
              options: CostOptions) -> tuple[float, float]:
    """(seconds, the part of them that is the weights' all-gather) of a reduce event (the module docstring)."""
    start, stop = plan.slab(event.region, 0 if event.rank is None else event.rank)
    trainable = np.array(model.trainable_bits()[start:stop], dtype=bool)
    ranks = options.degrees.dp * options.degrees.cp  # the data- and context-parallel ranks of a slab
    if table.layer_replicas is not None:  # the encoder's own degree: its gradients reduce on their own
        encoder = trainable & (table.layer_replicas[start:stop] > 1)
        encoder_bytes = float(table.param_count[start:stop][encoder].sum()) / options.encoder_tp
        group = options.encoder_replicas * (plan.num_ranks * ranks if event.group is Group.REPLICA else ranks)
        span = options.degrees.tp * (plan.num_ranks * ranks if event.group is Group.REPLICA else ranks)
        encoder_s = _all_reduce_s(profile, encoder_bytes * options.grad_bytes_per_param, group, span) + \
            _copies_s(profile, options, encoder_bytes, group, False)
        rest_s, gather_s = _reduce_s(plan, event, model, replace(table, layer_replicas=None, param_count=np.where(
            table.layer_replicas > 1, 0.0, table.param_count)), profile, options)
        return encoder_s + rest_s, gather_s
    params = float(table.param_count[start:stop][trainable].sum()) / options.degrees.tp
    experts = (0.0 if table.expert_param_count is None
               else float(table.expert_param_count[start:stop][trainable].sum()) / options.degrees.tp)
    span_devices = options.degrees.tp * ranks
    if event.group is Group.REPLICA:
        group_size = plan.num_ranks * ranks
        return _all_reduce_s(profile, params * options.grad_bytes_per_param, group_size, plan.num_ranks * span_devices) \
            + _copies_s(profile, options, params, group_size, False), 0.0
    layers = float(np.count_nonzero(table.param_count[start:stop][trainable]))  # FSDP2: a collective each
    expert_layers = (0.0 if table.expert_param_count is None
                     else float(np.count_nonzero(table.expert_param_count[start:stop][trainable])))
    dense_tensors, expert_tensors = (float(t[start:stop][trainable].sum()) for t in table.tensor_counts())
    parts = [(params - experts, ranks, layers, dense_tensors),
             (experts / options.degrees.ep, ranks // options.degrees.ep, expert_layers,
              expert_tensors / options.degrees.ep)] \
        if options.degrees.ep > 1 and experts > 0 else [(params, ranks, layers, dense_tensors + expert_tensors)]
    total = gather = 0.0
    for count, group_size, units, tensors in parts:  # with expert parallelism the routed experts after the rest
        total += _copies_s(profile, options, count, group_size, options.shard_optimizer)
        if not options.shard_optimizer:
            total += _all_reduce_s(profile, count * options.grad_bytes_per_param, group_size, span_devices)
            continue
        stride = span_devices // group_size
        size = count * options.grad_bytes_per_param
        copies = float(fsdp_copies_s(profile, options, size, units, tensors)) if group_size > 1 else 0.0
        scatter_s = sharded_half_s(profile, "reduce_scatter", size, group_size, stride) + copies
        gather_s = sharded_half_s(profile, "all_gather", size, group_size, stride) + copies
        total, gather = total + scatter_s + gather_s, gather + gather_s
    return total, gather


def _copies_s(profile: HardwareProfile, options: CostOptions, params: float, group_size: int, sharded: bool) -> float:
    """Seconds of the flat-buffer copies around a reduce of ``params`` gradients over ``group_size`` ranks
    (:attr:`~mpipe_tune.cost._layers.CostOptions.flat_buffer_copies`; ZeRO 0 and 1 only, FSDP2's own copies are
    :func:`fsdp_copies_s`): an all-reduce copies the gradients in and the sums back out, each read once
    and written once; a distributed optimizer (``sharded``) copies the gradients in, and its update the weights
    in and the gathered ones back out."""
    if not options.flat_buffer_copies or group_size <= 1 or options.zero_stage >= 2:
        return 0.0
    gradients = 2.0 * params * options.grad_bytes_per_param
    copied = gradients + 4.0 * params * options.dtype_bytes() if sharded else 2.0 * gradients
    return copied / profile.memory_bytes_per_s


def fsdp_copies_s(profile: HardwareProfile, options: CostOptions, size_bytes, collectives=1.0, tensors=0.0):
    """What FSDP2 adds to ``collectives`` all-gathers or reduce-scatters of ``size_bytes`` unsharded bytes and
    ``tensors`` parameter tensors in all (numbers or arrays): the profile's ``fsdp_bytes_s`` a byte (its copies
    into and out of its flat buffers), ``fsdp_collective_s`` a collective and ``fsdp_tensor_s`` a tensor (its work
    on each), where the plan runs FSDP2 (ZeRO 2 or 3 over a data-parallel group that shards), else 0."""
    added = (profile.fsdp_bytes_s * size_bytes + profile.fsdp_collective_s * np.asarray(collectives, dtype=float)
             + profile.fsdp_tensor_s * np.asarray(tensors, dtype=float))
    return added if options.runs_fsdp2 else 0.0 * added


@lru_cache(maxsize=64)
def _reduce_options(options: CostOptions) -> CostOptions:
    """The options a reduce is timed with: gradients in their reduce dtype."""
    return replace(options, grad_bytes_per_param=float(options.grad_reduce_bytes()))


def _all_reduce_s(profile: HardwareProfile, size_bytes: float, group_size: int, span_devices: int) -> float:
    """An all-reduce over ``group_size`` ranks whose devices span ``span_devices`` (one every
    ``span_devices / group_size`` devices): :func:`hierarchical_all_reduce_s`."""
    return hierarchical_all_reduce_s(profile, size_bytes, group_size, span_devices // group_size)
