"""Memory per rank, read off the placement and the order.

Static memory of rank ``r``: the parameters of its slabs and of every region the schedule transposes
(source, interior or sink: every rank holds a replica of it whole), split over the tensor-parallel group
(and a MoE layer's routed experts over the expert-parallel group too): weights at the compute dtype
for every layer, plus gradients and optimizer state for trainable layers. With ``shard_optimizer``
(ZeRO-1) the optimizer state is sharded over the data- and context-parallel ranks (``dp * cp``,
Megatron-LM's distributed optimizer group), the experts' over their own data-parallel group of
``dp * cp / ep`` ranks, so a rank holds ``1 / (tp * dp * cp)`` of every layer's state. With
``shard_parameters`` (ZeRO-3, FSDP) the weights (frozen layers' too) and the gradients are sharded over
those same ranks, and the rank also holds a working set while it computes: the largest of its layers'
full weights twice (the layer computing and the next one prefetched, at the compute dtype) and the
largest of its trainable layers' full gradient before its reduce-scatter (at the gradient's bytes per
parameter); full means gathered over the data-parallel shards, still split over tp (and ep). With
``shard_gradients`` (ZeRO-2) the gradients and the state are sharded so, the weights held whole, and the
largest full gradient is held as at stage 3
(twice where the reduce-scatters run deferred, one pending while the next backward makes its own). ZeRO-3 that keeps the weights through the step
(``reshard_after_forward`` off) holds, at its peak, what ZeRO-1 holds: every weight and gradient of its
slabs whole (sharded between steps only). Context-parallel ranks hold the same weights; their activations are of ``1/cp`` of each sequence (the
layer table's).

Activations: a tensor is live from the start of the event that produces it to the finish of its
last consumer on the predicted timeline:

- the activations a stage's forward saves for its backward, from ``Fwd(s, m)`` to ``Bwd(s, m)``
  (a stage without a backward saves nothing), or to ``Wgrad(s, m)`` where the backward is split (the
  zero-bubble skeletons: the weight gradients read the saved inputs of the weight GEMMs); an encoder
  backward moved to another rank (full recomputation, :mod:`mpipe_tune.algebra._encoder_backward`)
  re-runs the encode there, so that rank holds the same saved bytes (the layers' inputs) from the
  start of the ``Bwd`` to its finish, and the owner none for it (a layer's transient activations
  while it is recomputed are not charged, on the owner or elsewhere);
- a stage's output, from ``Fwd(s, m)`` until the transfer that ships it has finished;
- with a split backward, what ``Bwd(s, m)`` leaves for ``Wgrad(s, m)``: the output gradients the
  weight GEMMs read (and under recomputation the re-created activations), from the start of the
  ``Bwd`` to the finish of the ``Wgrad`` (:attr:`~mpipe_tune.cost._layers.LayerTable.wgrad_kept_bytes`).

The peak is the largest running sum over the rank's timeline.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import Plan, Model
from mpipe_tune.cost import _kernels as kernels
from mpipe_tune.cost._event_arrays import BWD, FWD, WGRAD, EventArrays
from mpipe_tune.cost._layers import CostOptions, LayerTable
from mpipe_tune.cost._timing import Timeline


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per pipeline rank."""

    static_bytes: tuple[float, ...]
    activation_peak_bytes: tuple[float, ...]
    peak_bytes: tuple[float, ...]
    capacity_bytes: float

    @property
    def over_capacity(self) -> tuple[bool, ...]:
        return tuple(p > self.capacity_bytes for p in self.peak_bytes)

    @property
    def fits(self) -> bool:
        return not any(self.over_capacity)


def estimate_static_bytes(plan: Plan, model: Model, table: LayerTable, options: CostOptions) -> tuple[float, ...]:
    """Per rank, the bytes of its weights, gradients and optimizer state."""
    return static_bytes_of(rank_layers(plan), model, table, options)


def rank_layers(plan: Plan) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, the layer ranges ``[start, stop)`` whose weights it holds (one per region)."""
    return tuple(tuple(plan.slab(p.region, r) for p in plan.placement) for r in range(plan.num_ranks))


def local_params(table: LayerTable, options: CostOptions) -> np.ndarray:
    """Per layer, the parameters one rank holds: split over the tensor-parallel group (the encoder's
    over ``encoder_tp`` where that is set), the routed experts also over the expert-parallel group."""
    tp = table.tp_degrees(options)
    return (table.param_count - table.expert_params() * (1 - 1 / options.degrees.ep)) / tp


def per_rank_sum(layers: tuple[tuple[tuple[int, int], ...], ...], per_layer: np.ndarray) -> tuple[float, ...]:
    """Per rank, the sum of ``per_layer`` over the layer ranges it holds (:func:`rank_layers`)."""
    out = []
    for ranges in layers:
        total = 0.0
        for start, stop in ranges:
            total += float(per_layer[start:stop].sum())
        out.append(total)
    return tuple(out)


def static_bytes_of(layers: tuple[tuple[tuple[int, int], ...], ...], model: Model, table: LayerTable,
                    options: CostOptions) -> tuple[float, ...]:
    """Per rank, the static bytes of the layer ranges it holds (:func:`rank_layers`): what the
    placement alone decides, before any order exists."""
    trainable = np.array(model.trainable_bits(), dtype=bool)
    ep = options.degrees.ep
    experts = table.expert_params() / (table.tp_degrees(options) * ep)  # a rank's share of the routed experts
    params = local_params(table, options)
    ranks = options.degrees.dp * options.degrees.cp
    shards, expert_shards = (ranks, ranks // ep) if options.shard_optimizer else (1, 1)
    optimizer = options.optimizer_bytes_per_param / shards
    expert_optimizer = options.optimizer_bytes_per_param / expert_shards
    if options.scatters_per_microbatch:  # ZeRO-2, and ZeRO-3 resharding after forward: gradients sharded
        weights = options.dtype_bytes()
        state = trainable * (options.grad_bytes_per_param + options.optimizer_bytes_per_param)
        if options.shard_parameters:  # ZeRO-3: the weights too, two layers' whole weights at a time
            whole, state = 0.0, state + weights
            gathered = per_rank_max(layers, 2.0 * params * weights)
        else:  # ZeRO-2: the weights whole through the step
            whole, gathered = weights, (0.0,) * len(layers)
        per_layer = params * whole + (params - experts) * state / shards + experts * state / expert_shards
        held = 2.0 if options.scatter_deferred else 1.0  # deferred: the pending one and the one being made
        gradient = per_rank_max(layers, held * params * trainable * options.grad_bytes_per_param)
        return tuple(s + g + d for s, g, d in zip(per_rank_sum(layers, per_layer), gathered, gradient))
    per_layer = (params * options.dtype_bytes() + params * trainable * (options.grad_bytes_per_param + optimizer)
                 + experts * trainable * (expert_optimizer - optimizer))  # 0 unless ep > 1 with ZeRO-1
    return per_rank_sum(layers, per_layer)


def per_rank_max(layers: tuple[tuple[tuple[int, int], ...], ...], per_layer: np.ndarray) -> tuple[float, ...]:
    """Per rank, the largest of ``per_layer`` over the layer ranges it holds (0 for none)."""
    return tuple(max((float(per_layer[start:stop].max()) for start, stop in ranges if stop > start), default=0.0)
                 for ranges in layers)


class MemoryLayout:
    """An order's live tensors as arrays, compiled once: for each, the rank that holds it, the
    events whose start and finish bound its life, and where its size is in the layer table.

    The first ``num_saved`` tensors are saved activations (size: a slab's difference of the saved
    bytes' per-microbatch prefix sums), the next ``num_outputs`` stage outputs (size: one boundary
    entry), the rest what split backwards keep for their weight gradients (a slab's difference of the
    kept bytes' prefix sums)."""

    def __init__(self, plan: Plan, arrays: EventArrays | None = None) -> None:
        a = arrays or EventArrays.of(plan)
        M = plan.num_microbatches
        self.num_ranks = plan.num_ranks
        # Which tensors live when reads the order alone (once per order); their sizes read the slabs.
        self.num_saved, self.num_outputs, region, self.rank, mb, self.alloc_event, self.free_event = a.once(
            "live tensors", lambda: _live_tensors(a))
        o = self.num_saved + self.num_outputs
        self.hi = a.slab_hi[region, self.rank] * M + mb
        self.hi[self.num_saved:o] -= M  # a stage output: the boundary entry of the slab's last layer
        self.lo = a.slab_lo[region, self.rank] * M + mb
        self.lo[self.num_saved:o] = 0

    def moved(self, positions: np.ndarray, ranks: np.ndarray, alloc_events: np.ndarray | None = None) -> "MemoryLayout":
        """A copy whose tensors at ``positions`` live on new ``ranks`` (an owner change), allocated by
        ``alloc_events`` where given (an encoder backward moved to another rank, or back)."""
        out = copy.copy(self)
        out.rank = self.rank.copy()
        out.rank[positions] = ranks
        if alloc_events is not None:
            out.alloc_event = self.alloc_event.copy()
            out.alloc_event[positions] = alloc_events
        return out

    def activation_peaks(self, table: LayerTable, start_s: np.ndarray, finish_s: np.ndarray) -> np.ndarray:
        """Per rank, the peak of live activation bytes on the timeline."""
        k, o = self.num_saved, self.num_saved + self.num_outputs
        saved_prefix = prefix_sums(table.saved_bytes)
        size = np.concatenate((saved_prefix[self.hi[:k]] - saved_prefix[self.lo[:k]],
                               np.asarray(table.boundary_bytes, dtype=float).ravel()[self.hi[k:o]]))
        if o < len(self.hi) and table.wgrad_kept_bytes is not None:
            kept_prefix = prefix_sums(table.wgrad_kept_bytes)
            size = np.concatenate((size, kept_prefix[self.hi[o:]] - kept_prefix[self.lo[o:]]))
        elif o < len(self.hi):
            size = np.concatenate((size, np.zeros(len(self.hi) - o)))
        time = np.concatenate((start_s[self.alloc_event], finish_s[self.free_event]))
        delta = np.concatenate((size, -size))
        rank = np.concatenate((self.rank, self.rank))
        # Per rank in time order, frees before allocations at the same instant: a buffer handed
        # over is reusable at once. Instants equal up to rounding (the timeline's starts are finish -
        # duration) count as one instant.
        tick = 1e-12 * max(float(finish_s.max(initial=0.0)), 1e-300)
        by = np.lexsort((delta, np.rint(time / tick), rank))
        return kernels.running_peaks(rank[by], delta[by], self.num_ranks)

    def report(self, static: tuple[float, ...], table: LayerTable, timeline: Timeline,
               capacity_bytes: float) -> MemoryReport:
        peaks = self.activation_peaks(table, timeline.start_s, timeline.finish_s).tolist()
        return MemoryReport(
            static_bytes=static,
            activation_peak_bytes=tuple(peaks),
            peak_bytes=tuple(s + a for s, a in zip(static, peaks)),
            capacity_bytes=capacity_bytes,
        )


def _live_tensors(a: EventArrays) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tensors of :class:`MemoryLayout`: how many are saved activations and stage outputs, and per
    tensor the region, rank and microbatch of its stage and the events that allocate and free it."""
    # Saved activations: a forward whose stage has a backward for that microbatch.
    forwards = a.at(FWD)
    backward = a.index_of(BWD)[a.region[forwards], a.rank[forwards], a.mb[forwards]]
    saved, backward = forwards[backward >= 0], backward[backward >= 0]
    # A moved encoder backward (on another rank than its encode, under full recomputation): its
    # rank re-runs the encode, so it holds what the encode saves from its Bwd's start to its
    # finish, and the owner's encode, whose backward runs elsewhere, saves nothing.
    moved = moved_encoder_backwards(a)
    saved, backward = np.concatenate((saved, moved)), np.concatenate((backward, moved))
    region, rank, mb = a.region[saved], a.rank[saved], a.mb[saved]
    # Split backwards: the saved activations live until the weight gradients, and the Bwd's output
    # gradients from the Bwd until then.
    weights = a.at(WGRAD)
    if len(weights):
        last_use = a.index_of(WGRAD)[region, rank, mb]
        backward = np.where(last_use >= 0, last_use, backward)
    k_bwd = a.index_of(BWD)[a.region[weights], a.rank[weights], a.mb[weights]] if len(weights) else weights
    k_region, k_rank, k_mb = a.region[weights], a.rank[weights], a.mb[weights]
    # Stage outputs: from the producing forward until the transfer that ships them (a Send, or a
    # Gather or Scatter into the next region).
    shipped = np.flatnonzero(a.is_forward_transfer())
    s_region, s_rank, s_mb = a.region[shipped], a.rank[shipped], a.mb[shipped]
    return (len(saved), len(shipped), np.concatenate((region, s_region, k_region)), np.concatenate((rank, s_rank, k_rank)),
            np.concatenate((mb, s_mb, k_mb)), np.concatenate((saved, a.index_of(FWD)[s_region, s_rank, s_mb], k_bwd)),
            np.concatenate((backward, shipped, weights)))


def moved_encoder_backwards(a: EventArrays) -> np.ndarray:
    """The encoder backwards (of the transposed source region) that run on another rank than their
    microbatch's encode (:mod:`mpipe_tune.algebra._encoder_backward`)."""
    if a.source_region < 0:
        return np.zeros(0, dtype=np.int64)
    backwards = np.flatnonzero((a.kind == BWD) & (a.region == a.source_region))
    return backwards[a.index_of(FWD)[a.region[backwards], a.rank[backwards], a.mb[backwards]] < 0]


def prefix_sums(per_layer: np.ndarray) -> np.ndarray:
    """Per-microbatch prefix sums over the layers of a ``(layers, M)`` table, flattened to
    ``(layers + 1) * M``: a slab ``[lo, hi)`` of microbatch m sums to ``p[hi * M + m] - p[lo * M + m]``."""
    out = np.zeros((per_layer.shape[0] + 1, per_layer.shape[1]))
    np.cumsum(per_layer, axis=0, out=out[1:])
    return out.ravel()
