"""The one place a prediction is composed: candidate -> layer table -> derived and compiled plan ->
the step's owners and encoder backward placement -> timeline and memory.

:class:`Predictor` holds a model, a hardware profile and a :class:`~mpipe_tune.cost._framework.Framework`;
the candidate gives everything else (degrees, memory policy, dtype, frozen blocks, schedule, cut,
slabs, owners, encoder backward placement). Its parts:

- :meth:`Predictor.options` and :meth:`Predictor.table`: the candidate's cost options and a
  workload's layer table (built at ``dp = 1``: layer costs do not depend on dp, so the cost model's
  per-layer cache serves every dp);
- :meth:`Predictor.compile`: the candidate's derived and compiled plan, cached per (schedule, cut,
  P, M, slabs, frozen blocks) and cost options, and re-timed for an owner map instead of derived again;
- :meth:`Predictor.owners`: one step's owner map of the transposed region under the candidate's
  policy (the per-step choice, :mod:`mpipe_tune.cost._owners`), for the search and the runtime alike;
- :meth:`Predictor.step`: one step's compiled plan with its owners and encoder backwards placed, its
  timeline and its memory (:class:`Step`);
- :meth:`Predictor.predict`: the full :class:`Prediction` of one candidate on one workload, with the
  choices made explicit in its candidate (what plan.json stores).

``predict`` (:mod:`mpipe_tune.cost._predict`), the search's evaluator (which only samples steps,
bounds and caches) and the runtime's per-step owners all call it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from mpipe_tune.algebra import (
    ROUND_ROBIN, Candidate, Owners, derive, COOLDOWN, OPTIMISED, EncoderBackward, Model, ByLayer, ByMicrobatch,
    round_robin, Plan, Layout,
)
from mpipe_tune.cost._arch import validate_expert_parallel_degree, validate_tensor_parallel_degree
from mpipe_tune.cost._compiled import CompiledPlan
from mpipe_tune.cost._durations import TableSums
from mpipe_tune.cost._encoder_backward import placed
from mpipe_tune.cost._framework import Framework
from mpipe_tune.cost._layers import CostOptions, LayerTable, build_layer_table, build_layer_tables
from mpipe_tune.cost._memory import MemoryReport
from mpipe_tune.cost._owners import OwnerChoice, choose_owners, encode_seconds
from mpipe_tune.cost._profile import HardwareProfile
from mpipe_tune.cost._timing import Timeline
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import Workload

_CHOOSE = object()
"""``Predictor.step``'s default for an argument it works out itself."""


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted step on one workload: the plan derive builds for it, the plan's
    timeline and memory, and what they were read from."""

    candidate: Candidate
    """The candidate predicted, with its slabs and owner map made explicit (what derive chose): it
    derives the same plan again without the workload's layer weights."""
    plan: Plan
    timeline: Timeline
    table: LayerTable
    memory: MemoryReport
    options: CostOptions
    """The cost options the prediction used (the candidate's degrees in them)."""


@dataclass(frozen=True)
class Step:
    """One step of one candidate: its compiled plan as it runs (owners and encoder backwards placed)."""

    compiled: CompiledPlan
    owners: OwnerChoice | None
    """The step's owner map of the transposed region and the policy that chose it; None without one."""
    encoder_backward: EncoderBackward | None
    """Where the step's encoder backwards run; None: the cooldown (or the plan runs none)."""
    timeline: Timeline
    memory: MemoryReport | None
    """None when the memory was not asked for."""


def layer_weights(model: Model, table: LayerTable) -> tuple[float, ...]:
    """Expected forward + backward seconds per layer over the workload: what default slabs balance."""
    per_layer = (table.fwd_s + table.backward_s(model)).mean(axis=1)
    return tuple(float(w) for w in per_layer)


def resolved(candidate: Candidate, plan: Plan) -> Candidate:
    """``candidate`` with the slab counts and the owner map ``plan`` placed (derive's choices made explicit)."""
    # In layer order (a region placed on the ranks in reverse, zbv's second, lists rank P-1's slab first).
    slabs = tuple(tuple(b - a for a, b in sorted(p.owner.slabs)) for p in plan.placement if isinstance(p.owner, ByLayer))
    owners = next((p.owner.owners for p in plan.placement if isinstance(p.owner, ByMicrobatch)), None)
    return replace(candidate, slab_counts=slabs, owner_map=owners)


def chooses_owners(c: Candidate) -> bool:
    """Whether ``c``'s owner policy chooses each step's owner map from the step's encode costs and
    slack (``greedy``, ``optimal``), rather than round-robin."""
    return c.has_transpose and c.owner_policy not in (None, ROUND_ROBIN)


class Predictor:
    """Predicts candidates of one model on one hardware profile under one framework, with the derived
    and compiled plans cached across candidates (see the module docstring)."""

    def __init__(self, model: Model, profile: HardwareProfile, framework: Framework = Framework(), *,
                 max_cached_orders: int = 48) -> None:
        self.model, self.profile, self.framework = model, profile, framework
        self._models: dict[tuple[str, ...], Model] = {(): model}
        self._derived: OrderedDict[tuple, CompiledPlan] = OrderedDict()
        """Per (schedule, cut, P, M, slabs, frozen): the derived plan, compiled for the first options seen."""
        self._compiled: OrderedDict[tuple, CompiledPlan] = OrderedDict()
        """Per derived plan, cost options and owner map: the plan compiled for them."""
        self._max_orders = max_cached_orders

    # ---------------------------------------------------------------------------- inputs

    def model_of(self, c: Candidate) -> Model:
        """The model with ``c``'s frozen blocks frozen."""
        if c.frozen not in self._models:
            self._models[c.frozen] = c.model_of(self.model)
        return self._models[c.frozen]

    def options(self, c: Candidate) -> CostOptions:
        """``c``'s cost options: its dtype, degrees and memory policy under this framework."""
        return self.framework.options(c)

    def table(self, c: Candidate, workload: Workload) -> LayerTable:
        """``workload``'s layer table under ``c``'s options (built at dp = 1: layer costs do not depend on
        dp, and so one cached per-layer row serves every dp)."""
        options = self.options(c)
        return build_layer_table(self.model_of(c), workload, self.profile,
                                 replace(options, degrees=replace(options.degrees, dp=1)))

    def tables(self, c: Candidate, workloads: Sequence[Workload]) -> list[LayerTable]:
        """:meth:`table` of each of ``workloads``, built in one pass (:func:`build_layer_tables`)."""
        options = self.options(c)
        return build_layer_tables(self.model_of(c), workloads, self.profile,
                                  replace(options, degrees=replace(options.degrees, dp=1)))

    def validate(self, c: Candidate) -> None:
        """One line for what makes ``c`` unpredictable here before any derive: its own checks, its
        degrees, its dtype on this profile, the degrees the model's widths and experts take."""
        c.validate()
        options = self.options(c)
        options.validate_degrees()
        options.dtype_bytes()
        self.profile.peak(options.dtype)
        model = self.model_of(c)
        validate_tensor_parallel_degree(model, options.degrees.tp)
        validate_expert_parallel_degree(model, options.degrees.ep)

    # ------------------------------------------------------------------------------ plans

    def compile(self, c: Candidate, *, slabs: tuple[tuple[int, ...], ...] | None = None,
                owners: tuple[int, ...] | None = None,
                layer_weights: tuple[float, ...] | None = None) -> CompiledPlan:
        """``c``'s plan with ``slabs`` (default: ``c``'s own; without any, balanced by ``layer_weights``)
        derived once and compiled for ``c``'s cost options, re-timed for the owner map ``owners`` of the
        transposed region (None: derive's round-robin). Encoder backwards at the cooldown."""
        slabs = c.slab_counts if slabs is None else slabs
        options = self.options(c)
        key = (c.schedule, c.cut, c.pp, c.num_microbatches, slabs, c.frozen, None if slabs else layer_weights)
        plan = self._lookup(self._compiled, (key, options, owners))
        if plan is not None:
            return plan
        if owners is not None:
            plan = self.compile(c, slabs=slabs, layer_weights=layer_weights).with_owners(owners)
        else:
            base = self._lookup(self._derived, key)
            if base is None:
                cut, schedule = c.parsed()
                model = self.model_of(c)
                derived = derive(cut, schedule, model, c.pp, c.num_microbatches,
                                 Owners(slab_counts=slabs, layer_weights=layer_weights))
                base = CompiledPlan(derived, model, self.profile, options)
                self._store(self._derived, key, base)
            plan = base.for_options(options)
        self._store(self._compiled, (key, options, owners), plan)
        return plan

    def owners(self, c: Candidate, table: LayerTable | TableSums, *, slack_s: Sequence[float] | None = None,
               compiled: CompiledPlan | None = None, fallback: bool = False) -> OwnerChoice | None:
        """One step's owner map of ``c``'s transposed region (None without one) under its policy:
        round-robin, or ``greedy``/``optimal`` over the step's encode seconds (off ``table``) and the
        ranks' warmup slack (``slack_s``, else read off the round-robin re-timing of ``compiled``,
        default ``c``'s plan, on ``table``). With ``fallback`` (the runtime's) ``optimal`` takes the
        greedy map past its run-time node budget (:func:`~mpipe_tune.cost._owners.choose_owners`)."""
        if not c.has_transpose:
            return None
        if not chooses_owners(c):
            return OwnerChoice(round_robin(c.num_microbatches, c.pp), ROUND_ROBIN)
        if slack_s is None:
            plan = compiled if compiled is not None else self.compile(c)
            slack_s = plan.with_owners(round_robin(c.num_microbatches, c.pp)).timeline(table).warmup_slack_s
        return choose_owners(c.owner_policy, self.encode_s(c, table), slack_s, fallback=fallback)

    def encode_s(self, c: Candidate, table: LayerTable | TableSums) -> np.ndarray:
        """Owned forward seconds of each microbatch on ``table``: the forwards of every transposed region
        of ``c`` (the encoder, and any interior or sink transpose: they share the owner map)."""
        cut, schedule = c.parsed()
        regions = cut.regions(self.model.num_layers)
        fwd_s = table.fwd_s if isinstance(table, LayerTable) else table.table.fwd_s
        return encode_seconds(fwd_s, [r for r, layout in zip(regions, schedule.layouts())
                                      if layout is Layout.REPLICATED])

    def retimed_owners(self, c: Candidate, owners: OwnerChoice | None) -> tuple[int, ...] | None:
        """The owner map ``c``'s plan is re-timed for: its explicit map, else a per-step policy's
        choice ``owners``; None: derive's round-robin."""
        if c.owner_map is not None:
            return c.owner_map
        return owners.owners if owners is not None and chooses_owners(c) else None

    def encoder_backward(self, c: Candidate, compiled: CompiledPlan,
                         table: LayerTable | TableSums) -> EncoderBackward | None:
        """Where ``compiled``'s encoder backwards run under ``c``'s placement on this step: its explicit
        slots, or those its placement chooses (:func:`~mpipe_tune.cost._encoder_backward.placed`); None
        for the cooldown and for a plan that runs none (derive's order)."""
        slots = c.encoder_backward_slots
        if (slots is None and c.encoder_backward == COOLDOWN) or not compiled.has_encoder_backward:
            return None
        if slots is not None:
            return EncoderBackward(c.encoder_backward, slots, c.encoder_backward_ranks)
        return placed(compiled, c.encoder_backward, table)

    def step(self, c: Candidate, table: LayerTable, *, sums: TableSums | None = None,
             slabs: tuple[tuple[int, ...], ...] | None = None, layer_weights: tuple[float, ...] | None = None,
             owners=_CHOOSE, encoder_backward=_CHOOSE, memory: bool = True) -> Step:
        """One step of ``c`` on ``table`` (``sums``: its prefix sums, if the caller keeps them): the owner
        map (:meth:`owners`, unless given), the compiled plan re-timed for it (:meth:`compile`), the
        encoder backwards placed (:meth:`encoder_backward`, unless given), its timeline and, with
        ``memory``, its memory."""
        durations_of = table if sums is None else sums
        if owners is _CHOOSE:
            owners = self.owners(c, durations_of)
        compiled = self.compile(c, slabs=slabs, owners=self.retimed_owners(c, owners), layer_weights=layer_weights)
        if encoder_backward is _CHOOSE:
            encoder_backward = self.encoder_backward(c, compiled, durations_of)
        if encoder_backward is not None:
            compiled = compiled.with_encoder_backward(encoder_backward.slots, encoder_backward.ranks)
        timeline = compiled.timeline(durations_of)
        return Step(compiled, owners, encoder_backward, timeline, compiled.memory(table, timeline) if memory else None)

    def predict(self, c: Candidate, workload: Workload, *, table: LayerTable | None = None) -> Prediction:
        """The prediction of ``c`` on one step of ``workload`` (``table``: its layer table, if built):
        slabs left ``None`` balanced by the workload's layer weights, an owner map given or
        round-robin, an ``optimised`` placement without slots chosen on the workload (and recorded in
        the prediction's candidate)."""
        self.validate(c)
        if c.num_microbatches != len(workload):
            raise MpipeError(
                f"the workload '{workload.name}' has {len(workload)} microbatches but the microbatch count M is "
                f"{c.num_microbatches}; make them equal"
            )
        if c.owner_map is None and chooses_owners(c):
            raise MpipeError(f"owner policy {c.owner_policy!r} chooses its owners per step from the step's encode "
                             f"costs (the search does); give the candidate its owner map")
        if table is None:
            table = self.table(c, workload)
        weights = None if c.slab_counts is not None else layer_weights(self.model_of(c), table)
        step = self.step(c, table, layer_weights=weights, owners=None)
        if c.encoder_backward == OPTIMISED and c.encoder_backward_slots is None and step.encoder_backward is not None:
            c = replace(c, encoder_backward_slots=step.encoder_backward.slots,
                        encoder_backward_ranks=step.encoder_backward.ranks)
        plan = step.compiled.plan
        return Prediction(resolved(c, plan), plan, step.timeline, table, step.memory, step.compiled.options)

    # ----------------------------------------------------------------------------- caches

    @staticmethod
    def _lookup(cache: OrderedDict, key):
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
        return value

    def _store(self, cache: OrderedDict, key, value) -> None:
        cache[key] = value
        if len(cache) > self._max_orders:
            cache.popitem(last=False)
