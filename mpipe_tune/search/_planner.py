"""Planning one problem: the search, the baselines beside it, and the best of everything evaluated.

:func:`plan` is what ``mpipe-tune plan`` runs (the command only parses flags and writes files):

1. the space the user asked for (:class:`SpaceRequest`, flags as given, ``None`` where not given), with
   the defaults that find a plan: a MoE model searches expert parallelism unless ``--ep`` is given;
2. each baseline's own best layout (:mod:`mpipe_tune.search._families`) and the user's current layout
   first: they are strong points the search starts from (its incumbent, which its bounds prune against);
3. the search (:func:`~mpipe_tune.search._driver.run_search`);
4. the winner: the fastest plan that fits of every plan the command evaluated (the search's best, each
   family's best, the current layout, each baseline at the winner's degrees), so that no row of the
   table is faster than ``best``;
5. when nothing fits, the memory knobs the user did not fix (:data:`WIDENABLE`) are widened once and the
   search runs again (:attr:`PlanOutcome.widened` says which); a flag the user gave is never changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mpipe_tune.algebra import ZERO_SETTINGS, PLACEMENTS, ArchCost, Model, Layout, Skeleton
from mpipe_tune.errors import DoesNotFitError, MpipeError
from mpipe_tune.interrupt import keep, phase, served
from mpipe_tune.search import _compare as compare
from mpipe_tune.search._evaluate import Evaluation, Evaluator
from mpipe_tune.search._families import OwnBest, search_families
from mpipe_tune.search._layout import parse_layout
from mpipe_tune.search._owners import POLICIES
from mpipe_tune.search._problem import Problem
from mpipe_tune.search._space import SearchSpace, SpaceOptions

SAMPLED_TRIALS = 100
"""A sampler's budget when ``--trials`` is not given."""
DEFAULT_BATCH_PER_DEVICE = 4
"""A sampled mix's default global batch: this many sequences per device."""
RECOMPUTE = {"off": (False,), "none": (False,), "on": (True,), "full": (True,), "selective": ("selective",),
             "search": (False, True), "all": (False, "selective", True)}
ZERO = {**{word: (stage,) for word, (stage, _) in ZERO_SETTINGS.items()}, "search": (0, 1), "all": (0, 1, 2, 3)}
"""``search`` keeps to stages 0 and 1: with stage 3 in it the issue-27 DeepSeek-V3 command with every knob took
twice the CPU (94 s against 44 s at 512 devices, benchmarks/README.md), over its 60 s target; ``all`` adds
stages 2 and 3 (as ``--recompute all`` adds selective), and the widening when nothing fits uses it."""
RESHARD = {"3": (False, True), "all": (False, True), "3-reshard": (True,), "3-keep": (False,)}
"""The reshard policies a ``--zero`` word searches at stage 3 (:attr:`SpaceOptions.reshard`): both (keeping the
weights through the step, then gathering them for every forward and backward) for ``3`` and ``all``, the one its
word names for ``3-reshard`` and ``3-keep``."""
SEQUENCE_PARALLEL = {"off": (False,), "on": (True,), "search": (False, True)}
WIDENABLE = {"recompute": "all", "zero": "all", "sequence_parallel": "search"}
"""The memory knobs widened when nothing fits, and what each is widened to (a setting's text). Expert
parallelism is not among them: a MoE model searches it unless its degrees are given, and a dense one has none."""
KNOBS = {"recompute": "recomputation", "zero": "ZeRO stage", "sequence_parallel": "sequence parallelism"}
"""Each :data:`WIDENABLE` knob as a message names it (the quantity)."""


DEGREES = {"pp": "pipeline-parallel degrees", "tp": "tensor-parallel degrees", "dp": "data-parallel degrees",
           "ep": "expert-parallel degrees", "cp": "context-parallel degrees"}
"""Each degree's list of values in the space, as a message names it."""


def default_global_batch(devices: int) -> int:
    """The global batch of a sampled mix when none is given: :data:`DEFAULT_BATCH_PER_DEVICE` per device."""
    return DEFAULT_BATCH_PER_DEVICE * devices


def has_experts(model: Model) -> bool:
    """Whether ``model`` has MoE layers (expert parallelism applies)."""
    return any(isinstance(u.cost, ArchCost) and u.cost.kind == "moe_block" for u in model.layers)


def int_list(text: str, quantity: str) -> tuple[int, ...]:
    """``"2,4"`` as ``(2, 4)``; one line naming ``quantity`` unless it is integers >= 1 separated by commas."""
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise MpipeError(f"{quantity} '{text}': expected integers >= 1 separated by commas, e.g. 2,4",
                         quantities=(quantity,))
    return values


@dataclass(frozen=True)
class SpaceRequest:
    """The space's flags as the user gave them: text, ``None`` where a knob was not given (its default
    then applies, and :func:`plan` may widen it when nothing fits)."""

    skeletons: str = "1f1b,gpipe"
    max_chunks: int = 2
    cut_window: int = 1
    interior_transpose: bool = False
    owners: str = ",".join(POLICIES)
    max_microbatches: int = 64
    encoder_backward: str = "cooldown"
    encoder_tp: str = "off"
    cp: str = "1"
    pp: str | None = None
    tp: str | None = None
    dp: str | None = None
    recompute: str | None = None
    """off (default), on, selective, search or all (see :data:`RECOMPUTE`)."""
    ep: str | None = None
    """Degrees such as ``1,8``, or ``search``; default: ``search`` for a MoE model, else ``1``."""
    zero: str | None = None
    """0, 1 (default), 2, 3, 3-reshard, 3-keep, search (stages 0 and 1) or all (0 to 3); see :data:`ZERO` and
    :data:`RESHARD`."""
    sequence_parallel: str | None = None
    """off (default), on or search."""

    def widened(self) -> tuple[SpaceRequest, tuple[str, ...]]:
        """This request with every :data:`WIDENABLE` knob the user did not give widened, and their names."""
        open_knobs = tuple(k for k in WIDENABLE if getattr(self, k) is None)
        return replace(self, **{k: WIDENABLE[k] for k in open_knobs}), open_knobs


def space_options(request: SpaceRequest, model: Model) -> SpaceOptions:
    """The :class:`SpaceOptions` a request stands for (one line naming the flag where a value is wrong)."""
    owners = tuple(p.strip() for p in request.owners.split(",") if p.strip())
    unknown = [p for p in owners if p not in POLICIES]
    if unknown or not owners:
        raise MpipeError(f"owner policies {request.owners!r}: use policies from {', '.join(POLICIES)}, separated by "
                         f"commas", quantities=("owner policies",))
    skeletons = tuple(s.strip() for s in request.skeletons.split(",") if s.strip())
    sharded = [s.value for s in Skeleton if s.layout is Layout.SHARDED]
    if not skeletons or any(s not in sharded for s in skeletons):
        raise MpipeError(f"skeletons {request.skeletons!r}: use Sharded skeletons from {', '.join(sharded)}, "
                         f"e.g. 1f1b,gpipe", quantities=("skeletons",))
    for name, value in (("microbatch count bound", request.max_microbatches), ("chunk bound", request.max_chunks)):
        if value < 1:
            raise MpipeError(f"{name} is {value}, but it must be an integer >= 1", quantities=(name,))
    pins = {k: int_list(getattr(request, k), DEGREES[k]) if getattr(request, k) else None for k in ("pp", "tp", "dp")}
    ep_text = request.ep if request.ep is not None else ("search" if has_experts(model) else "1")
    if ep_text != "search" and not has_experts(model) and any(e > 1 for e in int_list(ep_text, DEGREES["ep"])):
        raise MpipeError(f"expert-parallel degrees {ep_text}: model '{model.name}' has no MoE layers, so only 1 applies; "
                         f"leave the degrees out (or give 1)", quantities=("expert-parallel degrees",))
    return SpaceOptions(
        skeletons=skeletons, max_chunks=request.max_chunks, cut_window=request.cut_window,
        interior_transpose=request.interior_transpose, owner_policies=owners,
        max_microbatches=request.max_microbatches,
        recompute=RECOMPUTE[request.recompute or "off"],
        ep=None if ep_text == "search" else int_list(ep_text, DEGREES["ep"]),
        cp=int_list(request.cp, DEGREES["cp"]),
        zero=ZERO[request.zero or "1"],
        reshard=RESHARD.get(request.zero or "1", (None,)),
        sequence_parallel=SEQUENCE_PARALLEL[request.sequence_parallel or "off"],
        encoder_tp=request.encoder_tp == "search",
        encoder_backward=PLACEMENTS if request.encoder_backward == "search" else (request.encoder_backward,),
        **pins,
    )


@dataclass(frozen=True)
class SearchOptions:
    """How to search: the study, the budget, the sampler."""

    trials: int | None = None
    """The study's total of finished trials: the cap of ``bound`` (None: a share of the space's points,
    :func:`~mpipe_tune.search._driver.bound_trial_cap`; the tolerance stops it earlier where it can) or the
    budget of a sampler (None: :data:`SAMPLED_TRIALS`)."""
    timeout_s: float | None = None
    storage: str | None = None
    """An Optuna RDB URL; None: the study is kept in memory."""
    study: str | None = None
    seed: int = 0
    sampler: str = "bound"
    """``bound`` (lower-bound order, see :mod:`mpipe_tune.search._driver`), ``tpe``, ``nsga2`` or ``random``."""
    tolerance: float = 0.01
    """``bound``: stop once no unvisited plan can beat the best by more than this share of its step time."""
    exhaustive: bool = False
    progress: bool = True
    current: str | None = None
    """The user's current layout (:mod:`mpipe_tune.search._layout`), or None."""
    current_args: str | None = None
    """With a MindSpeed-MM model.json as ``current``: its launch flags or script."""


@dataclass(frozen=True)
class PlanOutcome:
    """What :func:`plan` found: the winner and every row beside it."""

    problem: Problem
    evaluator: Evaluator
    space: SearchSpace
    result: Any
    """The search's :class:`~mpipe_tune.search._driver.SearchResult` (of the last space searched)."""
    best: Evaluation | None
    """The fastest plan that fits of all evaluated; None when none fits."""
    best_from: str | None
    """Where the winner came from: ``search``, a baseline (``vpp``), its family (``vpp@own``) or ``current``."""
    baselines: list[tuple[str, Evaluation | None]] = field(default_factory=list)
    families: list[OwnBest] = field(default_factory=list)
    current: Evaluation | None = None
    widened: tuple[str, ...] = ()
    """The memory knobs widened because nothing in the requested space fit (:data:`WIDENABLE`)."""
    least_memory: Evaluation | None = None
    """When nothing fits: the plan with the smallest peak (or static memory) tried."""

    @property
    def widened_line(self) -> str | None:
        """One line naming the knobs widened (None when none was)."""
        if not self.widened:
            return None
        knobs = ", ".join(f"{KNOBS[k]} {WIDENABLE[k]}" for k in self.widened)
        return f"nothing in the requested space fits memory; widened the memory knobs not given: {knobs}"

    def no_fit_error(self) -> DoesNotFitError:
        """The error for a problem where no plan fits (only after widening)."""
        return DoesNotFitError(self.no_fit_message(), quantities=tuple(KNOBS.values()))

    def no_fit_message(self) -> str:
        """The one line for a problem where no plan fits (only after widening)."""
        least = self.least_memory
        capacity = self.problem.profile.memory_capacity_bytes
        given = [KNOBS[k] for k in WIDENABLE if k not in self.widened]
        tried = "" if not self.widened else f" (after widening {', '.join(KNOBS[k] for k in self.widened)})"
        hint = "add devices or freeze blocks" + (f", or search the knobs you fixed ({', '.join(given)})"
                                                 if given else "")
        if least is None:
            return f"no plan fits memory{tried}; {hint}"
        what = "peak" if least.exact else "static memory (weights, gradients, optimizer state)"
        return (f"no plan fits memory{tried}: of the plans tried the smallest {what} is {least.peak_bytes / 2**30:.1f} "
                f"GiB ({least.candidate}) against {capacity / 2**30:.1f} GiB per device of "
                f"'{self.problem.profile.name}'; {hint}")

    def summary(self) -> dict[str, Any]:
        """The ``search`` section of plan.json and ``--json``: the rows and what the search covered."""
        best, result = self.best, self.result
        assert best is not None, "no plan fits: nothing to summarize"
        p = self.problem
        summary = {
            "objective": "mean predicted step time over the sampled steps",
            "candidate": best.candidate.to_dict(),
            "best_from": self.best_from,
            "widened": list(self.widened),
            "global_batch": p.global_batch, "samples": p.samples, "seed": p.seed,
            "workload_source": p.source_name, "devices": p.devices,
            "study": result.study_name, "storage": result.storage, "mode": result.mode, "ending": result.ending,
            "trials": result.num_trials, "new_trials": result.num_new, "evaluated": result.num_evaluated,
            "space_size": result.space_size, "settled_by_bound": result.num_bounded, "gap": result.gap,
            "tolerance": result.tolerance, "wall_s": result.wall_s, "interrupted": result.interrupted,
            "comparison": compare.comparison_rows(best, self.baselines),
            "own_best": compare.own_best_rows(best, self.baselines, self.families),
            "families": compare.family_record(self.families),
            "current": None if self.current is None else compare.current_row(best, self.baselines, self.current),
            "speedups": compare.speedups(best, self.baselines, self.families, self.current),
        }
        if result.gap is None:  # no bound search: no gap to state
            del summary["gap"]
        return summary


def build_problem(model: Model, profile, devices: int, *, workload=None, mix: str | None = None, dataset=None,
                  global_batch: int | None, samples: int, seed: int, options) -> Problem:
    """The search :class:`Problem`: a sampled ``mix`` or ``dataset`` (global batch default
    :func:`default_global_batch`) or a fixed ``workload`` (its length by default)."""
    if mix is not None or dataset is not None:
        batch = default_global_batch(devices) if global_batch is None else global_batch
        source = {"mix": mix} if mix is not None else {"dataset": dataset}
        return Problem(model, profile, devices, batch, num_samples=samples, seed=seed, options=options, **source)
    return Problem(model, profile, devices, len(workload) if global_batch is None else global_batch,
                   workload=workload, options=options)


def plan(problem: Problem, request: SpaceRequest, search: SearchOptions) -> PlanOutcome:
    """Search ``problem`` and compare (see the module docstring); when nothing fits, widen and search again."""
    evaluator = Evaluator(problem)
    weights = evaluator.reference_weights()
    space = SearchSpace(problem, weights, space_options(request, problem.model))
    current = None
    if search.current is not None:  # checked, derived and predicted before the search
        current = evaluator.evaluate(parse_layout(search.current, space, label=compare.CURRENT,
                                                  launch_args=search.current_args))
    outcome = _plan_space(problem, evaluator, space, search, current, ())
    if outcome.best is not None or outcome.result.interrupted:
        return outcome
    wider, knobs = request.widened()
    if not knobs:
        return outcome
    space = SearchSpace(problem, weights, space_options(wider, problem.model))
    again = _plan_space(problem, evaluator, space, search, current, knobs)
    least = min((e for e in (outcome.least_memory, again.least_memory) if e is not None),
                key=lambda e: e.peak_bytes, default=None)
    return replace(again, least_memory=least)


def _plan_space(problem: Problem, evaluator: Evaluator, space: SearchSpace, search: SearchOptions,
                current: Evaluation | None, widened: tuple[str, ...]) -> PlanOutcome:
    from mpipe_tune.search._driver import run_search  # Optuna, loaded on first use

    phase("families")
    families = search_families(space, evaluator)
    strong = [f.best for f in families if f.best is not None]
    if current is not None and current.fits:
        strong.append(current)
    phase("search")
    trials = search.trials if search.trials is not None else None if search.sampler == "bound" else SAMPLED_TRIALS
    result = run_search(space, evaluator, storage=search.storage, study_name=search.study, n_trials=trials,
                        timeout_s=search.timeout_s, seed=search.seed, sampler=search.sampler,
                        exhaustive=True if search.exhaustive else None, progress=search.progress, seeds=strong,
                        tolerance=search.tolerance)
    if result.interrupted:
        served()  # the search stopped at its next trial for the first Ctrl-C: what it found is compared and written
    keep(f"the study '{result.study_name}' keeps its {result.num_trials} finished trials: rerun the same command "
         f"to continue")
    pool = [(f.label, f.best) for f in families if f.best is not None]
    if current is not None:
        pool.append((compare.CURRENT, current))
    if result.best is not None:
        pool.insert(0, ("search", result.best))
    best, best_from = _fastest(pool)
    baselines: list[tuple[str, Evaluation | None]] = []
    phase("baselines")
    for _ in range(len(compare.BASELINES) + 1):  # a baseline at the winner's degrees may win in turn
        if best is None:
            break
        baselines = compare.evaluate_baselines(evaluator, space, best)
        challenger, name = _fastest([(n, e) for n, e in baselines if e is not None])
        if challenger is None or challenger.mean_s >= best.mean_s:
            break
        best, best_from = challenger, name
    least = result.least_memory
    return PlanOutcome(problem, evaluator, space, result, best, best_from, baselines, families, current, widened,
                       least)


def _fastest(pool: Sequence[tuple[str, Evaluation]]) -> tuple[Evaluation | None, str | None]:
    """The fastest plan of ``pool`` that fits memory (the first listed on a tie), and its name."""
    fitting = [(e.mean_s, i, name, e) for i, (name, e) in enumerate(pool) if e.exact and e.fits
               and e.peak_bytes is not None]
    if not fitting:
        return None, None
    _, _, name, e = min(fitting, key=lambda t: t[:2])
    return e, name
