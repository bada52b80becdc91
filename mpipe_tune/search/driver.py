"""Driving the search: an Optuna study (sampled) or every point of the space (exhaustive).

**Storage.** The study lives in an Optuna RDB storage (SQLite file ``mpipe-tune.db`` in the working
directory by default, any RDB URL for several workers). Each finished trial is written to it as soon
as it is told, so a killed search loses only the trial in flight, and rerunning the same command
continues the study: ``--trials`` is the study's total, not this run's. Sampling itself runs on an
in-memory mirror of the study, seeded with the stored trials and re-synchronised with trials other
workers wrote every ``sync_every_s`` seconds: the sampler reads the whole history on every trial,
and reading it from SQLite costs more than the whole evaluation (2,000 trivial TPE trials: 173 s on
SQLite, 48 s in memory, on the 2-core benchmark machine).

**Constraints.** A plan over memory capacity is infeasible, not penalised: each trial records its
memory excess (GiB over capacity, <= 0 when it fits) as an Optuna constraint, which TPE and NSGA-II
use to steer away, and which ``best`` respects.

**Exhaustive.** When the space has no more points than the trial budget (or when asked), every
point not yet in the study is evaluated and added as a trial with the same parameters the sampler
would use; the exhaustive optimum is then exact and also serves as the sampler's yardstick.

Optuna is imported here and nowhere else in the package.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mpipe_tune.errors import MpipeError
from mpipe_tune.search.candidate import Candidate
from mpipe_tune.search.evaluate import Evaluation, Evaluator
from mpipe_tune.search.space import SearchSpace

DEFAULT_STORAGE = "sqlite:///mpipe-tune.db"
SAMPLERS = ("tpe", "nsga2", "random")
_GIB = 2.0**30
_HAS_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")  # Optuna >= 5; older: constraints_func

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@dataclass(frozen=True)
class SearchResult:
    best: Evaluation | None
    """The best plan that fits memory; None when no evaluated plan fits."""
    least_memory: Evaluation | None
    """The plan with the smallest peak memory (what to report when nothing fits)."""
    num_trials: int
    """Finished trials in the study, earlier runs included."""
    num_new: int
    """Trials this run added."""
    num_evaluated: int
    """Distinct candidates this run evaluated (repeats of a candidate are served from a cache)."""
    space_size: int | None
    """Points in the space, when enumerated (exhaustive mode)."""
    mode: str
    """``optuna`` or ``exhaustive``."""
    study_name: str
    storage: str
    interrupted: bool
    wall_s: float


def problem_key(evaluator: Evaluator, space: SearchSpace) -> str:
    """A digest of everything a trial's value depends on: a study is for one problem only."""
    p = evaluator.problem
    source = p.mix if p.mix is not None else [[mb.image_tokens, mb.text_tokens, list(mb.images)]
                                               for mb in p.workload.microbatches]
    payload = {
        "model": p.model.content_hash(), "profile": p.profile.content_hash(), "source": source,
        "devices": p.devices, "global_batch": p.global_batch, "samples": p.samples, "seed": p.seed,
        "options": repr(p.options), "space": repr(space.options),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_study_name(evaluator: Evaluator, space: SearchSpace) -> str:
    p = evaluator.problem
    return f"{p.model.name}.{p.profile.name}.{p.source_name}.{p.devices}dev.{problem_key(evaluator, space)[:8]}"


def _make_sampler(name: str, seed: int):
    constraints = {} if _HAS_SET_CONSTRAINT else {"constraints_func": lambda t: (_info(t)["memory_excess_gib"],)}
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **constraints)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, **constraints)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise MpipeError(f"--sampler {name!r} is unknown; use one of {', '.join(SAMPLERS)}")


def _open_study(storage: str, study_name: str, key: str):
    try:
        study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize", load_if_exists=True)
    except Exception as exc:  # bad URL, missing driver, unreadable file: whatever the RDB layer raises
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MpipeError(f"--storage {storage}: cannot open the Optuna storage ({detail}); give an RDB URL such as "
                         f"sqlite:///mpipe-tune.db") from None
    stored = study.user_attrs.get("problem")
    if stored is None:
        study.set_user_attr("problem", key)
    elif stored != key:
        raise MpipeError(f"study '{study_name}' in {storage} was made for another planning problem (model, profile, "
                         f"workload, devices, batch or space differ); use another --study name or the original inputs")
    return study


ATTR = "mpipe"
"""The one user attribute of a trial (one row per attribute in an RDB: fewer rows, faster writes)."""


def _trial_attr(e: Evaluation, uid: str) -> dict:
    return {
        "candidate": e.candidate.to_dict(), "mean_s": e.mean_s, "p90_s": e.p90_s, "bubble_share": e.bubble_share,
        "peak_bytes": e.peak_bytes, "memory_excess_gib": e.memory_excess_bytes / _GIB, "uid": uid,
    }


def _info(trial) -> dict:
    return trial.user_attrs.get(ATTR, {})


class _Progress:
    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self.bar = None
        if enabled and total > 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="trial", dynamic_ncols=True, leave=False)
        self.best = math.inf

    def update(self, e: Evaluation) -> None:
        if e.fits and e.mean_s < self.best:
            self.best = e.mean_s
        if self.bar is not None:
            self.bar.update(1)
            if self.best < math.inf:
                self.bar.set_postfix_str(f"best {self.best * 1e3:.4g} ms", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_search(
    space: SearchSpace,
    evaluator: Evaluator,
    *,
    storage: str = DEFAULT_STORAGE,
    study_name: str | None = None,
    n_trials: int = 200,
    timeout_s: float | None = None,
    seed: int = 0,
    sampler: str = "tpe",
    exhaustive: bool | None = None,
    progress: bool = True,
    sync_every_s: float = 10.0,
    refine: bool = True,
    on_trial: Callable[[Evaluation], None] | None = None,
) -> SearchResult:
    """Run (or continue) the study until it holds ``n_trials`` finished trials, ``timeout_s`` passes
    or Ctrl-C; ``exhaustive=None`` enumerates when the space has at most ``n_trials`` points.
    ``refine``: spend the second half of the budget hill-climbing from the best point (see
    :func:`_run_sampled`)."""
    if n_trials < 1:
        raise MpipeError(f"--trials is {n_trials}, but at least one trial is needed")
    start = time.perf_counter()
    key = problem_key(evaluator, space)
    study_name = study_name or default_study_name(evaluator, space)
    study = _open_study(storage, study_name, key)
    stored = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "candidate" in _info(t)]
    size = None
    if exhaustive is None:
        counted = _count_up_to(space, n_trials + 1)
        exhaustive = counted <= n_trials
    evaluated_before = evaluator.num_evaluated
    interrupted = False
    new = 0
    try:
        if exhaustive:
            size = space.size()
            new = _run_exhaustive(space, evaluator, study, stored, timeout_s, start, progress, on_trial)
        else:
            new = _run_sampled(space, evaluator, study, stored, n_trials, timeout_s, start, seed, sampler, progress,
                               sync_every_s, on_trial, refine)
    except KeyboardInterrupt:
        interrupted = True
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "candidate" in _info(t)]
    best, least = _best_of(trials, evaluator)
    return SearchResult(best, least, len(trials), new, evaluator.num_evaluated - evaluated_before, size,
                        "exhaustive" if exhaustive else "optuna", study_name, storage, interrupted,
                        time.perf_counter() - start)


def _count_up_to(space: SearchSpace, limit: int) -> int:
    count = 0
    for _ in space.enumerate():
        count += 1
        if count >= limit:
            break
    return count


def _best_of(trials, evaluator: Evaluator) -> tuple[Evaluation | None, Evaluation | None]:
    """Re-evaluate (from the cache when possible) the best feasible trial and the least-memory one."""
    feasible = [t for t in trials if _info(t)["memory_excess_gib"] <= 0]
    best = min(feasible, key=lambda t: (t.value, t.number), default=None)
    least = min(trials, key=lambda t: (_info(t)["memory_excess_gib"], t.value), default=None)
    as_eval = (lambda t: None if t is None else evaluator.evaluate(Candidate.from_dict(_info(t)["candidate"])))
    return as_eval(best), as_eval(least)


def _run_exhaustive(space, evaluator, study, stored, timeout_s, start, progress, on_trial) -> int:
    done = {json.dumps(_info(t)["candidate"], sort_keys=True) for t in stored}
    points = []
    for params, candidate in space.enumerate():
        if json.dumps(candidate.to_dict(), sort_keys=True) not in done:
            points.append((params, candidate))
    bar = _Progress(len(points), progress, "plan (exhaustive)")
    worker = uuid.uuid4().hex[:12]
    new = 0
    try:
        for params, candidate in points:
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                break
            e = evaluator.evaluate(candidate)
            info = _trial_attr(e, f"{worker}-{new}")
            system = {"constraints:memory": info["memory_excess_gib"]} if _HAS_SET_CONSTRAINT else {}
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=_distributions(space, params), value=e.mean_s,
                user_attrs={ATTR: info}, system_attrs=system,
            ))
            new += 1
            bar.update(e)
            if on_trial:
                on_trial(e)
    finally:
        bar.close()
    return new


def _distributions(space: SearchSpace, params: dict) -> dict[str, CategoricalDistribution]:
    """The options of each parameter on the path to ``params`` (replayed through the tree)."""
    out = {}

    def choose(name, options):
        out[name] = CategoricalDistribution(list(options))
        return params[name]

    space.build(choose)
    return out


def _run_sampled(space, evaluator, study, stored, n_trials, timeout_s, start, seed, sampler_name, progress,
                 sync_every_s, on_trial, refine) -> int:
    """Sampler trials, and (``refine``) once half the budget is spent, hill-climbing: while the best
    point has neighbours (one choice changed) not yet tried, the next trial is one of them; when none
    is left the sampler proposes again, and a new best restarts the climb."""
    remaining = n_trials - len(stored)
    if remaining <= 0:
        return 0
    mirror = optuna.create_study(direction="minimize", sampler=_make_sampler(sampler_name, seed + len(stored)))
    known, tried = set(), set()
    best: tuple[float, dict] | None = None
    for t in stored:
        mirror.add_trial(t)
        known.add(_info(t).get("uid"))
        tried.add(Candidate.from_dict(_info(t)["candidate"]))
        if _info(t)["memory_excess_gib"] <= 0 and (best is None or t.value < best[0]):
            best = (t.value, t.params)
    explore_until = len(stored) + (remaining // 2 if refine else remaining)
    worker = uuid.uuid4().hex[:12]
    last_sync = time.perf_counter()
    queue: list[tuple[dict, Candidate]] = []
    bar = _Progress(remaining, progress, "plan")
    new = 0
    try:
        while new < remaining:
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                break
            if refine and best is not None and len(stored) + new >= explore_until:
                queue = [(p, c) for p, c in queue if c not in tried]
                if queue:
                    mirror.enqueue_trial(queue.pop(0)[0])
            trial = mirror.ask()
            params: dict = {}

            def choose(name, options):
                params[name] = trial.suggest_categorical(name, list(options))
                return params[name]

            candidate = space.build(choose)
            e = evaluator.evaluate(candidate)
            info = _trial_attr(e, f"{worker}-{new}")
            trial.set_user_attr(ATTR, info)
            if _HAS_SET_CONSTRAINT:
                trial.set_constraint("memory", info["memory_excess_gib"])
            study.add_trial(mirror.tell(trial, e.mean_s))
            known.add(info["uid"])
            tried.add(candidate)
            new += 1
            if e.fits and (best is None or e.mean_s < best[0]):
                best = (e.mean_s, params)
                queue = space.neighbors(params) if refine else []
            bar.update(e)
            if on_trial:
                on_trial(e)
            if time.perf_counter() - last_sync > sync_every_s:
                last_sync = time.perf_counter()
                for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                    uid = _info(t).get("uid")
                    if uid is not None and uid not in known:
                        mirror.add_trial(t)
                        known.add(uid)
                        tried.add(Candidate.from_dict(_info(t)["candidate"]))
                remaining = n_trials - len(known) + new  # other workers count toward the study's total
    finally:
        bar.close()
    return new
