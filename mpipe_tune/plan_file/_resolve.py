"""One plan of a plan file, ready to use: :func:`resolve` (what ``show``, ``run``, ``bench`` and ``export`` call).

Resolving loads the file (or takes a loaded one), picks the plan by name, loads the model (and the
profile, when asked) the file names or the caller points to, checks each input against the hash the
file stores (:func:`validate_input`), derives the plan's candidate on the model and checks the
stored placement, collectives and order against that derivation. Every failure is one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.algebra import Model, Plan
from mpipe_tune.errors import MpipeError, PlanFileError
from mpipe_tune.inputs import workload_hash
from mpipe_tune.plan_file._check import damaged
from mpipe_tune.plan_file._derivation import validate_derivation
from mpipe_tune.plan_file._read import PlanFile, read_plan
from mpipe_tune.plan_file._schema import Section


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan of a file, its inputs checked and its stored order ``derive``'s."""

    file: PlanFile
    section: Section
    model: Model
    """The plan's model, its file's frozen blocks frozen, checked against the file's hash."""
    plan: Plan
    """``derive`` of the section's candidate on :attr:`model`: the stored order was checked against it."""
    profile: Any = None
    """The plan's hardware profile, checked against the file's hash (``None`` unless asked for)."""

    @property
    def where(self) -> str:
        return self.file.where + self.section.where


def resolve(source: str | os.PathLike | PlanFile, name: str | None = None, *, model: Model | str | None = None,
            profile: Any = None, predicting: bool = False) -> ResolvedPlan:
    """The plan ``name`` (default: the best) of ``source`` (a path or a loaded file), resolved.

    ``model`` is the plan's model (a loaded one, or the spec of where its file moved to; default:
    the spec the file names); ``profile`` the plan's profile (a loaded one, or the spec of where its
file moved to). ``predicting``
    (for a caller that re-predicts the stored step) loads the profile and checks the stored
    workload too. Each input must be the one the plan was made for (its content hash)."""
    file = source if isinstance(source, PlanFile) else read_plan(source)
    section = file.section(name)
    if not isinstance(model, Model):
        model = load_plan_model(file, spec=model)
    validate_input(file, "model", model.content_hash(), model.name)
    loaded = None
    if predicting and (profile is None or isinstance(profile, str)):
        loaded = load_plan_profile(file, spec=profile)
    elif predicting:
        loaded = profile
        validate_input(file, "profile", profile.content_hash(), profile.name)
    where = file.where + section.where
    if predicting:
        workload = section.workload
        validate_input(file, "workload", workload_hash(workload), workload.name, stored=section.stored_workload.hash,
                       where=where)
    try:
        plan = section.candidate.derive(model)
    except MpipeError as exc:
        raise damaged(where, f"its stored candidate does not predict (derive refuses it: {exc})") from None
    validate_derivation(section, plan, where=where)
    return ResolvedPlan(file, section, model, plan, loaded)


def validate_input(file: PlanFile, what: str, content_hash: str, name: str, *, stored: str | None = None,
                   where: str | None = None) -> None:
    """``what`` (the ``model``, ``profile`` or ``workload``, named ``name``) must hash as the file stores
    (``stored``: a section's own workload hash); one line naming both sides otherwise."""
    made_for = getattr(file.inputs, what, None)
    stored = stored if stored is not None else made_for.hash
    if content_hash == stored:
        return
    then = f"{what} '{made_for.name}'" if made_for is not None else f"its stored {what}"
    raise PlanFileError(f"{where or file.where} was made for {then}, but the {what} '{name}' has changed since or is "
                        f"another one (content hash mismatch: {content_hash[:12]} now, {stored[:12]} in the plan); "
                        f"point to the plan's own {what}, or re-plan with 'mpipe-tune plan'")


def _moved(file: PlanFile, what: str, spec: str) -> None:
    """A one-line error when ``spec`` names a file that is not there any more (``what``: the quantity)."""
    path = Path(spec)
    if (path.is_absolute() or "/" in spec) and not path.exists():
        raise PlanFileError(f"{file.where}: its {what} file {spec} is not there any more (moved or deleted); "
                            f"give its new path", quantities=(what,))


def load_plan_model(file: PlanFile, *, spec: str | None = None) -> Model:
    """The plan's model (from ``spec`` when given: the same model, moved), with its frozen blocks."""
    from mpipe_tune.inputs import load_model

    spec = spec or file.inputs.model.spec
    _moved(file, "model", spec)
    model = load_model(spec)
    frozen = file.inputs.model.frozen
    return model.with_frozen(frozen) if frozen else model


def load_plan_profile(file: PlanFile, *, spec: str | None = None):
    """The plan's hardware profile (from ``spec`` when given: the same profile, moved), checked
    against the hash the file stores."""
    from mpipe_tune.cost import load_profile

    spec = spec or file.inputs.profile.spec
    _moved(file, "hardware profile", spec)
    profile = load_profile(spec)
    validate_input(file, "profile", profile.content_hash(), spec)
    return profile
