"""Memory per rank, read off the placement and the order.

Static memory of rank ``r``: the parameters of its slabs and, when the schedule transposes a
region, of that whole region (every rank holds a replica), split over the tensor-parallel group
(and a MoE layer's routed experts over the expert-parallel group too): weights at the compute dtype
for every layer, plus gradients and optimizer state for trainable layers. With ``shard_optimizer``
(ZeRO-1) the optimizer state is sharded over the data- and context-parallel ranks (``dp * cp``,
Megatron-LM's distributed optimizer group), the experts' over their own data-parallel group of
``dp * cp / ep`` ranks, so a rank holds ``1 / (tp * dp * cp)`` of every layer's state. Context-parallel
ranks hold the same weights; their activations are of ``1/cp`` of each sequence (the layer table's).

Activations: a tensor is live from the start of the event that produces it to the finish of its
last consumer on the predicted timeline:

- the activations a stage's forward saves for its backward, from ``Fwd(s, m)`` to ``Bwd(s, m)``
  (a stage without a backward saves nothing);
- a stage's output, from ``Fwd(s, m)`` until the transfer that ships it has finished.

The peak is the largest running sum over the rank's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.events import Bwd, Coll, Comm, Fwd
from mpipe_tune.algebra.model import Model
from mpipe_tune.cost.layers import CostOptions, LayerTable
from mpipe_tune.cost.timing import Timeline


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


def local_params(table: LayerTable, options: CostOptions) -> np.ndarray:
    """Per layer, the parameters one rank holds: split over the tensor-parallel group (the encoder's
    over ``encoder_tp`` where that is set), the routed experts also over the expert-parallel group."""
    tp = table.tp_degrees(options)
    return (table.param_count - table.expert_params() * (1 - 1 / options.ep_degree)) / tp


def per_rank_sum(plan: Plan, per_layer: np.ndarray) -> tuple[float, ...]:
    """Per pipeline rank, the sum of ``per_layer`` over the layers it holds (its slab of every region;
    all of a Replicated region)."""
    out = []
    for r in range(plan.num_ranks):
        total = 0.0
        for p in plan.placement:
            start, stop = plan.slab(p.region, r)
            total += float(per_layer[start:stop].sum())
        out.append(total)
    return tuple(out)


def estimate_static_bytes(plan: Plan, model: Model, table: LayerTable, options: CostOptions) -> tuple[float, ...]:
    trainable = np.array(model.trainable_bits(), dtype=bool)
    ep = options.ep_degree
    tp = table.tp_degrees(options)  # the encoder's layers split over encoder_tp where that is set
    experts = table.expert_params() / (tp * ep)  # a rank's share of the routed experts
    params = local_params(table, options)
    ranks = options.dp_degree * options.cp_degree
    shards, expert_shards = (ranks, ranks // ep) if options.shard_optimizer else (1, 1)
    optimizer = options.optimizer_bytes_per_param / shards
    expert_optimizer = options.optimizer_bytes_per_param / expert_shards
    per_layer = (params * options.dtype_bytes() + params * trainable * (options.grad_bytes_per_param + optimizer)
                 + experts * trainable * (expert_optimizer - optimizer))  # 0 unless ep > 1 with ZeRO-1
    return per_rank_sum(plan, per_layer)


def estimate_memory(
    plan: Plan, model: Model, table: LayerTable, options: CostOptions, timeline: Timeline, capacity_bytes: float
) -> MemoryReport:
    static = estimate_static_bytes(plan, model, table, options)
    saved_prefix = np.vstack((np.zeros((1, table.saved_bytes.shape[1])), np.cumsum(table.saved_bytes, axis=0)))
    index = plan.index
    start, finish = timeline.start_s, timeline.finish_s
    deltas: list[list[tuple[float, float]]] = [[] for _ in range(plan.num_ranks)]
    for i, event in enumerate(plan.order.events):
        if isinstance(event, Fwd):
            lo, hi = plan.slab(event.region, event.rank)
            bwd = index.get(Bwd(event.region, event.rank, event.mb))
            if bwd is not None:
                saved = float(saved_prefix[hi, event.mb] - saved_prefix[lo, event.mb])
                deltas[event.rank] += [(start[i], saved), (finish[bwd], -saved)]
        elif isinstance(event, Coll) and event.comm in (Comm.SEND, Comm.GATHER):
            producer = index[Fwd(event.src[0], event.src[1], event.mb)]
            size = float(table.boundary_bytes[plan.slab(*event.src)[1] - 1, event.mb])
            deltas[event.src[1]] += [(start[producer], size), (finish[i], -size)]
    peaks = []
    # Instants equal up to rounding (the timeline's starts are finish - duration) count as one instant.
    tick = 1e-12 * max(float(finish.max(initial=0.0)), 1e-300)
    for rank_deltas in deltas:
        # Frees before allocations at the same instant: a buffer handed over is reusable at once.
        rank_deltas.sort(key=lambda td: (round(td[0] / tick), td[1]))
        running = peak = 0.0
        for _, delta in rank_deltas:
            running += delta
            peak = max(peak, running)
        peaks.append(peak)
    return MemoryReport(
        static_bytes=static,
        activation_peak_bytes=tuple(peaks),
        peak_bytes=tuple(s + a for s, a in zip(static, peaks)),
        capacity_bytes=capacity_bytes,
    )
