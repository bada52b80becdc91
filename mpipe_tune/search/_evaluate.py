"""Evaluating candidates: one static plan, its predicted step time over the sampled steps.

A candidate is one static plan: its slabs are fixed before any step is seen (balanced by the
expected layer cost over the sampled steps, or given), and the same order runs every step. The
transposed region's owner map is the one part that follows each step's data: ``round-robin`` is
static, while ``greedy`` and ``optimal`` are per-step rules over the step's encode costs, which are
known from its image sizes before the step starts. Their slack ``w_r`` is read off the round-robin
prediction of the same step (the slack does not depend on who encodes). The encoder backward
placement (``cooldown``, ``earliest``, ``optimised``) is a per-step rule too: ``earliest`` follows the
step's owner map, ``optimised`` also its durations (:mod:`mpipe_tune.cost._encoder_backward`).

The evaluator reads every step through the cost model's compiled plan
(:class:`~mpipe_tune.cost._compiled.CompiledPlan`), the same one :func:`mpipe_tune.cost._predict.predict`
uses; it only decides what to compute and caches: layer tables (with their prefix sums) per sampled
step and setting, one derived and compiled plan per (schedule, cut, P, M, slabs) and cost options,
each per-step owner map as a re-timing of that plan (no second derive), and results, since a search
revisits the same pieces many times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

import numpy as np

from mpipe_tune.algebra import (
    Candidate, rank_slabs, COOLDOWN, OPTIMISED, EncoderBackward, ByLayer, balanced_counts, round_robin, Layout,
)
from mpipe_tune.cost import (
    CompiledPlan, TableSums, table_sums, LayerTable, build_layer_table, static_bytes_of, OwnerChoice, Prediction,
    Predictor, chooses_owners, layer_weights,
)
from mpipe_tune.inputs import Workload
from mpipe_tune.search._bounds import BoundSums, LiveSets, SlabIndex, activation_floor, full_recompute_s, step_bounds
from mpipe_tune.search._problem import Problem


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
    """One candidate's predicted figures over the problem's sampled steps (its step time per step,
    the mean bubble and spill, the peak memory against capacity), as the search ranks it."""

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
    """Predicts candidates of one problem, averaged over its sampled steps, through one
    :class:`~mpipe_tune.cost._predictor.Predictor`; it samples the steps, bounds candidates and caches
    (layer tables per sampled step and setting, results per step and candidate)."""

    def __init__(self, problem: Problem, *, max_cached_orders: int = 48) -> None:
        self.problem = problem
        self.predictor = Predictor(problem.model, problem.profile, problem.framework,
                                   max_cached_orders=max_cached_orders)
        self._dtype = problem.dtype
        self._tables: dict[tuple, tuple[Workload, LayerTable, TableSums]] = {}
        self._expected: dict[tuple, set[tuple]] = {}
        """Per kernel setting (:func:`_kernel_setting`), the table settings :meth:`expect` was told of and
        not yet built."""
        self._joined: dict[tuple, list[tuple]] = {}
        """Per kernel setting but the recomputation, the settings whose tables were last built in one pass:
        another recomputation's table of one of them is built with all of theirs, from the same joined
        microbatches, whose kernel rows are kept (:func:`~mpipe_tune.cost._layers.arch_columns`)."""
        self._weights: dict[tuple, tuple[float, ...]] = {}
        self._steps: dict[tuple, StepResult] = {}
        self._slots: dict[tuple, EncoderBackward | None] = {}
        """Per plan, owner map, placement and sampled step: where the encoder backwards run."""
        self._results: dict[Candidate, Evaluation] = {}
        self._predictions: dict[tuple[Candidate, int], tuple[Prediction, Workload]] = {}
        self._bounds: dict = {}
        self._sums: dict[tuple, BoundSums] = {}
        self._slab_index: dict[tuple, SlabIndex] = {}
        self._owned: dict[tuple, np.ndarray] = {}
        self._slabs: dict[tuple, tuple] = {}
        """Per plan shape and setting its slab counts, and per Sharded region and setting its balanced partition."""
        self.twin_bounds = False
        """Bound a ZeRO-3 plan by its stage-1 twin's predicted step (:meth:`twin_s`) at its last level: on
        where the space searches both stages, so that a stage-3 plan is predicted only where its twin,
        predicted anyway, does not fit (or is not known to fit)."""

    @property
    def num_evaluated(self) -> int:
        """Distinct candidates evaluated so far."""
        return len(self._results)

    # ----------------------------------------------------------------------------- inputs

    def _own(self, c: Candidate) -> Candidate:
        """``c`` in the problem's dtype (the dtype is the problem's, not a choice of the search)."""
        return c if c.dtype == self._dtype else replace(c, dtype=self._dtype)

    def reference_weights(self) -> tuple[float, ...]:
        """Expected seconds per layer of one sequence (tp = 1): what the space balances cuts by."""
        p = self.problem
        workload = Workload(p.sequences(0, min(p.global_batch, 16)), "reference")
        table = build_layer_table(p.model, workload, p.profile, p.options_for(1, 1))
        return layer_weights(p.model, table)

    def options(self, c: Candidate):
        return self.predictor.options(self._own(c))

    def table(self, sample: int, c: Candidate) -> tuple[Workload, LayerTable]:
        """Step ``sample``'s replica workload for ``c`` and its layer table."""
        return self._table(sample, c)[:2]

    def expect(self, candidates: Iterable[Candidate], *, plain: bool = False) -> None:
        """Say that the layer tables of ``candidates``' settings (``plain``: those settings without
        recomputation) will be asked for: the first of them asked for is built in one pass with those of the
        others that differ from it only in the data-parallel degree and the microbatch count (the kernels'
        options are the same; only the microbatches differ), about a third of the time of building them one
        setting at a time. The tables are the same either way."""
        for c in candidates:
            setting = _table_setting(c, False if plain else None)
            if (0, *setting) not in self._tables:
                self._expected.setdefault(_kernel_setting(setting), set()).add(setting)

    def _table(self, sample: int, c: Candidate) -> tuple[Workload, LayerTable, TableSums]:
        setting = _table_setting(c)
        key = (sample, *setting)
        if key not in self._tables:  # every sampled step's table of the setting, in one pass
            p = self.problem
            expected = self._expected.pop(_kernel_setting(setting), set())
            expected.discard(setting)
            batch = [setting, *sorted(s for s in expected if (0, *s) not in self._tables)]
            joined = self._joined.get(_rows_setting(setting), [])
            if len(batch) == 1 and _with_recompute(setting, False) in [_with_recompute(s, False) for s in joined]:
                # another recomputation of a joined pass's setting: that pass's settings with this one's
                batch = [_with_recompute(s, setting[3]) for s in joined]
            else:
                self._joined[_rows_setting(setting)] = batch
            workloads = [p.replica_workload(k, dp, m) for _, dp, m, *_ in batch for k in range(p.samples)]
            tables = iter(zip(workloads, self.predictor.tables(self._own(c), workloads)))
            for built in batch:
                for k in range(p.samples):
                    workload, table = next(tables)
                    if (k, *built) not in self._tables:  # one built already stays (kept by identity elsewhere)
                        self._tables[(k, *built)] = (workload, table, table_sums(table, p.model))
        return self._tables[key]

    def expected_layer_weights(self, c: Candidate) -> tuple[float, ...]:
        """Per layer, expected forward + backward seconds over all sampled steps."""
        key = _table_setting(c)
        if key not in self._weights:
            per_sample = [layer_weights(self.problem.model, self.table(k, c)[1]) for k in range(self.problem.samples)]
            self._weights[key] = tuple(float(w) for w in np.mean(per_sample, axis=0))
        return self._weights[key]

    def slab_counts(self, c: Candidate) -> tuple[tuple[int, ...], ...]:
        """The candidate's slabs: given, or the balanced partition of each Sharded region."""
        if c.slab_counts is not None:
            return c.slab_counts
        setting = _table_setting(c)
        key = (c.schedule, c.cut, c.pp, setting)
        if key not in self._slabs:
            cut, schedule = c.parsed()
            regions = cut.regions(self.problem.model.num_layers)
            self._slabs[key] = tuple(self._balanced(start, stop, c, setting)
                                     for (start, stop), layout in zip(regions, schedule.layouts())
                                     if layout is Layout.SHARDED)
        return self._slabs[key]

    def _balanced(self, start: int, stop: int, c: Candidate, setting: tuple) -> tuple[int, ...]:
        """The balanced partition of layers ``[start, stop)`` over ``c``'s ranks by its setting's expected
        weights: kept per region, as schedules that differ only in their skeletons share their regions."""
        key = ("region", start, stop, c.pp, setting)
        if key not in self._slabs:
            self._slabs[key] = balanced_counts(self.expected_layer_weights(c)[start:stop], c.pp)
        return self._slabs[key]

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
        return max(self._static_bytes(c))

    def _static_bytes(self, c: Candidate) -> tuple[float, ...]:
        """Per rank, ``c``'s static memory (weights, gradients, optimizer state)."""
        key = ("static", *_unlabelled(c))
        if key not in self._bounds:
            _, table = self.table(0, c)
            self._bounds[key] = static_bytes_of(self._rank_layers(c), self.problem.model, table, self.options(c))
        return self._bounds[key]

    def peak_floor_bytes(self, c: Candidate) -> float:
        """A lower bound on ``c``'s peak memory from its placement and layer tables (no order): per rank its
        static memory plus the saved activations of one microbatch in each of its Sharded slabs, which are
        all live at that microbatch's backward in its last slab
        (:func:`~mpipe_tune.search._bounds.activation_floor`); at least :meth:`static_peak_bytes`."""
        key = ("peak floor", *_unlabelled(c))
        if key not in self._bounds:
            activations = activation_floor(self._bound_sums(c), self._index(c))
            self._bounds[key] = float(max(np.asarray(self._static_bytes(c)) + activations))
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
        key = ("mean", _bound_key(c), _static_owners(c), _forward_only(c))
        if key not in self._bounds:
            self._bounds[key] = float(np.mean(self.lower_bounds(c)))
        return self._bounds[key]

    def lower_bounds(self, c: Candidate) -> list[float]:
        """Per sampled step, a lower bound on ``c``'s step time from the layer table alone (no
        derive, no order; :mod:`~mpipe_tune.search._bounds`), a hundred times cheaper than evaluating it.
        The owners count where they are known before the step (round-robin, or a given map)."""
        owners = _static_owners(c)
        key = (_bound_key(c), owners, _forward_only(c))
        if key not in self._bounds:
            stacked = None if owners is None else np.array([owners] * self.problem.samples)
            self._bounds[key] = self._step_bounds(c, stacked)
        return self._bounds[key]

    def owner_bounds(self, c: Candidate) -> list[float]:
        """:meth:`lower_bounds` with the owners ``c``'s policy chooses on each step, where it chooses
        them per step (``greedy``, ``optimal``): tighter, but it costs the round-robin re-timing of
        ``c``'s plan that the policy reads its slack from (which evaluating ``c`` needs anyway)."""
        if not chooses_owners(c) or c.owner_map is not None:
            return self.lower_bounds(c)
        key = (_bound_key(c), c.owner_policy, _forward_only(c))
        if key not in self._bounds:
            owners = np.array([self.owners(c, k) for k in range(self.problem.samples)])
            self._bounds[key] = [max(a, b) for a, b in zip(self._step_bounds(c, owners), self.lower_bounds(c))]
        return self._bounds[key]

    def owner_bound(self, c: Candidate) -> float:
        """Mean over the sampled steps of :meth:`owner_bounds`."""
        return float(np.mean(self.owner_bounds(c)))

    def bound_levels(self, c: Candidate) -> tuple[int, int]:
        """The first and last level of :meth:`bound_at` that apply to ``c`` (one more, the twin's, for a
        ZeRO-3 plan where :attr:`twin_bounds` is on)."""
        return 0 if c.recompute is not False else 1, _last_level(c) + (c.zero_stage >= 2 and self.twin_bounds)

    def bound_at(self, c: Candidate, level: int) -> float:
        """``c``'s step-time bound at ``level`` (:class:`~mpipe_tune.search._bounds.BoundOrder`): 0, for a
        plan with recomputation, from the layer tables of the same setting without it, so that a setting
        whose bounds lose costs no layer table of its own (:meth:`recompute_bound`); 1 and 2,
        :meth:`lower_bound`; 3, for a per-step owner policy, :meth:`owner_bound`. Infinite at every level
        where its static memory cannot fit whatever its slabs (:meth:`static_floor_bytes`), from level 1
        on (its own layer tables) where its memory cannot fit whatever its order (:meth:`peak_floor_bytes`),
        and from level 2 on (its order, compiled: a few milliseconds) where the saved activations its
        order keeps live together cannot fit (:meth:`order_floor_bytes`): it can never be the best."""
        capacity = self.problem.profile.memory_capacity_bytes
        if self.static_floor_bytes(c) > capacity or (level >= 1 and self.peak_floor_bytes(c) > capacity) or (
                level >= 2 and self.order_floor_bytes(c) > capacity):
            return math.inf
        if level > _last_level(c):  # a ZeRO-3 plan's last level: its stage-1 twin's predicted step
            return max(self.bound_at(c, _last_level(c)), self.twin_s(c))
        return (self.recompute_bound, self.lower_bound, self.lower_bound, self.owner_bound)[level](c)

    def twin_s(self, c: Candidate, *, predict: bool = True) -> float:
        """A lower bound on ZeRO-3 plan ``c``'s step time from its stage-1 twin (the same plan at ZeRO-1):
        the twin's predicted step (:mod:`mpipe_tune.cost._sharding_events`: a stage-3 plan's events last as long as its
        twin's plus the collectives' waits, its owners and encoder backwards are the twin's, so its step is
        never shorter), predicted here unless ``predict`` is off (then only where it is known already); 0
        where it is not known, or where the twin's memory floors say it cannot fit (it would never be
        predicted for itself: its prediction would be spent on this bound alone)."""
        if c.zero_stage < 2:
            return 0.0
        twin = replace(c, zero_stage=1, label="")
        known = self._results.get(twin)
        if known is not None:
            return known.mean_s
        if not predict or self.bound_at(twin, _last_level(twin)) == math.inf:
            return 0.0
        return self.evaluate(twin, memory=False).mean_s

    def order_floor_bytes(self, c: Candidate) -> float:
        """A lower bound on ``c``'s peak memory from its order (derive's, with its default owners) and
        layer tables, without timing it: per rank its static memory plus the largest saved activations
        of its Sharded stages that its order keeps live together
        (:class:`~mpipe_tune.search._bounds.LiveSets`; the transposed regions' are left out, as their
        owners vary per step); at least :meth:`peak_floor_bytes`."""
        key = ("order floor", *_unlabelled(c))
        if key not in self._bounds:
            compiled = self.compiled(c, self.slab_counts(c))
            layout, arrays = compiled.memory_layout, compiled.arrays

            def live_sets() -> LiveSets:
                saved = slice(0, layout.num_saved)
                sharded = [p.region for p in compiled.derived.placement if isinstance(p.owner, ByLayer)]
                keep = np.isin(arrays.region[layout.alloc_event[saved]], sharded)
                return LiveSets.of(compiled.order.nodes, compiled.num_events, layout.rank[saved],
                                   layout.alloc_event[saved], layout.free_event[saved], keep)

            live = arrays.once("search: live sets", live_sets)
            saved = self._bound_sums(c).saved
            floor = live.floor(saved.reshape(saved.shape[0], -1), layout.lo, layout.hi)
            self._bounds[key] = max(self.peak_floor_bytes(c), float(max(np.asarray(self._static_bytes(c)) + floor)))
        return self._bounds[key]

    def static_floor_bytes(self, c: Candidate) -> float:
        """A lower bound on ``c``'s largest per-rank static memory from its degrees and memory knobs alone
        (no slabs, no layer table of a sampled step): every layer's static bytes shared by the ``P``
        ranks (each layer is held by one rank or more). The parameter counts are read off a layer table
        of one sequence (they do not depend on the workload), one per tensor-parallel degree of the backbone
        and the encoder: a table's parameter columns read nothing else of the setting (no recomputation,
        context or sequence parallelism; the expert degree is kept in the key all the same), so its timing
        columns, which static_bytes_of does not read, may be another setting's."""
        key = ("static floor", c.pp, c.tp, c.dp, c.ep, c.cp, c.zero_stage, c.reshards_after_forward,
               c.sequence_parallel, c.encoder_tp)
        if key not in self._bounds:
            p = self.problem
            table_key = ("static table", c.tp, c.ep, c.encoder_tp)  # what the parameter columns read
            if table_key not in self._bounds:
                self._bounds[table_key] = self.predictor.table(self._own(c), Workload(p.sequences(0, 1), "static"))
            table = self._bounds[table_key]
            layers = ((0, p.model.num_layers),)
            self._bounds[key] = sum(static_bytes_of((layers,), p.model, table, self.options(c))) / c.pp
        return self._bounds[key]

    def recompute_bound(self, c: Candidate) -> float:
        """A bound on ``c``'s step time from the tables of its setting without recomputation: all the work,
        plus what full recomputation adds at least, shared by the ``P`` ranks (recomputation only adds
        backward time: the other columns of the tables are the same)."""
        key = ("recompute", _table_setting(c, recompute=False), c.pp, c.recompute is True)
        if key not in self._bounds:
            plain = replace(c, recompute=False)
            sums = self._bound_sums(plain)
            extra = np.zeros(self.problem.samples)
            if c.recompute is True:
                extra = np.array([full_recompute_s(self.table(k, plain)[1], self.problem.model)
                                  for k in range(self.problem.samples)])
            self._bounds[key] = float(np.mean((sums.work[:, -1] + extra) / c.pp))
        return self._bounds[key]

    def _index(self, c: Candidate) -> SlabIndex:
        index_key = (c.schedule, c.cut, c.pp, self.slab_counts(c))
        index = self._slab_index.get(index_key)
        if index is None:
            cut, schedule = c.parsed()
            index = SlabIndex.of(schedule, cut.regions(self.problem.model.num_layers), index_key[-1])
            self._slab_index[index_key] = index
        return index

    def _step_bounds(self, c: Candidate, owners: np.ndarray | None) -> list[float]:
        sums = self._bound_sums(c)
        index = self._index(c)
        owned = None
        if owners is not None and index.replicated:
            owned_key = (_table_setting(c), index.replicated, _forward_only(c))
            if owned_key not in self._owned:
                self._owned[owned_key] = sums.owned_work(index.replicated, _forward_only(c))
            owned = self._owned[owned_key]
        return [float(b) for b in step_bounds(sums, index, c.pp, owned, owners)]

    def _bound_sums(self, c: Candidate) -> BoundSums:
        key = _table_setting(c)
        if key not in self._sums:
            tables = [self.table(k, c)[1] for k in range(self.problem.samples)]
            runs_backward = np.cumsum(self.problem.model.trainable_bits()) > 0  # a trainable layer at or before it
            self._sums[key] = BoundSums.of([t.fwd_s for t in tables], [t.backward_s(self.problem.model) for t in tables],
                                           [t.saved_bytes for t in tables], runs_backward)
        return self._sums[key]

    def owners(self, c: Candidate, sample: int) -> tuple[int, ...] | None:
        """The transposed region's owner map of ``c`` on step ``sample`` (None without a transpose)."""
        choice = self._owner_choice(c, sample)
        return None if choice is None else choice.owners

    def _owner_choice(self, c: Candidate, sample: int) -> OwnerChoice | None:
        c = _decided_as(c)
        _, table, sums = self._table(sample, c)
        slack = self.slack_s(c, sample) if chooses_owners(c) else None
        return self.predictor.owners(self._own(c), sums, slack_s=slack)

    def slack_s(self, c: Candidate, sample: int) -> tuple[float, ...]:
        """Per rank, the warmup slack ``w_r`` of ``c``'s round-robin plan on step ``sample``."""
        rr = replace(c, owner_policy="round-robin", encoder_backward=COOLDOWN, encoder_backward_slots=None,
                     encoder_backward_ranks=None)
        return self._step(rr, self.slab_counts(rr), sample, memory=False).slack_s

    def encode_s(self, c: Candidate, sample: int) -> np.ndarray:
        """Owned forward seconds of each microbatch of step ``sample``: the forwards of every
        transposed region (the encoder, and any interior or sink transpose: they share the owner map)."""
        return self.predictor.encode_s(c, self.table(sample, c)[1])

    def prediction(self, c: Candidate, sample: int = 0) -> tuple[Prediction, Workload]:
        """The full prediction of ``c`` on one step by the search's own predictor, with the slabs, owners
        and encoder backward slots it chose made explicit: what plan.json records and ``show``
        re-predicts (kept: a second call returns the same prediction)."""
        key = (c, sample)
        if key not in self._predictions:
            workload, table = self.table(sample, c)
            slots, ranks = c.encoder_backward_slots, c.encoder_backward_ranks
            if c.encoder_backward == OPTIMISED and slots is None:
                choice = self.encoder_backward_choice(c, sample)
                slots, ranks = (None, None) if choice is None else (choice.slots, choice.ranks)
            explicit = replace(self._own(c), slab_counts=self.slab_counts(c), owner_map=self.owners(c, sample),
                               encoder_backward_slots=slots, encoder_backward_ranks=ranks)
            self._predictions[key] = (self.predictor.predict(explicit, workload, table=table), workload)
        return self._predictions[key]

    def encoder_backward_slots(self, c: Candidate, sample: int) -> tuple[int, ...] | None:
        """The slots of ``c``'s encoder backwards on step ``sample`` (None: the cooldown, or the plan runs
        none), on the ranks :meth:`encoder_backward_choice` names."""
        choice = self.encoder_backward_choice(c, sample)
        return None if choice is None else choice.slots

    def encoder_backward_choice(self, c: Candidate, sample: int) -> EncoderBackward | None:
        """The slots (and ranks) of ``c``'s encoder backwards on step ``sample`` (None: the cooldown, or
        the plan runs none)."""
        slabs = self.slab_counts(c)
        return self._encoder_backward(c, slabs, self.predictor.retimed_owners(c, self._owner_choice(c, sample)), sample)

    def compiled(self, c: Candidate, slabs, owners: tuple[int, ...] | None = None) -> CompiledPlan:
        """``c``'s plan with ``slabs``, compiled for ``c``'s cost options; ``owners`` (None: derive's
        default) re-times it for another owner map of the transposed region."""
        return self.predictor.compile(self._own(c), slabs=slabs, owners=owners)

    # ---------------------------------------------------------------------------- internals

    def _encoder_backward(self, c: Candidate, slabs, owners: tuple[int, ...] | None,
                          sample: int) -> EncoderBackward | None:
        """Where ``c``'s encoder backwards run on step ``sample`` with ``slabs`` and the owner map
        ``owners`` (:meth:`Predictor.encoder_backward`), kept per step (a ZeRO-3 plan's: its twin's,
        :func:`_decided_as`)."""
        c = _decided_as(c)
        key = (c.schedule, c.cut, c.pp, *c.setting, slabs, owners, c.encoder_backward, c.encoder_backward_slots,
               c.encoder_backward_ranks, sample)
        if key not in self._slots:
            own = self._own(c)
            compiled = self.predictor.compile(own, slabs=slabs, owners=owners)
            self._slots[key] = self.predictor.encoder_backward(own, compiled, self._table(sample, c)[2])
        return self._slots[key]

    def _step(self, c: Candidate, slabs, sample: int, memory: bool) -> StepResult:
        owners = self._owner_choice(c, sample)
        retimed = self.predictor.retimed_owners(c, owners)
        key = (c.schedule, c.cut, c.pp, *c.setting, slabs, retimed, c.encoder_backward, c.encoder_backward_slots,
               c.encoder_backward_ranks, sample)
        cached = self._steps.get(key)
        if cached is not None and (not memory or cached.peak_bytes is not None):
            return cached
        _, table, sums = self._table(sample, c)
        step = self.predictor.step(self._own(c), table, sums=sums, slabs=slabs, owners=owners,
                                   encoder_backward=self._encoder_backward(c, slabs, retimed, sample), memory=memory)
        t = step.timeline
        result = StepResult(
            makespan_s=t.makespan_s,
            bubble_share=sum(t.bubble_s) / (t.makespan_s * c.pp) if t.makespan_s > 0 else 0.0,
            max_spill_s=max(t.spill_s),
            peak_bytes=None if step.memory is None else max(step.memory.peak_bytes),
            slack_s=tuple(t.warmup_slack_s),
        )
        self._steps[key] = result
        return result


def _last_level(c: Candidate) -> int:
    """The last of :meth:`Evaluator.bound_at`'s levels before the twin's: 3 where a per-step policy chooses
    the owners (their bound), else 2."""
    return 3 if chooses_owners(c) and c.owner_map is None else 2


def _decided_as(c: Candidate) -> Candidate:
    """The candidate whose timeline decides ``c``'s per-step choices (owners, encoder backward slots): its
    stage-1 twin for a ZeRO-3 plan (the ZeRO-3 waits are left out of the choice, which keeps the twin's
    step a lower bound on its own, :meth:`Evaluator.twin_s`), else ``c`` itself."""
    return replace(c, zero_stage=1) if c.zero_stage >= 2 else c


def _table_setting(c: Candidate, recompute: bool | str | None = None) -> tuple:
    """What ``c``'s layer tables depend on besides the step: its setting but the ZeRO stage, which no
    table reads (``recompute``: with that recomputation in place of ``c``'s)."""
    return (c.tp, c.dp, c.num_microbatches, c.recompute if recompute is None else recompute, c.ep, c.cp,
            c.sequence_parallel, c.encoder_tp)


_UNLABELLED = tuple(f.name for f in fields(Candidate) if f.name not in ("label", "owner_policy"))


def _unlabelled(c: Candidate) -> tuple:
    """``c``'s fields but its label and owner policy, which no memory bound reads: what
    ``replace(c, label="", owner_policy=None)`` compares by, without building that candidate (the bounds
    are looked up for every point a search orders)."""
    return tuple(getattr(c, name) for name in _UNLABELLED)


def _rows_setting(setting: tuple) -> tuple:
    """Of a :func:`_table_setting`, what the tables' kernel rows read: :func:`_kernel_setting` but the
    recomputation, which only picks columns after them."""
    return setting[:1] + setting[4:]


def _with_recompute(setting: tuple, recompute: bool | str) -> tuple:
    """A :func:`_table_setting` with ``recompute`` in place of its own."""
    return setting[:3] + (recompute,) + setting[4:]


def _kernel_setting(setting: tuple) -> tuple:
    """Of a :func:`_table_setting`, what the cost kernels' options read: all but the data-parallel degree and
    the microbatch count, which only change the microbatches (the tables are built at dp = 1)."""
    return setting[:1] + setting[3:]


def _bound_key(c: Candidate) -> tuple:
    """``c``'s fields but what no lower bound reads (the label, the owners, the encoder backwards'
    placement, the ZeRO stage): a tuple, as a bound is looked up for every point of the space."""
    return (c.schedule, c.cut, c.degrees, c.num_microbatches, c.slab_counts, c.recompute, c.sequence_parallel,
            c.dtype, c.frozen)


def _static_owners(c: Candidate) -> tuple[int, ...] | None:
    """The transposed regions' owner map of ``c`` where it is known before the step: a given map, or
    round-robin (None: no transposed region, or a per-step policy)."""
    if not c.has_transpose:
        return None
    if c.owner_map is not None:
        return tuple(c.owner_map)
    return None if chooses_owners(c) else round_robin(c.num_microbatches, c.pp)


def _forward_only(c: Candidate) -> bool:
    """Whether an owned encoder backward of ``c`` may run off its owner (full recomputation, placed off
    the cooldown): then only the owned forwards are certain to run on the owner."""
    return c.recompute is True and (c.encoder_backward != COOLDOWN or c.encoder_backward_ranks is not None)
