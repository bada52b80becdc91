"""ZeRO stages 2 and 3 (torch FSDP2's ``fully_shard`` per layer): the per-microbatch collectives.

Each layer's weights and gradients are sharded over the ZeRO-1 optimizer shards (the ``dp * cp``
data- and context-parallel ranks; routed experts over ``dp * cp / ep``). What runs per microbatch
depends on the stage and, at stage 3, on the reshard policy
(:attr:`~mpipe_tune.cost.layers.CostOptions.reshard_after_forward`):

- stage 3, resharding after forward (FSDP2's default): a layer's weights are all-gathered before its
  forward and, resharded after it, again before its backward; its gradient is reduce-scattered after
  each backward. Full recomputation re-runs the forward inside the backward, after that backward's
  gather: no gather of its own;
- stage 2: the weights stay whole through the step (gathered once, after the update, as ZeRO-1's
  are); each backward's gradients are reduce-scattered into the rank's shard;
- stage 3 keeping the weights (torch pipelining's UNSHARD before a stage's first forward, RESHARD and
  REDUCE_GRAD after its last backward): one gather and one reduce-scatter a step, ZeRO-1's timing:
  nothing per microbatch.

A layer's gather ``g_l`` is a ring all-gather of its weights (one tensor-parallel rank's, at the compute
dtype) and its reduce-scatter ``r_l`` a ring reduce-scatter of its gradient (at the gradient reduce
dtype), each half of the hierarchical all-reduce of those bytes that ZeRO-1's reduce is timed with
(:func:`~mpipe_tune.cost.profile.hierarchical_all_reduce_s`), on the same data-parallel links; an encoder
layer at its own tensor-parallel degree reduce-scatters over its ``tp / encoder_tp`` replicas too.

Overlap (``overlap_dp_comm``, as the data-parallel reduce's): one communication stream per rank, the
next layer's gather prefetched behind the current layer's compute, the first one exposed. Where a
collective of ``x`` seconds runs beside ``c`` seconds of compute it costs ``x - phi * min(x, c)``
beyond the compute, ``phi`` the profile's measured share of a collective the compute beside it hides
(:attr:`~mpipe_tune.cost.profile.HardwareProfile.overlap_share`; 1: ``max(0, x - c)``, 0: all of
``x``). Per stage event (a slab ``[lo, hi)`` on one microbatch), with ``c_l`` a layer's forward and
``B_l`` its backward seconds (recomputation and per-call overhead included):

- forward: ``g_lo`` and, for each later layer, ``g_l`` beside ``c_{l-1}`` (exact for one stream:
  layer ``l``'s gather starts with layer ``l-1``'s compute);
- backward (layers in reverse): ``g_{hi-1}``, then for each layer ``r_{l+1} + g_{l-1}`` beside
  ``B_l`` (while layer ``l``'s backward computes, the stream carries the reduce-scatter of the layer
  after it and the gather of the layer before it), then ``r_lo``, waited for at the backward's end. The
  sum runs over the slab with the neighbouring slabs' ``r_hi`` and ``g_{lo-1}`` in it, an over-count of
  at most those two where they are not hidden (an upper bound);

without the overlap every gather and reduce-scatter adds whole. A layer gathers before its backward
only if it runs one, and reduce-scatters only if it is trainable (frozen layers: gathers only).

The step-end data-parallel reduce events keep ZeRO-1's timing (:mod:`~mpipe_tune.cost.overlap`: a
reduce-scatter after the last microbatch's backward and an all-gather before the first forward, the
same bytes and the same bucketed overlap): per microbatch they stand for the last microbatch's
reduce-scatters and the first microbatch's forward gathers, so those two are left out here (the gather
half there is timed at the gradient reduce dtype, as ZeRO-1's is: an over-count where weights are
narrower). The collectives' waits computed here are added after that overlap is read off the compute
(the link is busy while a rank waits on it, so the wait hides no reduce): with the order and owners
held, a stage-2 or stage-3 plan's durations are its stage-1 twin's plus these non-negative terms, and
its step time is never below the twin's (the search's dominance,
:meth:`mpipe_tune.search.evaluate.Evaluator.twin_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra.model import Model
from mpipe_tune.cost.layers import CostOptions, LayerTable, footprint_masks
from mpipe_tune.cost.memory import prefix_sums
from mpipe_tune.cost.profile import HardwareProfile, hierarchical_all_reduce_s


@dataclass(frozen=True, eq=False)
class FsdpSums:
    """A layer table's stage-3 waits as the duration pass reads them, each flattened to
    ``(layers + 1) * M``: prefix sums over layers of the forward and backward per-layer terms, and the
    per-event terms of a slab starting (``lo * M + m``) or ending (``hi * M + m``) at a layer."""

    fwd_prefix: np.ndarray
    fwd_head: np.ndarray
    """At ``lo * M + m``: the forward's first gather's exposure beyond the per-layer term."""
    bwd_prefix: np.ndarray
    bwd_head: np.ndarray
    """At ``hi * M + m``: the backward's first gather (of layer ``hi - 1``)."""
    bwd_tail: np.ndarray
    """At ``lo * M + m``: the backward's last reduce-scatter (of layer ``lo``)."""

    def forward_s(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """The waits of forward events whose slab ends and starts at the flat indices ``hi`` and ``lo``."""
        return self.fwd_prefix[hi] - self.fwd_prefix[lo] + self.fwd_head[lo]

    def backward_s(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """The waits of backward events whose slab ends and starts at the flat indices ``hi`` and ``lo``."""
        return self.bwd_prefix[hi] - self.bwd_prefix[lo] + self.bwd_head[hi] + self.bwd_tail[lo]


def layer_collectives_s(table: LayerTable, profile: HardwareProfile,
                        options: CostOptions) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, (all-gather, reduce-scatter) seconds of one microbatch's collective of its weights and
    its gradient (every layer's, trainable or not: the caller masks)."""
    ranks = options.degrees.dp * options.degrees.cp
    tp = table.tp_degrees(options)
    experts = table.expert_params() / tp
    dense = table.param_count / tp - experts
    experts = experts / options.degrees.ep
    span = options.degrees.tp * ranks  # the devices the data-parallel group's members are spread over
    replicas = np.ones_like(dense) if table.layer_replicas is None else table.layer_replicas

    def half(bytes_per_param: float, with_replicas: bool) -> np.ndarray:
        out = np.zeros_like(dense)
        for group in np.unique(replicas) if with_replicas else (1.0,):
            at = (replicas == group) if with_replicas else np.ones(len(dense), dtype=bool)
            size = int(group) * ranks
            out[at] += hierarchical_all_reduce_s(profile, dense[at] * bytes_per_param, size, span // size) / 2
            if options.degrees.ep > 1 and experts[at].any():
                size = ranks // options.degrees.ep
                out[at] += hierarchical_all_reduce_s(profile, experts[at] * bytes_per_param, size, span // size) / 2
        return np.where(table.param_count > 0, out, 0.0)

    return half(float(options.dtype_bytes()), False), half(float(options.grad_reduce_bytes()), True)


def fsdp_sums(table: LayerTable, model: Model, profile: HardwareProfile, options: CostOptions) -> FsdpSums:
    """The per-microbatch waits of ``table`` at ``options``' ZeRO stage (see the module docstring)."""
    gather, scatter = layer_collectives_s(table, profile, options)
    if not options.gathers_per_microbatch:  # ZeRO-2: the weights gathered once a step, with the reduce's
        gather = np.zeros_like(gather)
    if not options.scatters_per_microbatch:
        scatter = np.zeros_like(scatter)
    _, trainable, runs = (m[:, 0] for m in footprint_masks(model.trainable_bits()))
    c = table.fwd_s
    layers, M = c.shape
    later = np.arange(M) > 0  # the first microbatch's forward gathers: the step-end reduce's
    early = np.arange(M) < M - 1  # the last microbatch's reduce-scatters: the step-end reduce's
    g = gather[:, None] * later
    gb = (gather * runs)[:, None] * np.ones(M)
    r = (scatter * trainable)[:, None] * early
    zero_row = np.zeros((1, M))
    fwd_head = np.zeros((layers + 1, M))
    bwd_head = np.zeros((layers + 1, M))
    if options.overlap_dp_comm:
        phi = profile.overlap_share
        previous = np.concatenate((zero_row, c[:-1]))  # c_{l-1}, 0 before the first layer
        fwd_head[:-1] = phi * np.minimum(g, previous)
        fwd = g - fwd_head[:-1]
        B = table.backward_s(model)
        carried = np.concatenate((r[1:], zero_row)) + np.concatenate((zero_row, gb[:-1]))  # r_{l+1} + g_{l-1}
        bwd = (carried - phi * np.minimum(carried, B)) * runs[:, None]
        bwd_head[1:] = gb
        bwd_tail = np.concatenate((r, zero_row))
    else:
        fwd, bwd, bwd_tail = g, gb + r, np.zeros((layers + 1, M))
    return FsdpSums(prefix_sums(fwd), fwd_head.ravel(), prefix_sums(bwd), bwd_head.ravel(), bwd_tail.ravel())
