"""ZeRO stages 2 and 3 (torch FSDP2's ``fully_shard`` per layer): the per-microbatch sharding actions priced
on the timeline.

Each layer's weights and gradients are sharded over the ZeRO-1 optimizer shards (the ``dp * cp``
data- and context-parallel ranks; routed experts over ``dp * cp / ep``). Derive's per-microbatch actions
(:func:`~mpipe_tune.algebra._sharding.microbatch_actions`) say what runs around each event: at stage 3
resharding after forward an ``unshard`` before every forward and backward and a ``reducegrad`` after every
backward, at stage 2 the ``reducegrad`` only. Each action is a node of its own on its rank's program in the
timeline (:meth:`mpipe_tune.cost._timing.CompiledOrder.with_actions`): an ``unshard`` starts when the rank's
previous event ends (the gather issued ahead of the forward, as torch pipelining's UNSHARD is, not after its
input arrives) and its event waits for it; a ``reducegrad`` starts when its backward ends and the rank's next
event waits for it, while the backward's sends to other ranks do not. Stage 3 keeping its weights, and the
once-a-step gather and reduce-scatter of every stage (the step-level actions of
:func:`~mpipe_tune.algebra._sharding.sharded_program`), are the step-end reduce events' (ZeRO-1's timing,
:mod:`~mpipe_tune.cost._overlap`): per microbatch they stand for the first microbatch's forward gathers and
the last microbatch's reduce-scatters, whose actions here are priced at zero (the gathers there are timed at
the gradient reduce dtype, as ZeRO-1's are: an over-count where weights are narrower).

A layer's gather ``g_l`` is a ring all-gather of its weights (one tensor-parallel rank's, at the compute
dtype) and its reduce-scatter ``r_l`` a ring reduce-scatter of its gradient (at the gradient reduce dtype),
each timed as ZeRO-1's reduce times its halves (:func:`~mpipe_tune.cost._profile.sharded_half_s`: half of the
hierarchical all-reduce of those bytes, or the measured collective where the profile has both), on the same
data-parallel links; an encoder
layer at its own tensor-parallel degree reduce-scatters over its ``tp / encoder_tp`` replicas too.

An action's node lasts what its collectives keep the rank's compute waiting: one communication stream per
rank, the next layer's gather prefetched behind the current layer's compute (``overlap_dp_comm``, as the
data-parallel reduce's). Where a collective of ``x`` seconds runs beside ``c`` seconds of compute it costs
``x - phi * min(x, c)`` beyond the compute, ``phi`` the profile's measured share of a collective the compute
beside it hides (:attr:`~mpipe_tune.cost._profile.HardwareProfile.overlap_share`; 1: ``max(0, x - c)``, 0: all
of ``x``). Per event (a slab ``[lo, hi)`` on one microbatch), with ``c_l`` a layer's forward and ``B_l`` its
backward seconds (recomputation and per-call overhead included):

- ``unshard`` before a forward: ``g_lo`` and, for each later layer, ``g_l`` beside ``c_{l-1}`` (exact for
  one stream: layer ``l``'s gather starts with layer ``l-1``'s compute);
- ``unshard`` before a backward: ``g_{hi-1}``, the first layer the backward needs;
- ``reducegrad`` after a backward (layers in reverse): for each layer ``r_{l+1} + g_{l-1}`` beside ``B_l``
  (while layer ``l``'s backward computes, the one stream carries the reduce-scatter of the layer after it
  and the gather of the layer before it: the stream's wait inside the backward, charged on the action that
  ends it), then ``r_lo``, waited for at the backward's end. The sum runs over the slab with the
  neighbouring slabs' ``r_hi`` and ``g_{lo-1}`` in it, an over-count of at most those two where they are
  not hidden (an upper bound);

Deferred (:attr:`~mpipe_tune.cost._layers.CostOptions.defer_gradient_reduce`, ZeRO-2 with the overlap): the
reduce-scatters run asynchronously, one backward's in flight, as the Llama 3 paper describes its FSDP
("asynchronously ... reducing gradients", arXiv:2407.21783 section 3.3.2). A backward's ``r_lo`` is then waited
for where the rank's next backward ends, beside the compute in between (its events from the one backward's
end to the other's: ``r_lo - phi * min(r_lo, compute)``, idle time not counted as cover), and the stream's
wait inside a backward counts only the slab's own layers (``r_{l+1}`` for ``l + 1 < hi``: exact);

without the overlap every gather adds whole on the ``unshard`` and every reduce-scatter on the
``reducegrad``. A layer gathers before its backward only if it runs one, and reduce-scatters only if it
is trainable (frozen layers: gathers only). A split backward (the zero-bubble skeletons) takes its stage's
actions at its ``Bwd``.

Torch FSDP2's own host work is the profile's ``fsdp_host_s`` per sharded layer (one with weights) per forward
or backward call (its pre- and post-hooks), its ``fsdp_bytes_s`` per byte of a layer's unsharded buffer per
collective (the copies into and out of its flat buffers), its ``fsdp_collective_s`` per collective (what its
collectives take back to back beyond the links' price) and its ``fsdp_tensor_s`` per parameter tensor of the layer
per collective (its work on each tensor), part of each gather and reduce-scatter, the step-end ones
too (:func:`~mpipe_tune.cost._durations.fsdp_copies_s`); :mod:`mpipe_tune.profiler._fsdp_host` measures them, 0
where the profile does not give them. Where any is above 0 every stage-2 and stage-3 plan takes the
three actions per microbatch (keeping the weights too: the hooks run whether or not a collective does), and
each ``unshard`` carries its event's layers' hook seconds, whole (the host issues the collectives: nothing
hides it).

The collectives wait after the step-end overlap has read the compute (the link is busy while a rank waits
on it, so the wait hides no reduce): a stage-2 or stage-3 plan's events last as long as its stage-1 twin's
and its program adds non-negative nodes, so its step time is never below the twin's (the search's
dominance, :meth:`mpipe_tune.search._evaluate.Evaluator.twin_s`). On one pipeline rank (each rank's program
a chain) the step equals its events' durations with each action's seconds added to its event.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import Model, UNSHARD, microbatch_actions
from mpipe_tune.cost._durations import TableSums, fsdp_copies_s
from mpipe_tune.cost._event_arrays import BWD, FWD, WGRAD, EventArrays
from mpipe_tune.cost._layers import CostOptions, LayerTable, footprint_masks
from mpipe_tune.cost._memory import prefix_sums
from mpipe_tune.cost._profile import HardwareProfile, sharded_half_s


def layer_collectives_s(table: LayerTable, profile: HardwareProfile,
                        options: CostOptions) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, (all-gather, reduce-scatter) seconds of one microbatch's collective of its weights and
    its gradient (every layer's, trainable or not: the caller masks)."""
    ranks = options.degrees.dp * options.degrees.cp
    tp = table.tp_degrees(options)
    dense_tensors, expert_tensors = table.tensor_counts()
    ep = options.degrees.ep
    routed = table.expert_params() / tp if ep > 1 else np.zeros_like(table.param_count)  # at ep 1: the layer's unit
    dense, experts = table.param_count / tp - routed, routed / ep  # the experts: each rank's share, its own unit
    dense_tensors, expert_tensors = (dense_tensors, expert_tensors / ep) if ep > 1 else \
        (dense_tensors + expert_tensors, expert_tensors * 0.0)
    span = options.degrees.tp * ranks  # the devices the data-parallel group's members are spread over
    replicas = np.ones_like(dense) if table.layer_replicas is None else table.layer_replicas

    def half(collective: str, bytes_per_param: float, with_replicas: bool) -> np.ndarray:
        out = np.zeros_like(dense)
        for group in np.unique(replicas) if with_replicas else (1.0,):
            at = (replicas == group) if with_replicas else np.ones(len(dense), dtype=bool)
            size = int(group) * ranks
            out[at] += sharded_half_s(profile, collective, dense[at] * bytes_per_param, size, span // size) \
                + fsdp_copies_s(profile, options, dense[at] * bytes_per_param, 1.0, dense_tensors[at]) * (size > 1)
            if ep > 1 and experts[at].any():
                size = ranks // ep
                out[at] += sharded_half_s(profile, collective, experts[at] * bytes_per_param, size, span // size) \
                    + fsdp_copies_s(profile, options, experts[at] * bytes_per_param, experts[at] > 0,
                                    expert_tensors[at]) * (size > 1)
        return np.where(table.param_count > 0, out, 0.0)

    return (half("all_gather", float(options.dtype_bytes()), False),
            half("reduce_scatter", float(options.grad_reduce_bytes()), True))


@dataclass(frozen=True, eq=False)
class ActionTerms:
    """A layer table's per-layer terms of the three action kinds as the pricing pass reads them, each
    flattened to ``(layers + 1) * M``: an action at a slab ``[lo, hi)`` of microbatch ``m`` lasts
    ``prefix[hi] - prefix[lo] + head[hi] + tail[lo]`` (flat indices ``hi * M + m``, ``lo * M + m``)."""

    forward_unshard: tuple[np.ndarray, np.ndarray, np.ndarray]
    backward_unshard: tuple[np.ndarray, np.ndarray, np.ndarray]
    reduce_grad: tuple[np.ndarray, np.ndarray, np.ndarray]


def action_terms(table: LayerTable, model: Model, profile: HardwareProfile, options: CostOptions) -> ActionTerms:
    """The terms of ``table``'s actions at ``options``' ZeRO stage (see the module docstring)."""
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
    zero_row, none = np.zeros((1, M)), np.zeros((layers + 1) * M)
    host = (profile.fsdp_host_s * (table.param_count > 0))[:, None] * np.ones(M)  # per layer and call
    host_fwd, host_bwd = prefix_sums(host), prefix_sums(host * runs[:, None])
    if options.scatter_deferred:  # the slab's own reduce-scatters beside its backward; its last one deferred
        inside = r[1:] - profile.overlap_share * np.minimum(r[1:], table.backward_s(model)[:-1])
        inside = np.concatenate((inside, zero_row)) * runs[:, None]
        return ActionTerms((host_fwd, none, none), (host_bwd, none, none),
                           (prefix_sums(inside), -np.concatenate((zero_row, inside)).ravel(),
                            np.concatenate((r, zero_row)).ravel()))
    if not options.overlap_dp_comm:
        return ActionTerms((prefix_sums(g) + host_fwd, none, none), (prefix_sums(gb) + host_bwd, none, none),
                           (prefix_sums(r), none, none))
    phi = profile.overlap_share
    previous = np.concatenate((zero_row, c[:-1]))  # c_{l-1}, 0 before the first layer
    fwd_head = np.concatenate((phi * np.minimum(g, previous), zero_row))
    carried = np.concatenate((r[1:], zero_row)) + np.concatenate((zero_row, gb[:-1]))  # r_{l+1} + g_{l-1}
    inside = (carried - phi * np.minimum(carried, table.backward_s(model))) * runs[:, None]
    return ActionTerms((prefix_sums(g - fwd_head[:-1]) + host_fwd, none, fwd_head.ravel()),
                       (host_bwd, np.concatenate((zero_row, gb)).ravel(), none),
                       (prefix_sums(inside), none, np.concatenate((r, zero_row)).ravel()))


_TERMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept_terms(table: LayerTable | TableSums, model: Model, profile: HardwareProfile,
                options: CostOptions) -> ActionTerms:
    """:func:`action_terms` of ``table``, kept with its prefix sums where it comes with them (every plan of a
    search that reads the table reads the same terms)."""
    if not isinstance(table, TableSums):
        return action_terms(table, model, profile, options)
    kept = _TERMS.setdefault(table, {})
    key = (model.trainable_bits(), profile, options)
    if key not in kept:
        kept[key] = action_terms(table.table, model, profile, options)
    return kept[key]


class ShardingEvents:
    """A plan's per-microbatch sharding actions compiled for pricing: each action's kind, the event it is
    placed at (``at``), whether it runs after that event, and the flat slab indices its terms are read at."""

    def __init__(self, arrays: EventArrays, M: int, model: Model, profile: HardwareProfile,
                 options: CostOptions) -> None:
        self.model, self.profile, self.options = model, profile, options
        a = arrays
        hooks = takes_hooks(profile, options)
        kinds, self.at = a.once(("sharding", options.zero_stage, options.reshard_after_forward, hooks),
                                lambda: microbatch_actions(a, zero_stage=options.zero_stage, hooks=hooks,
                                                           reshards_after_forward=options.reshard_after_forward))
        self.after = kinds != UNSHARD
        event_kind = a.kind[self.at]
        region, rank, mb = a.region[self.at], a.rank[self.at], a.mb[self.at]
        self.hi = a.slab_hi[region, rank] * M + mb
        self.lo = a.slab_lo[region, rank] * M + mb
        self.forward_unshard = np.flatnonzero(~self.after & (event_kind == FWD))
        self.backward_unshard = np.flatnonzero(~self.after & (event_kind == BWD))
        self.reduce_grad = np.flatnonzero(self.after)
        self.deferred = _deferred_waits(a, self.at[self.reduce_grad]) if options.scatter_deferred else None

    def __len__(self) -> int:
        return len(self.at)

    def seconds(self, table: LayerTable | TableSums, durations: np.ndarray | None = None) -> np.ndarray:
        """Each action's seconds on ``table`` (aligned with :attr:`at`); a deferred reduce-scatter's wait reads the
        events' ``durations`` (aligned with the plan's events) for the compute that covers it."""
        terms = _kept_terms(table, self.model, self.profile, self.options)
        out = np.empty(len(self.at))
        for which, (prefix, head, tail) in ((self.forward_unshard, terms.forward_unshard),
                                            (self.backward_unshard, terms.backward_unshard),
                                            (self.reduce_grad, terms.reduce_grad)):
            hi, lo = self.hi[which], self.lo[which]
            if which is self.reduce_grad and self.deferred is not None:
                assert durations is not None, "a deferred reduce-scatter's wait reads the events' durations"
                sequence, is_compute, position, previous = self.deferred
                covered = np.concatenate(([0.0], np.cumsum(durations[sequence] * is_compute)))
                pending = np.where(previous >= 0, tail[lo[previous]], 0.0)
                cover = covered[position + 1] - covered[position[previous] + 1]
                wait = pending - self.profile.overlap_share * np.minimum(pending, cover)
                out[which] = prefix[hi] - prefix[lo] + head[hi] + np.where(previous >= 0, wait, 0.0)
                continue
            out[which] = prefix[hi] - prefix[lo] + head[hi] + tail[lo]
        return out


def _deferred_waits(a: EventArrays, backwards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For the reduce-scatters after ``backwards`` (in that order): the ranks' programs as one sequence of events,
    which of them compute (what covers a collective), each backward's place in it, and the index (into
    ``backwards``) of the same rank's previous backward with a reduce-scatter (-1 for a rank's first)."""
    sequence = np.concatenate(a.nodes)
    place = np.empty(len(a.kind), dtype=np.int64)
    place[sequence] = np.arange(len(sequence))
    is_compute = np.isin(a.kind[sequence], (FWD, BWD, WGRAD)).astype(float)
    position = place[backwards]
    by = np.lexsort((position, a.rank[backwards]))
    previous = np.full(len(backwards), -1, dtype=np.int64)
    same = a.rank[backwards][by][1:] == a.rank[backwards][by][:-1]
    previous[by[1:][same]] = by[:-1][same]
    return sequence, is_compute, position, previous


def sharding_events(arrays: EventArrays, M: int, model: Model, profile: HardwareProfile,
                    options: CostOptions) -> ShardingEvents | None:
    """The :class:`ShardingEvents` of a plan's ``arrays`` (``M`` microbatches) at ``options``' ZeRO setting;
    None where it has no per-microbatch action (stages 0 and 1, stage 3 keeping its weights without
    FSDP2's host work priced)."""
    if not (options.scatters_per_microbatch or takes_hooks(profile, options)):
        return None
    return ShardingEvents(arrays, M, model, profile, options)


def takes_hooks(profile: HardwareProfile, options: CostOptions) -> bool:
    """Whether FSDP2's per-layer host work is priced: the profile gives it (per call, byte, collective or tensor),
    the plan runs FSDP2 (stage 2 or 3) and its data-parallel group shards something."""
    return profile.prices_fsdp2 and options.runs_fsdp2
