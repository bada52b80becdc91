"""Evaluating candidates: one static plan, its predicted step time over the sampled steps.

A candidate is one static plan: its slabs are fixed before any step is seen (balanced by the
expected layer cost over the sampled steps, or given), and the same order runs every step. The
transposed region's owner map is the one part that follows each step's data: ``round-robin`` is
static, while ``greedy`` and ``optimal`` are per-step rules over the step's encode costs, which are
known from its image sizes before the step starts. Their slack ``w_r`` is read off the round-robin
prediction of the same step (the slack does not depend on who encodes). The encoder backward
placement (``cooldown``, ``earliest``, ``optimised``) is a per-step rule too: ``earliest`` follows the
step's owner map, ``optimised`` also its durations (:mod:`mpipe_tune.cost.encoder_backward`).

The evaluator reads every step through the cost model's compiled plan
(:class:`~mpipe_tune.cost.compiled.CompiledPlan`), the same one :func:`mpipe_tune.cost.predict.predict`
uses; it only decides what to compute and caches: layer tables (with their prefix sums) per sampled
step and setting, one derived and compiled plan per (schedule, cut, P, M, slabs) and cost options,
each per-step owner map as a re-timing of that plan (no second derive), and results, since a search
revisits the same pieces many times.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from mpipe_tune.algebra.derive import Owners, derive, rank_slabs
from mpipe_tune.algebra.encoder_backward import COOLDOWN, OPTIMISED, EncoderBackward
from mpipe_tune.algebra.placement import balanced_counts, round_robin
from mpipe_tune.algebra.schedule import Layout
from mpipe_tune.cost.compiled import CompiledPlan
from mpipe_tune.cost.durations import TableSums, table_sums
from mpipe_tune.cost.encoder_backward import placed
from mpipe_tune.cost.layers import LayerTable, build_layer_table
from mpipe_tune.cost.memory import static_bytes_of
from mpipe_tune.cost.owners import encode_seconds, owners_for
from mpipe_tune.cost.predict import Prediction, layer_weights, predict
from mpipe_tune.inputs.workload import Workload
from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.search.problem import Problem


@dataclass(frozen=True)
class StepResult:
    """One sampled step of one plan."""

    makespan_s: float
    bubble_share: float
    max_spill_s: float
    peak_bytes: float | None
    slack_s: tuple[float, ...]


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    makespans_s: tuple[float, ...]
    """Predicted step time of each sampled step."""
    bubble_share: float
    """Mean over steps of the idle share of rank-time."""
    max_spill_s: float
    """Mean over steps of the largest per-rank encoder spill."""
    peak_bytes: float | None
    """The largest per-rank peak over all steps; None when memory was not estimated (see
    :meth:`Evaluator.evaluate`), and then the plan counts as fitting."""
    capacity_bytes: float
    slab_counts: tuple[tuple[int, ...], ...]
    exact: bool = True
    """False for a lower bound standing in for a plan that cannot beat a known one (see
    :meth:`Evaluator.bounded`): its step times are bounds, its other figures unknown."""

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.makespans_s))

    @property
    def p90_s(self) -> float:
        return float(np.percentile(self.makespans_s, 90))

    @property
    def fits(self) -> bool:
        return self.peak_bytes is None or self.peak_bytes <= self.capacity_bytes

    @property
    def memory_excess_bytes(self) -> float:
        """How far the peak is over capacity (<= 0: fits); Optuna's constraint value."""
        return 0.0 if self.peak_bytes is None else self.peak_bytes - self.capacity_bytes


class Evaluator:
    """Predicts candidates of one problem, with caches shared across candidates."""

    def __init__(self, problem: Problem, *, max_cached_orders: int = 48) -> None:
        self.problem = problem
        self._tables: dict[tuple, tuple[Workload, LayerTable, TableSums]] = {}
        self._weights: dict[tuple, tuple[float, ...]] = {}
        self._derived: OrderedDict[tuple, CompiledPlan] = OrderedDict()
        """Per (schedule, cut, P, M, slabs): the derived plan, compiled for the first options seen."""
        self._compiled: OrderedDict[tuple, CompiledPlan] = OrderedDict()
        """Per derived plan, cost options and owner map: the plan compiled for them."""
        self._max_orders = max_cached_orders
        self._steps: dict[tuple, StepResult] = {}
        self._slots: dict[tuple, tuple[int, ...]] = {}
        """Per plan, placement and sampled step: the encoder backward slots the placement chose."""
        self._results: dict[Candidate, Evaluation] = {}
        self._bounds: dict = {}

    @property
    def num_evaluated(self) -> int:
        """Distinct candidates evaluated so far."""
        return len(self._results)

    # ----------------------------------------------------------------------------- inputs

    def reference_weights(self) -> tuple[float, ...]:
        """Expected seconds per layer of one sequence (tp = 1): what the space balances cuts by."""
        p = self.problem
        workload = Workload(p.sequences(0, min(p.global_batch, 16)), "reference")
        table = build_layer_table(p.model, workload, p.profile, p.options_for(1, 1))
        return layer_weights(p.model, table)

    def options(self, c: Candidate):
        return self.problem.options_for(c.tp, c.dp, c.recompute, ep=c.ep, cp=c.cp, zero_stage=c.zero_stage,
                                        sequence_parallel=c.sequence_parallel, encoder_tp=c.encoder_tp)

    def table(self, sample: int, c: Candidate) -> tuple[Workload, LayerTable]:
        """Step ``sample``'s replica workload for ``c`` and its layer table."""
        return self._table(sample, c)[:2]

    def _table(self, sample: int, c: Candidate) -> tuple[Workload, LayerTable, TableSums]:
        key = (sample, *c.setting)
        if key not in self._tables:
            p = self.problem
            workload = p.replica_workload(sample, c.dp, c.num_microbatches)
            # Layer costs do not depend on dp (ep and cp, which do, are in the key); building with
            # dp = 1 lets the cost model's per-layer cache serve every dp (the predict() equality tests
            # check this stays true).
            options = replace(self.options(c), dp_degree=1)
            table = build_layer_table(p.model, workload, p.profile, options)
            self._tables[key] = (workload, table, table_sums(table, p.model))
        return self._tables[key]

    def expected_layer_weights(self, c: Candidate) -> tuple[float, ...]:
        """Per layer, expected forward + backward seconds over all sampled steps."""
        key = c.setting
        if key not in self._weights:
            per_sample = [layer_weights(self.problem.model, self.table(k, c)[1]) for k in range(self.problem.samples)]
            self._weights[key] = tuple(float(w) for w in np.mean(per_sample, axis=0))
        return self._weights[key]

    def slab_counts(self, c: Candidate) -> tuple[tuple[int, ...], ...]:
        """The candidate's slabs: given, or the balanced partition of each Sharded region."""
        if c.slab_counts is not None:
            return c.slab_counts
        cut, schedule = c.parsed()
        weights = self.expected_layer_weights(c)
        regions = cut.regions(self.problem.model.num_layers)
        return tuple(
            balanced_counts(weights[start:stop], c.pp)
            for (start, stop), layout in zip(regions, schedule.layouts()) if layout is Layout.SHARDED
        )

    # ------------------------------------------------------------------------- evaluation

    def evaluate(self, c: Candidate, *, memory: bool = True) -> Evaluation:
        """Predict ``c`` on every sampled step (cached). ``memory=False`` skips the memory estimate
        (``peak_bytes`` None), the dearest part after derive, for plans that lose on time anyway."""
        key = replace(c, label="")
        cached = self._results.get(key)
        if cached is not None and (not memory or cached.peak_bytes is not None):
            return replace(cached, candidate=c)
        slabs = self.slab_counts(c)
        steps = [self._step(c, slabs, k, memory) for k in range(self.problem.samples)]
        peaks = [s.peak_bytes for s in steps]
        result = Evaluation(
            candidate=c,
            makespans_s=tuple(s.makespan_s for s in steps),
            bubble_share=float(np.mean([s.bubble_share for s in steps])),
            max_spill_s=float(np.mean([s.max_spill_s for s in steps])),
            peak_bytes=None if None in peaks else max(peaks),
            capacity_bytes=self.problem.profile.memory_capacity_bytes,
            slab_counts=slabs,
        )
        self._results[key] = result
        return result

    def bounded(self, c: Candidate) -> Evaluation:
        """``c``'s lower bounds as an inexact Evaluation: step times are :meth:`lower_bounds`, the
        peak is :meth:`static_peak_bytes` (a bound too), the other figures unknown."""
        return Evaluation(c, tuple(self.lower_bounds(c)), bubble_share=float("nan"), max_spill_s=float("nan"),
                          peak_bytes=self.static_peak_bytes(c), capacity_bytes=self.problem.profile.memory_capacity_bytes,
                          slab_counts=self.slab_counts(c), exact=False)

    def static_peak_bytes(self, c: Candidate) -> float | None:
        """The largest per-rank static memory (weights, gradients, optimizer state) of ``c``: a lower
        bound on its peak, from the placement alone (no order)."""
        key = ("static", replace(c, label="", owner_policy=None))
        if key not in self._bounds:
            _, table = self.table(0, c)
            self._bounds[key] = max(static_bytes_of(self._rank_layers(c), self.problem.model, table,
                                                    self.options(c)))
        return self._bounds[key]

    def _rank_layers(self, c: Candidate) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per rank, the layer ranges whose weights it holds under ``c``'s placement: its slab of each
        Sharded region, and the whole of a Replicated one."""
        cut, schedule = c.parsed()
        counts = iter(enumerate(self.slab_counts(c)))
        per_region = []
        for (start, stop), layout in zip(cut.regions(self.problem.model.num_layers), schedule.layouts()):
            if layout is Layout.SHARDED:
                chunk, region_counts = next(counts)
                per_region.append(rank_slabs(schedule, chunk, start, region_counts))
            else:
                per_region.append(((start, stop),) * c.pp)
        return tuple(tuple(region[r] for region in per_region) for r in range(c.pp))

    def lower_bound(self, c: Candidate) -> float:
        """Mean over the sampled steps of :meth:`lower_bounds`: never above ``evaluate(c).mean_s``."""
        return float(np.mean(self.lower_bounds(c)))

    def lower_bounds(self, c: Candidate) -> list[float]:
        """Per sampled step, a lower bound on ``c``'s step time from the layer table alone (no
        derive, no order), a hundred times cheaper than evaluating it.

        Rank ``r`` runs all its backbone work ``W_r`` serially; its first forward waits
        for microbatch 0's forwards on ranks ``< r`` (first Sharded region), and after its last
        backward (microbatch ``M-1``'s, first Sharded region, in every program) those ranks still
        run theirs; and all the work, encodes included, shares ``P`` ranks. Transfers and reduces
        only add time, so ``max(max_r fill_r + W_r + drain_r, total / P)`` bounds the makespan. A split
        backward (the zero-bubble skeletons) may run weight gradients after that last backward, so
        there ``drain_r`` is left out.
        """
        key = replace(c, label="")
        if key in self._bounds:
            return self._bounds[key]
        slabs = self.slab_counts(c)
        cut, schedule = c.parsed()
        regions = [r for r, layout in zip(cut.regions(self.problem.model.num_layers), schedule.layouts())
                   if layout is Layout.SHARDED]
        # Per Sharded region, the position in layer order of each rank's slab (zbv's second region: reversed).
        position = [np.argsort(np.argsort([lo for lo, _ in rank_slabs(schedule, chunk, start, counts)]))
                    for chunk, ((start, _), counts) in enumerate(zip(regions, slabs))]
        split = any(s.splits_backward for s in schedule.skeletons)
        bounds = []
        for sample in range(self.problem.samples):
            _, table = self.table(sample, c)
            fwd, bwd = table.fwd_s, table.backward_s(self.problem.model)
            work = fwd.sum(axis=1) + bwd.sum(axis=1)  # per layer, over the step's microbatches
            busy = np.zeros(c.pp)
            for (start, _), counts, at in zip(regions, slabs, position):
                edges = start + np.concatenate(([0], np.cumsum(counts)))
                busy += np.add.reduceat(work[start:edges[-1]], edges[:-1] - start)[at]
            start, counts = regions[0][0], slabs[0]
            edges = start + np.concatenate(([0], np.cumsum(counts)))
            first = np.add.reduceat(fwd[start:edges[-1], 0], edges[:-1] - start)
            last = np.add.reduceat(bwd[start:edges[-1], -1], edges[:-1] - start) * (not split)
            chain = np.concatenate(([0.0], np.cumsum(first + last)[:-1]))
            total = work.sum()
            bounds.append(max(float((chain + busy).max()), float(total) / c.pp))
        self._bounds[key] = bounds
        return bounds

    def owners(self, c: Candidate, sample: int) -> tuple[int, ...] | None:
        """The transposed region's owner map of ``c`` on step ``sample`` (None without a transpose)."""
        if not c.has_transpose:
            return None
        if c.owner_policy in (None, "round-robin"):
            return round_robin(c.num_microbatches, c.pp)  # derive's default owner map
        return owners_for(c.owner_policy, self.encode_s(c, sample), self.slack_s(c, sample))

    def slack_s(self, c: Candidate, sample: int) -> tuple[float, ...]:
        """Per rank, the warmup slack ``w_r`` of ``c``'s round-robin plan on step ``sample``."""
        rr = replace(c, owner_policy="round-robin", encoder_backward=COOLDOWN, encoder_backward_slots=None,
                     encoder_backward_ranks=None)
        return self._step(rr, self.slab_counts(rr), sample, memory=False).slack_s

    def encode_s(self, c: Candidate, sample: int) -> np.ndarray:
        """Owned forward seconds of each microbatch of step ``sample``: the forwards of every
        transposed region (the encoder, and any interior or sink transpose: they share the owner map)."""
        _, table = self.table(sample, c)
        cut, schedule = c.parsed()
        regions = cut.regions(self.problem.model.num_layers)
        return encode_seconds(table.fwd_s, [r for r, layout in zip(regions, schedule.layouts())
                                            if layout is Layout.REPLICATED])

    def prediction(self, c: Candidate, sample: int = 0) -> tuple[Prediction, Workload]:
        """The full prediction of ``c`` on one step, by the cost model's own ``predict`` with the
        slabs and owners made explicit: what plan.json records and ``show`` re-predicts."""
        p = self.problem
        workload, _ = self.table(sample, c)
        options = self.options(c)
        slots, ranks = c.encoder_backward_slots, c.encoder_backward_ranks
        if c.encoder_backward == OPTIMISED and slots is None:
            choice = self.encoder_backward_choice(c, sample)
            slots, ranks = (None, None) if choice is None else (choice.slots, choice.ranks)
        explicit = replace(c, slab_counts=self.slab_counts(c), owner_map=self.owners(c, sample), dtype=options.dtype,
                           encoder_backward_slots=slots, encoder_backward_ranks=ranks)
        prediction = predict(explicit, p.model, workload, p.profile, options)
        return prediction, workload

    def encoder_backward_slots(self, c: Candidate, sample: int) -> tuple[int, ...] | None:
        """The slots of ``c``'s encoder backwards on step ``sample`` (None: the cooldown, or the plan runs
        none), on the ranks :meth:`encoder_backward_choice` names."""
        choice = self.encoder_backward_choice(c, sample)
        return None if choice is None else choice.slots

    def encoder_backward_choice(self, c: Candidate, sample: int) -> EncoderBackward | None:
        """The slots (and ranks) of ``c``'s encoder backwards on step ``sample`` (None: the cooldown, or
        the plan runs none)."""
        return self._placed(c, self.slab_counts(c), sample)[1]

    # ---------------------------------------------------------------------------- internals

    def _placed(self, c: Candidate, slabs, sample: int) -> tuple[CompiledPlan, EncoderBackward | None]:
        """``c``'s compiled plan on step ``sample`` with its owners and its encoder backwards placed,
        and their arrangement (None for the cooldown, and without encoder backwards)."""
        owners = self._retimed_owners(c, sample)
        plan = self.compiled(c, slabs, owners)
        slots = c.encoder_backward_slots
        if (slots is None and c.encoder_backward == COOLDOWN) or not plan.has_encoder_backward:
            return plan, None  # derive's order: the cooldown
        if slots is None:
            key = (c.schedule, c.cut, c.pp, *c.setting, slabs, owners, c.encoder_backward, sample)
            if key not in self._slots:
                self._slots[key] = placed(plan, c.encoder_backward, self._table(sample, c)[2])
            choice = self._slots[key]
        else:
            choice = EncoderBackward(c.encoder_backward, slots, c.encoder_backward_ranks)
        return plan.with_encoder_backward(choice.slots, choice.ranks), choice

    def _retimed_owners(self, c: Candidate, sample: int) -> tuple[int, ...] | None:
        """The owner map ``c``'s plan is re-timed for on step ``sample``; None: derive's round-robin."""
        if c.has_transpose and c.owner_policy not in (None, "round-robin"):
            return self.owners(c, sample)
        return None

    def compiled(self, c: Candidate, slabs, owners: tuple[int, ...] | None = None) -> CompiledPlan:
        """``c``'s plan with ``slabs``, compiled for ``c``'s cost options; ``owners`` (None: derive's
        default) re-times it for another owner map of the transposed region."""
        options = self.options(c)
        key = (c.schedule, c.cut, c.pp, c.num_microbatches, slabs)
        plan = self._lookup(self._compiled, (key, options, owners))
        if plan is not None:
            return plan
        if owners is not None:
            plan = self.compiled(c, slabs).with_owners(owners)
        else:
            base = self._lookup(self._derived, key)
            if base is None:
                cut, schedule = c.parsed()
                p = self.problem
                base = CompiledPlan(derive(cut, schedule, p.model, c.pp, c.num_microbatches, Owners(slab_counts=slabs)),
                                    p.model, p.profile, options)
                self._store(self._derived, key, base)
            plan = base.for_options(options)
        self._store(self._compiled, (key, options, owners), plan)
        return plan

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

    def _step(self, c: Candidate, slabs, sample: int, memory: bool) -> StepResult:
        owners = self._retimed_owners(c, sample)
        key = (c.schedule, c.cut, c.pp, *c.setting, slabs, owners, c.encoder_backward, c.encoder_backward_slots,
               c.encoder_backward_ranks, sample)
        cached = self._steps.get(key)
        if cached is not None and (not memory or cached.peak_bytes is not None):
            return cached
        plan, _ = self._placed(c, slabs, sample)
        _, table, sums = self._table(sample, c)
        t = plan.timeline(sums)
        peaks = plan.memory(table, t).peak_bytes if memory else None
        result = StepResult(
            makespan_s=t.makespan_s,
            bubble_share=sum(t.bubble_s) / (t.makespan_s * c.pp) if t.makespan_s > 0 else 0.0,
            max_spill_s=max(t.spill_s),
            peak_bytes=None if peaks is None else max(peaks),
            slack_s=tuple(t.warmup_slack_s),
        )
        self._steps[key] = result
        return result
