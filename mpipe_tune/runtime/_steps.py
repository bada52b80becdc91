"""Each step's microbatch metadata and owner map at run time, and the view of the plan it runs.

A plan file stores one owner map of the transposed encoder: the one its owner policy chose for the
stored microbatches, one step's example. A real step brings other images. Two settings say what a
run does with that (:class:`StepModes`):

- **data** ``sampled``: step ``k`` trains the microbatches a data loader would hand it, drawn from the
  plan's workload mix with seed ``seed + k`` (:class:`~mpipe_tune.inputs._workload.MixDraw`; step 0
  is the stored workload); ``stored``: every step trains the stored microbatches (a workload file
  has no mix to draw from).
- **owners** ``per-step``: each step's owner map is the plan's policy (``greedy``, ``optimal`` or,
  trivially, ``round-robin``) applied to that step's encode seconds and warmup slack, both read off
  the cost model for the step's metadata (:meth:`~mpipe_tune.cost._predictor.Predictor.owners`; ``optimal``
  takes the greedy map past its run-time node budget, and the step's record says so); ``fixed``:
  every step runs the stored map.

The defaults: per-step owners when the plan has a policy other than round-robin, fixed when it has
round-robin or only an explicit map, or encoder backwards moved off their owners (ranks chosen for
the stored map: per-step owners are refused for it); sampled data with per-step owners when the plan records its
draw, stored data otherwise. ``fixed`` with ``stored`` is the stored plan exactly as it was checked
against ``derive`` (:mod:`mpipe_tune.runtime._plan_view`); any other pair asks the plan's
:class:`~mpipe_tune.cost._predictor.Predictor` for the step: its layer table, owner map and the stored plan
re-timed for that map (:meth:`~mpipe_tune.cost._predictor.Predictor.step`: the same events, the owned ones
on their new ranks, as ``derive`` gives them), whose durations emulated compute waits out.

Every rank computes its step plan from the same metadata; :attr:`StepPlan.key` digests the step's
metadata and owner map, and the worker checks with one all-reduce that every rank holds the same key
before the step starts (a rank that read another plan file, or another draw, is refused in one line).

Importing this module imports no torch.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mpipe_tune.algebra import ROUND_ROBIN
from mpipe_tune.cost import POLICIES, Framework, Predictor
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.plan_file import load_plan_profile
from mpipe_tune.runtime._plan_view import PlanView, rank_pairs, view_of_step

PER_STEP, FIXED = "per-step", "fixed"
OWNER_MODES = (PER_STEP, FIXED)
SAMPLED, STORED = "sampled", "stored"
DATA_MODES = (SAMPLED, STORED)


@dataclass(frozen=True)
class StepModes:
    owners: str
    """``per-step`` or ``fixed`` (see the module docstring)."""
    data: str
    """``sampled`` or ``stored``."""

    @property
    def is_stored_plan(self) -> bool:
        """Every step runs the stored plan as it is (fixed owners on the stored microbatches)."""
        return self.owners == FIXED and self.data == STORED


def resolve_modes(view: PlanView, owners: str | None = None, data: str | None = None) -> StepModes:
    """The run's owner and data modes (None: the plan's defaults), or one line saying why the plan
    cannot run them."""
    if owners is not None and owners not in OWNER_MODES:
        raise MpipeError(f"owner mode {owners!r} is unknown; use one of {', '.join(OWNER_MODES)}",
                         quantities=("owner mode",))
    if data is not None and data not in DATA_MODES:
        raise MpipeError(f"data mode {data!r} is unknown; use one of {', '.join(DATA_MODES)}", quantities=("data mode",))
    c, where = view.candidate, f"plan file {view.path}"
    policy = c.owner_policy
    movable = view.plan.source is not None
    moved = c.encoder_backward_ranks is not None  # ranks chosen for the stored owner map
    if owners is None:
        owners = PER_STEP if movable and policy not in (None, ROUND_ROBIN) and not moved else FIXED
    if owners == PER_STEP:
        if moved:
            raise MpipeError(f"{where} runs encoder backwards on other ranks than their owners, chosen for its stored "
                             f"owner map, which per-step owners would change; run it with owner mode fixed",
                             quantities=("owner mode",))
        if not movable:
            raise MpipeError(f"{where}: schedule <{c.schedule}> does not start with a transpose region, so no "
                             f"microbatch has an owner to choose per step; run it with owner mode fixed", quantities=("owner mode",))
        if policy is None:
            raise MpipeError(f"{where} holds an explicit owner map and no owner policy to choose each step's owners "
                             f"with; run it with owner mode fixed, or re-plan with owner policy greedy (or optimal)",
                             quantities=("owner mode", "owner policy"))
        if policy not in POLICIES:
            raise MpipeError(f"{where}: its owner policy {policy!r} is unknown; owner policies are "
                             f"{', '.join(POLICIES)}: run the stored map with owner mode fixed, or re-plan", quantities=("owner mode",))
    stored = view.section.workload
    draw = stored.draw
    if data is None:
        data = SAMPLED if owners == PER_STEP and draw is not None else STORED
    if data == SAMPLED:
        if draw is None:
            raise MpipeError(f"{where}: its workload '{stored.name}' is a fixed list of "
                             f"microbatches, not a draw from a named mix, so there are no other steps to sample; "
                             f"run it with data mode stored, or re-plan with a named mix as the workload (e.g. balanced)",
                             quantities=("data mode",))
        first = draw.step(0, view.num_microbatches).microbatches
        if first != view.microbatches:
            raise MpipeError(f"{where}: its stored microbatches are not step 0 of its recorded draw (mix '{draw.mix}', "
                             f"seed {draw.seed}): the step metadata does not match the plan; the file is damaged or "
                             f"was edited: re-create it")
    return StepModes(owners, data)


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: its view of the plan, and where its owner map came from."""

    step: int
    view: PlanView
    owners: tuple[int, ...] | None
    """The transposed region's owner map of this step (None without one)."""
    policy: str | None
    """The policy that made :attr:`owners` (``greedy`` where ``optimal`` fell back); None: the stored map."""
    workload_name: str
    owners_s: float
    """Seconds spent choosing the owner map (encode seconds, slack and policy); 0 for a fixed map."""
    prepare_s: float
    """Seconds spent building this step plan (metadata, layer table, owner map, re-timed order, view)."""

    @property
    def key(self) -> int:
        """A 63-bit digest of the step's metadata and owner map: every rank must hold the same one."""
        text = repr((self.step, self.owners, [(mb.image_tokens, mb.text_tokens, mb.image_sizes())
                                              for mb in self.view.microbatches]))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def record(self) -> dict[str, Any]:
        """The step's entry in the run's summary."""
        return {"step": self.step, "workload": self.workload_name,
                "image_tokens": [mb.image_tokens for mb in self.view.microbatches],
                "owners": None if self.owners is None else list(self.owners), "policy": self.policy,
                "predicted_step_s": self.view.predicted_step_s, "owners_s": self.owners_s,
                "prepare_s": self.prepare_s}


class StepPlanner:
    """Builds each step's :class:`StepPlan` for one plan view and its modes.

    ``profile_spec`` points to the plan's hardware profile when it moved; it must be the profile the
    plan was made for (the cost model predicts each step with it). ``validate_microbatches``, when
    given, refuses a step's microbatches the runtime cannot build (one line)."""

    def __init__(self, view: PlanView, modes: StepModes, *, profile_spec: str | None = None,
                 validate_microbatches: Callable[[Sequence[Microbatch]], None] | None = None) -> None:
        self.view, self.modes = view, modes
        self.validate_microbatches = validate_microbatches
        self.stored = view.section.workload
        source = view.plan.source
        self.stored_owners = source.owner.owners if source is not None else None
        self.predictor: Predictor | None = None
        """The plan's model, profile and framework: each step's table, owner map and re-timed plan."""
        if not modes.is_stored_plan:
            profile = load_plan_profile(view.file, spec=profile_spec)
            self.predictor = Predictor(view.model, profile, Framework.from_inputs(view.file.inputs))

    def metadata(self, step: int) -> Workload:
        """Step ``step``'s microbatches: drawn (``sampled``) or the stored ones."""
        if self.modes.data == STORED:
            return self.stored
        return self.stored.draw.step(step, self.view.num_microbatches)

    def plan(self, step: int) -> StepPlan:
        """Step ``step``'s plan: its metadata, owner map and view."""
        started = time.perf_counter()
        if self.modes.is_stored_plan:
            return StepPlan(step, self.view, self.stored_owners, None, self.stored.name, 0.0,
                            time.perf_counter() - started)
        workload = self.metadata(step)
        if self.validate_microbatches is not None:
            self.validate_microbatches(workload.microbatches)
        c, predictor = self.view.candidate, self.predictor
        table = predictor.table(c, workload)
        owners, policy, owners_s = self.stored_owners, None, 0.0
        if self.modes.owners == PER_STEP:  # the policy reads the slack off the round-robin plan, compiled once
            chosen = time.perf_counter()
            choice = predictor.owners(c, table, fallback=True)
            owners_s = time.perf_counter() - chosen
            owners, policy = choice.owners, choice.policy
        timed = predictor.step(replace(c, owner_map=owners), table, owners=None, memory=False)
        timeline = timed.timeline  # each event's seconds with its sharding actions' (ZeRO-2 and 3)
        view = view_of_step(self.view, timed.compiled.plan, workload.microbatches,
                            tuple(timeline.charged_s().tolist()), timeline.makespan_s)
        return StepPlan(step, view, owners, policy, workload.name, owners_s, time.perf_counter() - started)

    def rank_pairs(self) -> set[tuple[int, int]]:
        """The (low, high) pipeline-rank pairs any step may exchange transfers over: the stored view's,
        and with per-step owners, every rank with the other end of each transfer of the transposed
        region (its owner may be any rank)."""
        view = self.view
        pairs = rank_pairs(view)
        if self.modes.owners == PER_STEP:
            region = view.plan.source.region
            for ts in view.sends.values():
                for t in ts:
                    ends = (view.events[t.producer], view.events[t.consumer])
                    if ends[0].region == region or ends[1].region == region:
                        other = t.dst_rank if ends[0].region == region else t.src_rank
                        pairs |= {(min(r, other), max(r, other)) for r in range(view.num_ranks) if r != other}
        return pairs

    def held_layers(self, rank: int) -> tuple[int, ...]:
        """The layers ``rank`` must hold for any step: its stored ones, and with per-step owners the whole
        transposed region (it may own any microbatch's encode)."""
        layers = set(self.view.layers_of(rank))
        if self.modes.owners == PER_STEP:
            layers.update(range(*self.view.region_layers[self.view.plan.source.region]))
        return tuple(sorted(layers))
