"""One-call prediction of a :class:`~mpipe_tune.algebra.candidate.Candidate`: layer table, balanced
slabs, derive, then the compiled plan's timeline and memory (:class:`~mpipe_tune.cost.compiled.CompiledPlan`,
the same one the search's evaluator reads).

``predict(candidate, model, workload, profile, options)``: the candidate fixes the plan (cut,
schedule, slabs, owners, encoder backward placement, degrees, dtype, recomputation, frozen blocks;
an ``optimised`` placement without its slots has them chosen on the workload,
:func:`~mpipe_tune.cost.encoder_backward.optimise_slots`); ``options`` carries the cost
model's settings that are not a planning choice (the MoE load imbalance, optimizer bytes), and its
degree fields are replaced by the candidate's (:func:`cost_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mpipe_tune.algebra.candidate import ROUND_ROBIN, Candidate
from mpipe_tune.algebra.encoder_backward import COOLDOWN, OPTIMISED, PLACEMENTS, runs_encoder_backward
from mpipe_tune.algebra.plan import Plan
from mpipe_tune.algebra.model import Model
from mpipe_tune.algebra.placement import ByLayer, ByMicrobatch
from mpipe_tune.cost.arch import validate_expert_parallel_degree, validate_tensor_parallel_degree
from mpipe_tune.cost.compiled import CompiledPlan
from mpipe_tune.cost.encoder_backward import optimise
from mpipe_tune.cost.layers import CostOptions, LayerTable, build_layer_table
from mpipe_tune.cost.memory import MemoryReport
from mpipe_tune.cost.profile import HardwareProfile
from mpipe_tune.cost.timing import Timeline
from mpipe_tune.inputs.workload import Workload
from mpipe_tune.errors import MpipeError


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    """The candidate predicted, with its slabs and owner map made explicit (what derive chose): it
    derives the same plan again without the workload's layer weights."""
    plan: Plan
    timeline: Timeline
    table: LayerTable
    memory: MemoryReport
    options: CostOptions
    """The cost options the prediction used (the candidate's degrees in them)."""


def layer_weights(model: Model, table: LayerTable) -> tuple[float, ...]:
    """Expected forward + backward seconds per layer over the workload: what default slabs balance."""
    per_layer = (table.fwd_s + table.backward_s(model)).mean(axis=1)
    return tuple(float(w) for w in per_layer)


def cost_options(candidate: Candidate, options: CostOptions = CostOptions()) -> CostOptions:
    """``options`` with the candidate's dtype, degrees and memory policy."""
    c = candidate
    return replace(options, dtype=c.dtype, tp_degree=c.tp, dp_degree=c.dp, ep_degree=c.ep, cp_degree=c.cp,
                   recompute=c.recompute, shard_optimizer=c.zero_stage >= 1, sequence_parallel=c.sequence_parallel,
                   encoder_tp_degree=c.encoder_tp)


def resolved(candidate: Candidate, plan: Plan) -> Candidate:
    """``candidate`` with the slab counts and the owner map ``plan`` placed (derive's choices made explicit)."""
    # In layer order (a region placed on the ranks in reverse, zbv's second, lists rank P-1's slab first).
    slabs = tuple(tuple(b - a for a, b in sorted(p.owner.slabs)) for p in plan.placement if isinstance(p.owner, ByLayer))
    owners = next((p.owner.owners for p in plan.placement if isinstance(p.owner, ByMicrobatch)), None)
    return replace(candidate, slab_counts=slabs, owner_map=owners)


def predict(
    candidate: Candidate,
    model: Model,
    workload: Workload,
    profile: HardwareProfile,
    options: CostOptions = CostOptions(),
) -> Prediction:
    """Derive the plan for one candidate on ``model`` (its frozen blocks frozen) and read its predicted
    timeline and memory on ``workload``, one step of ``num_microbatches`` microbatches."""
    c = candidate
    c.validate()
    if c.num_microbatches != len(workload):
        raise MpipeError(
            f"the workload '{workload.name}' has {len(workload)} microbatches but the microbatch count M is "
            f"{c.num_microbatches}; make them equal"
        )
    if c.owner_map is None and c.has_transpose and c.owner_policy not in (None, ROUND_ROBIN):
        raise MpipeError(f"owner policy {c.owner_policy!r} chooses its owners per step from the step's encode "
                         f"costs (the search does); give the candidate its owner map")
    model = c.model_of(model)
    options = cost_options(c, options)
    options.validate_degrees()
    options.dtype_bytes()
    profile.peak(options.dtype)
    validate_tensor_parallel_degree(model, options.tp_degree)
    validate_expert_parallel_degree(model, options.ep_degree)
    table = build_layer_table(model, workload, profile, options)
    choose_slots = c.encoder_backward == OPTIMISED and c.encoder_backward_slots is None
    plan = (replace(c, encoder_backward=COOLDOWN) if choose_slots else c).derive(model, layer_weights(model, table))
    compiled = CompiledPlan(plan, model, profile, options)
    if choose_slots and compiled.has_encoder_backward:
        choice = optimise(compiled, table)  # under full recomputation, on other ranks too
        compiled = compiled.with_encoder_backward(choice.slots, choice.ranks)
        plan, c = compiled.plan, replace(c, encoder_backward_slots=choice.slots, encoder_backward_ranks=choice.ranks)
    timeline = compiled.timeline(table)
    memory = compiled.memory(table, timeline)
    return Prediction(resolved(c, plan), plan, timeline, table, memory, options)


def predict_fastest_placement(
    candidate: Candidate,
    model: Model,
    workload: Workload,
    profile: HardwareProfile,
    options: CostOptions = CostOptions(),
) -> Prediction:
    """:func:`predict` of ``candidate`` under each encoder backward placement (:data:`PLACEMENTS`), the
    fastest kept (ties to the earlier placement); a plan without encoder backwards is predicted once."""
    best = predict(replace(candidate, encoder_backward=COOLDOWN, encoder_backward_slots=None,
                           encoder_backward_ranks=None), model, workload,
                   profile, options)
    if not runs_encoder_backward(best.plan):
        return best
    for placement in PLACEMENTS[1:]:
        other = predict(replace(candidate, encoder_backward=placement, encoder_backward_slots=None,
                                encoder_backward_ranks=None), model, workload,
                        profile, options)
        if other.timeline.makespan_s < best.timeline.makespan_s:
            best = other
    return best
