"""One-call prediction: layer table, balanced slabs, derive, durations, timeline."""

from __future__ import annotations

from dataclasses import dataclass

from mpipe_tune.algebra.derive import Owners, Plan, derive
from mpipe_tune.algebra.model import Model
from mpipe_tune.algebra.schedule import Cut, Schedule
from mpipe_tune.cost.arch import validate_expert_parallel_degree, validate_tensor_parallel_degree
from mpipe_tune.cost.compiled import CompiledPlan
from mpipe_tune.cost.layers import CostOptions, LayerTable, build_layer_table
from mpipe_tune.cost.memory import MemoryReport
from mpipe_tune.cost.profile import HardwareProfile
from mpipe_tune.cost.timing import Timeline
from mpipe_tune.cost.workload import Workload
from mpipe_tune.errors import MpipeError


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    timeline: Timeline
    table: LayerTable
    memory: MemoryReport


def layer_weights(model: Model, table: LayerTable) -> tuple[float, ...]:
    """Expected forward + backward seconds per layer over the workload: what default slabs balance."""
    per_layer = (table.fwd_s + table.backward_s(model)).mean(axis=1)
    return tuple(float(w) for w in per_layer)


def predict(
    cut: Cut,
    schedule: Schedule,
    model: Model,
    workload: Workload,
    profile: HardwareProfile,
    num_ranks: int,
    *,
    num_microbatches: int | None = None,
    slab_counts: tuple[tuple[int, ...], ...] | None = None,
    microbatch_owners: tuple[int, ...] | None = None,
    options: CostOptions = CostOptions(),
) -> Prediction:
    """Derive the plan for one candidate and read its predicted timeline."""
    M = len(workload) if num_microbatches is None else num_microbatches
    if M != len(workload):
        raise MpipeError(
            f"the workload '{workload.name}' has {len(workload)} microbatches but --microbatches is {M}; "
            f"make them equal (or leave --microbatches out)"
        )
    options.validate_degrees()
    validate_tensor_parallel_degree(model, options.tp_degree)
    validate_expert_parallel_degree(model, options.ep_degree)
    table = build_layer_table(model, workload, profile, options)
    owners = Owners(slab_counts=slab_counts, microbatch=microbatch_owners, layer_weights=layer_weights(model, table))
    plan = derive(cut, schedule, model, num_ranks, M, owners)
    compiled = CompiledPlan(plan, model, profile, options)
    timeline = compiled.timeline(table)
    memory = compiled.memory(table, timeline)
    return Prediction(plan, timeline, table, memory)

