"""A plan file read for execution: per-rank event lists and the transfers between them.

The runtime decides nothing about a schedule; everything it does is read off the plan's order
graph, generically for every event:

- a rank event's incoming edges from ``Coll`` events are what it receives before it runs, its
  outgoing edges to ``Coll`` events what it sends after it runs;
- a transfer produced by a ``Fwd`` carries that forward's output (an activation), one produced by a
  ``Bwd`` carries the gradient of that backward's input; the consumer uses it as its input
  (``Fwd``) or as the gradient of its output (``Bwd``);
- a ``Bwd`` computes its input gradient only if it has an outgoing transfer (the footprint gates
  are already in the graph), and a stage's ``Fwd`` records autograd only if its ``Bwd`` exists;
- a ``Bwd`` fed by a ``Loss`` starts the backward from that microbatch's loss.

Both ends of a transfer compute its shape from the stored workload (the output shape of the layer
at the boundary), so variable image sizes need no shape header on the wire.

The view is built from the algebra's :class:`~mpipe_tune.algebra._plan.Plan`: the runtime reads plans
only through :func:`mpipe_tune.plan_file._resolve`, which derives the file's candidate again on the
plan's model and checks that the stored order is exactly that derivation; the file contributes the
workload and the predicted figures. Nothing here imports torch or ``report``: the CLI runs these checks before any
process starts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from mpipe_tune.algebra import Candidate
from mpipe_tune.algebra import (
    Action, Bwd, Coll, DpReduce, Event, Fwd, Group, Loss, ReduceGrad, Reshard, StepBarrier, Unshard, Wgrad,
)
from mpipe_tune.algebra import Model, ByLayer, Plan, sharded_program
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import Microbatch
from mpipe_tune.plan_file import PlanFile, ResolvedPlan, Section, resolve
from mpipe_tune.runtime._layout import ParallelLayout

ACTIONS = (Unshard, Reshard, ReduceGrad)
"""The sharding actions a rank's program may hold beside its event indices."""

Stage = tuple[int, int]


@dataclass(frozen=True)
class Transfer:
    """One ``Coll`` event as the runtime sees it: who produces it, who consumes it, what it carries."""

    index: int
    """The Coll's event index (also the message tag)."""
    producer: int
    """Event index of the Fwd or Bwd that produces the payload."""
    consumer: int
    """Event index of the Fwd or Bwd that consumes it."""
    src_rank: int
    dst_rank: int
    gradient: bool
    """True when the payload is a gradient (produced by a Bwd)."""
    boundary_layer: int
    """The model layer whose output (or output gradient) travels."""
    mb: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class PlanView:
    path: str
    section: Section = field(repr=False)
    """The plan's stored section (its candidate, workload and predicted figures)."""
    file: PlanFile = field(repr=False)
    """The plan file (its inputs: the model and profile, the framework options)."""
    candidate: Candidate
    model: Model = field(repr=False)
    """The plan's model (its frozen blocks frozen), checked against the file's hash."""
    plan: Plan = field(repr=False)
    """``derive`` of the candidate: what the stored order was checked against and the view is read from."""
    events: tuple[Event, ...]
    nodes: tuple[tuple[int, ...], ...]
    """Per rank, its event indices in the order it runs them."""
    microbatches: tuple[Microbatch, ...]
    durations_s: tuple[float, ...]
    predicted_step_s: float
    predicted_peak_bytes: tuple[float, ...]
    """Per pipeline rank, its predicted peak memory."""
    region_layers: dict[int, tuple[int, int]]
    """Region -> its layers [start, stop)."""
    stage_slabs: dict[Stage, tuple[int, int]]
    """Sharded stage (region, rank) -> its slab [start, stop)."""
    recvs: dict[int, tuple[Transfer, ...]]
    sends: dict[int, tuple[Transfer, ...]]
    loss_source: dict[int, int]
    """Loss event index -> the Fwd event whose output is the microbatch's loss."""
    loss_fed: dict[int, int]
    """Bwd event index -> the Loss event that starts it."""
    backward_stages: frozenset[tuple[int, int, int]]
    """(region, rank, mb) that have a Bwd event."""

    @property
    def num_ranks(self) -> int:
        return len(self.nodes)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def layout(self) -> ParallelLayout:
        """The plan's (pp, dp, cp, tp) grid of ranks and its expert-parallel degree."""
        c = self.candidate
        return ParallelLayout(c.pp, c.dp, c.tp, c.cp, c.ep, c.encoder_tp)

    @property
    def dtype(self) -> str:
        """The compute dtype the plan was predicted for."""
        return self.candidate.dtype

    @property
    def schedule(self) -> str:
        return self.candidate.schedule

    def program(self, rank: int) -> tuple[int | Action, ...]:
        """Rank ``rank``'s event indices in the order it runs them, with its stages' ZeRO sharding actions
        between them (:func:`~mpipe_tune.algebra._sharding.sharded_program`: none but at stage 2 and stage 3
        keeping the weights)."""
        c, index = self.candidate, self.plan.index
        program = sharded_program(self.plan, rank, zero_stage=c.zero_stage,
                                  reshards_after_forward=c.reshards_after_forward)
        return tuple(e if isinstance(e, ACTIONS) else index[e] for e in program)

    def slab(self, region: int, rank: int) -> tuple[int, int]:
        """The layers ``Fwd(region, rank, m)`` runs: its slab, or the whole region when replicated."""
        return self.stage_slabs.get((region, rank), self.region_layers[region])

    def layers_of(self, rank: int) -> tuple[int, ...]:
        """Model layer indices rank ``rank`` must hold: its slabs, plus every region it reduces
        (the whole replicated region, even when it owns none of its microbatches)."""
        layers: set[int] = set()
        for i in self.nodes[rank]:
            event = self.events[i]
            if isinstance(event, (Fwd, Bwd)):
                layers.update(range(*self.slab(event.region, event.rank)))
            elif isinstance(event, DpReduce):
                start, stop = self.reduce_layers(event, rank)
                layers.update(range(start, stop))
        return tuple(sorted(layers))

    def reduce_layers(self, event: DpReduce, rank: int) -> tuple[int, int]:
        if event.group is Group.REPLICA:
            return self.region_layers[event.region]
        return self.slab(event.region, rank if event.rank is None else event.rank)

    def needs_input_grad(self, bwd_index: int) -> bool:
        return bool(self.sends.get(bwd_index))

    def records_autograd(self, fwd: Fwd) -> bool:
        return (fwd.region, fwd.rank, fwd.mb) in self.backward_stages


def read_plan_file(path: str, model: Model | None = None, *, plan_name: str | None = None,
                   model_spec: str | None = None) -> PlanView:
    """A plan file's plan ``plan_name`` (default: the best; or one of its stored baselines or
    alternatives), resolved (:func:`~mpipe_tune.plan_file._resolve`) on its model: ``model``, or the one
    the file names (``model_spec``: where it moved to)."""
    return _view(resolve(path, plan_name, model=model if model is not None else model_spec))


def validate_runnable(view: PlanView, world_size: int | None = None, compute: str = "real") -> None:
    """What this runtime cannot run, as one-line errors, before any process group exists. Emulated
    compute runs every layout (its events sleep their predicted seconds, which charge what each degree
    costs; its reduces join their real groups); real compute runs pp x dp x cp x tp with expert
    parallelism, sequence parallelism and the encoder's own tp (with the encoder inside one stage)."""
    c = view.candidate
    emulated = "; run it with compute mode emulated" if compute == "real" else ""
    if compute == "real" and c.encoder_tp is not None:
        inside = sorted({start for start in _slab_starts(view) if 0 < start < view.model.encoder_end})
        if inside:
            raise MpipeError(f"plan file {view.path} is planned with encoder tensor-parallel degree {c.encoder_tp} "
                             f"under tp {c.tp} and a stage starting at encoder layer {inside[0]}; the runtime's "
                             f"encoder groups gather their images' features after the whole encoder, so a cut inside "
                             f"it cannot run; re-plan with the encoder in one stage{emulated}",
                             quantities=("compute mode",))
    if world_size is not None:
        view.layout.validate_world_size(world_size, f"plan file {view.path}")


def _slab_starts(view: PlanView) -> list[int]:
    """The first layer of every slab (a Sharded region's per rank, a Replicated region's whole)."""
    starts = []
    for p in view.plan.placement:
        slabs = p.owner.slabs if isinstance(p.owner, ByLayer) else (p.layers,)
        starts += [start for start, stop in slabs if start < stop]
    return starts


def _view(resolved: ResolvedPlan) -> PlanView:
    section, plan = resolved.section, resolved.plan
    return PlanView(path=resolved.file.path, section=section, file=resolved.file,
                    candidate=section.candidate, model=section.candidate.model_of(resolved.model), plan=plan,
                    microbatches=section.workload.microbatches, durations_s=section.predicted.durations_s,
                    predicted_step_s=section.predicted_step_s, predicted_peak_bytes=section.peak_bytes,
                    **_graph(plan))


def view_of_step(view: PlanView, plan: Plan, microbatches: tuple[Microbatch, ...], durations_s: tuple[float, ...],
                 predicted_step_s: float) -> PlanView:
    """``view`` for one step that runs ``plan`` (the stored plan with another owner map, as derive gives
    it) on ``microbatches``, with that step's predicted durations and step time; the file's other
    figures (its predicted peaks) stay the stored plan's."""
    assert len(microbatches) == view.num_microbatches and len(durations_s) == len(plan.order.events)
    graph = {} if plan is view.plan else _graph(plan)  # the same plan: the same events and transfers
    return replace(view, plan=plan, microbatches=tuple(microbatches), durations_s=tuple(durations_s),
                   predicted_step_s=predicted_step_s, **graph)


def rank_pairs(view: PlanView) -> set[tuple[int, int]]:
    """The (low, high) pipeline-rank pairs that exchange transfers in ``view``."""
    return {(min(t.src_rank, t.dst_rank), max(t.src_rank, t.dst_rank))
            for ts in view.sends.values() for t in ts if not t.is_local}


def _graph(plan: Plan) -> dict[str, Any]:
    """The view's fields read off the plan's graph: events, per-rank order, transfers, losses."""
    events = plan.order.events
    nodes = plan.order.nodes
    region_layers: dict[int, tuple[int, int]] = {p.region: p.layers for p in plan.placement}
    stage_slabs: dict[Stage, tuple[int, int]] = {
        (p.region, rank): slab for p in plan.placement if isinstance(p.owner, ByLayer)
        for rank, slab in enumerate(p.owner.slabs)
    }

    preds: dict[int, list[int]] = defaultdict(list)
    succs: dict[int, list[int]] = defaultdict(list)
    for s, t, _kind in plan.order.edges:
        succs[s].append(t)
        preds[t].append(s)

    rank_of: dict[int, int] = {}
    for rank, rank_nodes in enumerate(nodes):
        for i in rank_nodes:
            event = events[i]
            assert not isinstance(event, Coll), f"Coll event {event} in rank {rank}'s list"
            if isinstance(event, (Fwd, Bwd, Wgrad)):
                assert event.rank == rank, f"event {event} listed on rank {rank}"
            rank_of.setdefault(i, rank)

    recvs: dict[int, list[Transfer]] = defaultdict(list)
    sends: dict[int, list[Transfer]] = defaultdict(list)
    for i, event in enumerate(events):
        if not isinstance(event, Coll):
            continue
        (producer,), (consumer,) = preds[i], succs[i]
        p_event, c_event = events[producer], events[consumer]
        assert isinstance(p_event, (Fwd, Bwd)) and isinstance(c_event, (Fwd, Bwd)), f"{event} joins {p_event} and {c_event}"
        gradient = isinstance(p_event, Bwd)
        start, stop = plan.slab(p_event.region, p_event.rank)
        boundary = start - 1 if gradient else stop - 1
        assert boundary >= 0, f"{event} carries the gradient of the model input"
        t = Transfer(i, producer, consumer, rank_of[producer], rank_of[consumer], gradient, boundary, event.mb)
        sends[producer].append(t)
        recvs[consumer].append(t)

    loss_source: dict[int, int] = {}
    loss_fed: dict[int, int] = {}
    for i, event in enumerate(events):
        if isinstance(event, Loss):
            (source,) = [p for p in preds[i] if isinstance(events[p], Fwd)]
            loss_source[i] = source
            for t in succs[i]:
                if isinstance(events[t], Bwd):
                    loss_fed[t] = i
    backward_stages = frozenset((e.region, e.rank, e.mb) for e in events if isinstance(e, Bwd))
    for i in rank_of:
        assert isinstance(events[i], (Fwd, Bwd, Wgrad, Loss, DpReduce, StepBarrier)), events[i]

    return dict(
        events=events,
        nodes=nodes,
        region_layers=region_layers,
        stage_slabs=stage_slabs,
        recvs={k: tuple(sorted(v, key=lambda t: t.index)) for k, v in recvs.items()},
        sends={k: tuple(sorted(v, key=lambda t: t.index)) for k, v in sends.items()},
        loss_source=loss_source,
        loss_fed=loss_fed,
        backward_stages=backward_stages,
    )
