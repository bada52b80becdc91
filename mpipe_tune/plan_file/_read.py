"""Reading plan.json: :func:`read_plan` into a typed :class:`PlanFile`, older schema versions upgraded.

:func:`load_plan` gives the checked record in its stored (JSON) form, upgraded to the current
version, and :func:`select_plan` one of its plans as a top-level record of that form: what a
writer that copies a plan into a file of its own needs. Readers use :class:`PlanFile`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.errors import PlanFileError
from mpipe_tune.inputs import load_data_file
from mpipe_tune.plan_file._check import damaged, read_record, read_value
from mpipe_tune.plan_file._schema import BEST, Inputs, SearchSummary, Section

SCHEMA = "mpipe-tune/plan"
SCHEMA_VERSION = 3
"""3: a candidate's ``reshard_after_forward`` (ZeRO-3's reshard policy; null: the default for its pipeline
degree, which keeps the weights through the step under pipeline parallelism). Version-2 files, whose
stage-3 plans gathered the weights for every microbatch, load through :func:`upgrade_v2`, their stage-3
candidates set to reshard. 2: each section's ``candidate`` is :meth:`Candidate.to_dict` (its owner policy, label and frozen
blocks included) and how the trainer runs is an input (``inputs.moe_imbalance``, ``grad_reduce_dtype``,
``overlap_dp_comm``; the last two added without a version change, defaults when absent). Files of version 1
(the candidate without those fields, the imbalance in it) load through :func:`upgrade_v1`."""
ALTERNATIVES = "alternatives"
"""The field of the plans at layouts of their own (a baseline's own best, the current layout)."""


@dataclass(frozen=True)
class PlanFile:
    """A loaded and checked plan file: its inputs, its plans by name, and the search that made it."""

    path: str
    tool_version: str
    inputs: Inputs
    best: Section
    baselines: tuple[Section, ...]
    """The baselines planned at the best plan's degrees, in stored order (what ``bench`` runs by default)."""
    alternatives: tuple[Section, ...]
    """Plans at layouts of their own: each baseline at its own best layout (``megatron@own``) and the
    user's current layout (``current``)."""
    search: SearchSummary | None
    """``None`` for a file ``predict`` made."""

    @property
    def where(self) -> str:
        return f"plan file {self.path}"

    @property
    def plan_names(self) -> tuple[str, ...]:
        """The best plan and the baselines at its degrees."""
        return (BEST, *(s.name for s in self.baselines))

    @property
    def names(self) -> tuple[str, ...]:
        """Every plan the file holds: :attr:`plan_names`, then its alternatives."""
        return (*self.plan_names, *(s.name for s in self.alternatives))

    def section(self, name: str | None = None) -> Section:
        """The plan ``name`` (default: the best); an unknown name is one line listing the file's plans."""
        if name is None or name == BEST:
            return self.best
        for section in (*self.baselines, *self.alternatives):
            if section.name == name:
                return section
        raise PlanFileError(f"{self.where} holds no plan named {name!r}; it holds {', '.join(self.names)}")

    @classmethod
    def from_dict(cls, record: Any, *, path: str) -> PlanFile:
        """A file's record (upgraded to :data:`SCHEMA_VERSION`) read and checked: one-line
        :class:`PlanFileError` naming the field when it is damaged."""
        where = f"plan file {path}"
        if not isinstance(record.get("tool_version"), str):
            raise damaged(where, "field 'tool_version' is missing or malformed")
        inputs = record.get("inputs")
        if not isinstance(inputs, dict):
            raise damaged(where, "field 'inputs' is missing or malformed")
        for what in ("model", "profile"):
            entry = inputs.get(what)
            if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("spec", "name", "hash")):
                raise damaged(where, f"field 'inputs.{what}' must hold its 'spec', 'name' and 'hash' as text")
        typed = read_record(Inputs, inputs, where=f"{where} inputs", path="")
        best = Section.read(BEST, record, inputs.get("workload"), where=where, label="")
        groups = []
        for field, kind, taken in (("baselines", "baseline", {BEST}), (ALTERNATIVES, "plan", None)):
            stored = record.get(field, {})
            taken = taken if taken is not None else {BEST, *(s.name for s in groups[0])}
            if not isinstance(stored, dict) or taken & set(stored):
                raise damaged(where, f"field '{field}' is malformed")
            sections = []
            for name, section in stored.items():
                if not isinstance(section, dict):
                    raise damaged(where, f"{kind} '{name}' is malformed")
                sections.append(Section.read(name, section, section.get("workload"), where=where,
                                             label=f"{kind} '{name}': "))
            groups.append(tuple(sections))
        search = read_value(SearchSummary, record["search"], where=where, path="search") if "search" in record else None
        return cls(str(path), record["tool_version"], typed, best, groups[0], groups[1], search)


def load_plan(path: str | os.PathLike) -> dict[str, Any]:
    """Read, upgrade and check a plan file; its record in the stored form (see the module's docstring)."""
    record, _ = _load(path)
    return record


def read_plan(path: str | os.PathLike) -> PlanFile:
    """Read, upgrade and check a plan file into a :class:`PlanFile`."""
    _, file = _load(path)
    return file


def _load(path: str | os.PathLike) -> tuple[dict[str, Any], PlanFile]:
    path = Path(path)
    record = load_data_file(path, "plan", as_json=True)
    where = f"plan file {path}"
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise PlanFileError(f"{where} is not an mpipe-tune plan (field 'schema' must be '{SCHEMA}')")
    if record.get("schema_version") not in (1, 2, SCHEMA_VERSION) or isinstance(record.get("schema_version"), bool):
        raise PlanFileError(f"{where} has schema_version {record.get('schema_version')!r}; this mpipe-tune reads "
                            f"versions 1 to {SCHEMA_VERSION}: re-create the plan with this version")
    if record["schema_version"] == 1:
        record = upgrade_v1(record)
    if record["schema_version"] == 2:
        record = upgrade_v2(record)
    return record, PlanFile.from_dict(record, path=str(path))


def upgrade_v1(record: dict[str, Any]) -> dict[str, Any]:
    """A version-1 record in version 2's fields: each candidate gains the owner policy it did not
    record (``null``), an empty label and the file's frozen blocks; the top-level
    candidate's MoE load imbalance moves to ``inputs``; the search summary's candidate gets its
    slabs' and owners' stored names and the default dtype. Malformed parts are left for the checks."""
    record = json.loads(json.dumps(record))  # a copy: the caller's record stays as read
    inputs = record.get("inputs")
    model = inputs.get("model") if isinstance(inputs, dict) else None
    frozen = model.get("frozen", []) if isinstance(model, dict) else []
    sections = [("", record)]
    if all(isinstance(record.get(f, {}), dict) for f in ("baselines", ALTERNATIVES)):
        sections += [(name, s) for field in ("baselines", ALTERNATIVES) for name, s in (record.get(field) or {}).items()]
    for name, section in sections:
        c = section.get("candidate") if isinstance(section, dict) else None
        if not isinstance(c, dict):
            continue
        imbalance = c.pop("moe_imbalance", 1.0)
        if not name and isinstance(inputs, dict):
            inputs["moe_imbalance"] = imbalance
        c.setdefault("owner_policy", None)
        c.setdefault("label", "")
        c.setdefault("frozen", frozen)
    searched = record.get("search", {}).get("candidate") if isinstance(record.get("search"), dict) else None
    if isinstance(searched, dict):  # the summary's candidate, in the trial records' old names
        if "slab_counts" in searched:
            searched["slabs"] = searched.pop("slab_counts")
        for key, value in (("owners", None), ("dtype", "bf16"), ("frozen", frozen)):
            searched.setdefault(key, value)
    if isinstance(inputs, dict):
        inputs.setdefault("moe_imbalance", 1.0)
    record["schema_version"] = 2
    return record


def upgrade_v2(record: dict[str, Any]) -> dict[str, Any]:
    """A version-2 record in version 3's fields: each stage-3 candidate (the sections' and the search
    summary's) gains ``reshard_after_forward: true``, what version 2 ran and predicted (every microbatch
    gathers the weights); the others null. Malformed parts are left for the checks."""
    record = json.loads(json.dumps(record))
    sections = [record] + [s for field in ("baselines", ALTERNATIVES) if isinstance(record.get(field), dict)
                           for s in record[field].values()]
    search = record.get("search")
    candidates = [s.get("candidate") for s in sections if isinstance(s, dict)]
    candidates += [search.get("candidate")] if isinstance(search, dict) else []
    for c in candidates:
        if isinstance(c, dict) and "reshard_after_forward" not in c:
            c["reshard_after_forward"] = True if c.get("zero_stage") == 3 else None
    record["schema_version"] = SCHEMA_VERSION
    return record


def plan_names(record: dict[str, Any]) -> tuple[str, ...]:
    """A stored record's best plan and the baselines at its degrees."""
    return (BEST, *record.get("baselines", {}))


def all_plan_names(record: dict[str, Any]) -> tuple[str, ...]:
    """Every plan a stored record holds: :func:`plan_names`, then its alternatives in stored order."""
    return (*plan_names(record), *record.get(ALTERNATIVES, {}))


def select_plan(record: dict[str, Any], name: str | None = None, *, where: str = "the plan file") -> dict[str, Any]:
    """The plan ``name`` of a stored record as a top-level record: the record itself for the best (None
    or ``"best"``), or a baseline's or alternative's fields with the file's inputs and its own workload."""
    if name is None or name == BEST:
        return record
    sections = {**record.get("baselines", {}), **record.get(ALTERNATIVES, {})}
    if name not in sections:
        raise PlanFileError(f"{where} holds no plan named {name!r}; it holds {', '.join(all_plan_names(record))}")
    section = sections[name]
    header = {k: record[k] for k in ("schema", "schema_version", "tool_version")}
    inputs = {**record["inputs"], "workload": section["workload"]}
    return {**header, "inputs": inputs, **{k: section[k] for k in Section.FIELDS}}
