"""``plan.json`` read back: a schema-versioned, static plan that the runtime executes and ``show`` re-predicts.

:mod:`mpipe_tune.report.plan_file` writes it; this module, below both ``report`` and ``runtime``,
reads it: :func:`read_plan` loads it into a typed :class:`PlanFile` (its inputs, and per plan a
:class:`PlanSection`: the :class:`~mpipe_tune.algebra.candidate.Candidate`, the workload, the stored
derivation and the prediction), :func:`load_plan` into the checked record those are views of.

Layout (schema_version 2)::

    {
      "schema": "mpipe-tune/plan", "schema_version": 2, "tool_version": "0.1.0",
      "inputs": {
        "model":    {"spec": "tiny-vit-llm", "name": "...", "frozen": ["encoder"], "hash": "<sha256>"},
        "profile":  {"spec": "ideal", "name": "ideal", "hash": "<sha256>"},
        "workload": {"name": "...", "hash": "<sha256>", "microbatches": [{"image_tokens": .., "text_tokens": .., "images": [..]}],
                     "draw": {"mix": "balanced", "seed": 0, "sequences_per_microbatch": 1}},
        "moe_imbalance": 1.0, "grad_reduce_dtype": "fp32", "overlap_dp_comm": true
      },
      "candidate": {"schedule": "transpose,1f1b", "cut": [9], "pp": 4, "tp": 1, "dp": 1, "ep": 1, "cp": 1,
                    "encoder_tp": 1, "microbatches": 8, "owner_policy": "round-robin",
                    "owners": [0, 1, 2, 3, 0, 1, 2, 3], "slabs": [[4, 4, 4, 4]], "recompute": false,
                    "zero_stage": 1, "sequence_parallel": false, "dtype": "bf16", "frozen": ["encoder"],
                    "label": ""},
      "placement": [...], "collectives": {...},
      "order": {"events": ["F1.0#0", ...], "edges": [[src, dst, "activation"], ...],
                "nodes": [[event index, ...] per rank]},
      "predicted": {"makespan_s": .., "ranks": [...], "durations_s": [seconds per event]},
      "baselines": {"megatron": {"candidate": .., "placement": .., "collectives": .., "order": ..,
                                 "predicted": .., "workload": {"name": .., "hash": .., "microbatches": [..]}}, ...},
      "alternatives": {"megatron@own": {...the same fields...}, ..., "current": {...}}
    }

A workload sampled from a named mix also records its ``draw`` (optional: absent for a workload file),
:class:`~mpipe_tune.inputs.workload.MixDraw`: what ``run`` draws each later step's microbatches from.
The top level is the search's winner (``best``); ``baselines`` (optional: ``plan`` writes it,
``predict``-made files lack it) holds each baseline planned beside it as a section of the same
fields, with its own workload (interleaving may take another microbatch count), at the same degrees.
``alternatives`` (optional) holds plans at layouts of their own, in the same sections: each
baseline at its own best layout (``megatron@own``, ...) and the user's current layout
(``current``); their degrees differ from the best plan's, their device count does not.
:func:`plan_names` lists the best and its baselines (what ``bench`` runs by default),
:func:`all_plan_names` every plan the file holds; :func:`select_plan` turns any of them into a
top-level record. The workloads' microbatches are
stored in full, so a plan runs and re-predicts without its source file. Loading validates the
schema and every section's event texts; :func:`load_plan` errors are one line. Version-1 files
(before the candidate had one stored form) load through :func:`upgrade_v1`.

:func:`validate_derivation` refuses a section whose stored placement, collectives or per-rank order
are not the ones ``derive`` gives for its candidate (an edited order would make the executor deadlock
or compute wrong gradients); ``show``, ``run`` and ``export`` check it before they print or start
anything. :func:`load_plan_model` and :func:`load_plan_profile` read the inputs a plan names and say
which file moved and how to point to it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.algebra.events import EdgeKind, parse_event
from mpipe_tune.algebra.placement import ByLayer
from mpipe_tune.algebra.plan import Plan
from mpipe_tune.algebra.schedule import parse_schedule
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_data_file
from mpipe_tune.inputs.dataset import draw_from_dict
from mpipe_tune.inputs.workload import Workload, parse_workload
from mpipe_tune.plan_check import damaged, validate_inputs, validate_search, validate_section_fields

SCHEMA = "mpipe-tune/plan"
SCHEMA_VERSION = 2
"""2: each section's ``candidate`` is :meth:`Candidate.to_dict` (its owner policy, label and frozen
blocks included) and how the trainer runs is an input (``inputs.moe_imbalance``, ``grad_reduce_dtype``,
``overlap_dp_comm``; the last two added without a version change, defaults when absent). Files of version 1
(the candidate without those fields, the imbalance in it) load through :func:`upgrade_v1`."""


SECTION_KEYS = ("candidate", "placement", "collectives", "order", "predicted")
"""The fields of one runnable plan; a baseline's section holds them and its own ``workload``."""
BEST = "best"
"""The name that selects the file's top-level plan (the search's winner)."""
ALTERNATIVES = "alternatives"
"""The field of the plans at layouts of their own (a baseline's own best, the current layout)."""


@dataclass(frozen=True)
class PlanSection:
    """One runnable plan of a file, typed: what the runtime, ``show`` and ``export`` read."""

    name: str
    """``best``, a baseline's name or an alternative's."""
    record: dict[str, Any] = field(repr=False)
    """The plan as a top-level record (:func:`select_plan`'s), with the file's inputs."""
    candidate: Candidate
    workload: Workload
    predicted_step_s: float
    durations_s: tuple[float, ...]
    """Predicted seconds per event, in the order's event order."""
    peak_bytes: tuple[float, ...]
    """Predicted peak memory of each pipeline rank."""

    @property
    def where(self) -> str:
        return "" if self.name == BEST else f", plan '{self.name}'"


@dataclass(frozen=True)
class PlanFile:
    """A loaded and checked plan file: its inputs and its plans by name."""

    path: str
    record: dict[str, Any] = field(repr=False)
    model_spec: str
    model_hash: str
    profile_spec: str
    profile_hash: str
    moe_imbalance: float
    search: dict[str, Any] | None = field(repr=False)

    @property
    def where(self) -> str:
        return f"plan file {self.path}"

    @property
    def names(self) -> tuple[str, ...]:
        return all_plan_names(self.record)

    def section(self, name: str | None = None) -> PlanSection:
        """The plan ``name`` (default: the best); an unknown name is one line listing the file's plans."""
        selected = select_plan(self.record, name, where=self.where)
        name = name or BEST
        where = self.where + ("" if name == BEST else f", plan '{name}'")
        return PlanSection(name=name, record=selected, candidate=stored_candidate(selected, where=where),
                           workload=workload_of(selected), predicted_step_s=float(selected["predicted"]["makespan_s"]),
                           durations_s=tuple(float(d) for d in selected["predicted"]["durations_s"]),
                           peak_bytes=tuple(float(r["memory"]["peak_bytes"]) for r in selected["predicted"]["ranks"]))


def read_plan(path: str | os.PathLike) -> PlanFile:
    """Load, upgrade and check a plan file into a :class:`PlanFile`."""
    record = load_plan(path)
    inputs = record["inputs"]
    return PlanFile(path=str(path), record=record, model_spec=inputs["model"]["spec"], model_hash=inputs["model"]["hash"],
                    profile_spec=inputs["profile"]["spec"], profile_hash=inputs["profile"]["hash"],
                    moe_imbalance=float(inputs["moe_imbalance"]), search=record.get("search"))


def plan_names(record: dict[str, Any]) -> tuple[str, ...]:
    """The best plan and the baselines at its degrees: ``best``, then its baselines in stored order."""
    return (BEST, *record.get("baselines", {}))


def all_plan_names(record: dict[str, Any]) -> tuple[str, ...]:
    """Every plan a file holds: :func:`plan_names`, then its alternatives in stored order."""
    return (*plan_names(record), *record.get(ALTERNATIVES, {}))


def select_plan(record: dict[str, Any], name: str | None = None, *, where: str = "the plan file") -> dict[str, Any]:
    """The plan ``name`` of a loaded file as a top-level record: the file itself for the best (None
    or ``"best"``), or a baseline's sections with the file's model and profile inputs and the
    baseline's own workload. ``where`` names the file in the error for an unknown name."""
    if name is None or name == BEST:
        return record
    sections = {**record.get("baselines", {}), **record.get(ALTERNATIVES, {})}
    if name not in sections:
        raise MpipeError(f"{where} holds no plan named {name!r}; it holds {', '.join(all_plan_names(record))}")
    section = sections[name]
    header = {k: record[k] for k in ("schema", "schema_version", "tool_version")}
    inputs = {**record["inputs"], "workload": section["workload"]}
    return {**header, "inputs": inputs, **{k: section[k] for k in SECTION_KEYS}}


def load_plan(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a plan file; returns its record with ``order.events`` still as text."""
    path = Path(path)
    record = load_data_file(path, "plan", as_json=True)
    where = f"plan file {path}"
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise MpipeError(f"{where} is not an mpipe-tune plan (field 'schema' must be '{SCHEMA}')")
    if record.get("schema_version") not in (1, SCHEMA_VERSION):
        raise MpipeError(f"{where} has schema_version {record.get('schema_version')!r}; this mpipe-tune reads "
                         f"versions 1 and {SCHEMA_VERSION}: re-create the plan with this version")
    if record["schema_version"] == 1:
        record = upgrade_v1(record)
    if not isinstance(record.get("tool_version"), str):
        raise MpipeError(f"{where}: field 'tool_version' is missing or malformed; the file is corrupt, re-create it")
    if not isinstance(record.get("inputs"), dict):
        raise MpipeError(f"{where}: field 'inputs' is missing or malformed; the file is corrupt, re-create it")
    validate_inputs(record["inputs"], where=where)
    _validate_section(record, record["inputs"].get("workload"), where, "")
    if "search" in record:
        validate_search(record["search"], where=where)
    baselines = record.get("baselines", {})
    if not isinstance(baselines, dict) or BEST in baselines:
        raise MpipeError(f"{where}: field 'baselines' is malformed; the file is corrupt, re-create it")
    for name, section in baselines.items():
        if not isinstance(section, dict):
            raise MpipeError(f"{where}: baseline '{name}' is malformed; the file is corrupt, re-create it")
        _validate_section(section, section.get("workload"), where, f"baseline '{name}': ")
    alternatives = record.get(ALTERNATIVES, {})
    if not isinstance(alternatives, dict) or {BEST, *baselines} & set(alternatives):
        raise MpipeError(f"{where}: field '{ALTERNATIVES}' is malformed; the file is corrupt, re-create it")
    for name, section in alternatives.items():
        if not isinstance(section, dict):
            raise MpipeError(f"{where}: plan '{name}' is malformed; the file is corrupt, re-create it")
        _validate_section(section, section.get("workload"), where, f"plan '{name}': ")
    return record


def upgrade_v1(record: dict[str, Any]) -> dict[str, Any]:
    """A version-1 record in version 2's fields: each candidate gains the owner policy it did not
    record (``null``), an empty label and the file's frozen blocks; the top-level
    candidate's MoE load imbalance moves to ``inputs``. Malformed parts are left for the validators."""
    record = json.loads(json.dumps(record))  # a copy: the caller's record stays as read
    inputs = record.get("inputs")
    model = inputs.get("model") if isinstance(inputs, dict) else None
    frozen = model.get("frozen", []) if isinstance(model, dict) else []
    sections = [("", record)] + [(name, s) for field in ("baselines", ALTERNATIVES)
                                 for name, s in (record.get(field) or {}).items()] \
        if all(isinstance(record.get(f, {}), dict) for f in ("baselines", ALTERNATIVES)) else [("", record)]
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
    if isinstance(inputs, dict):
        inputs.setdefault("moe_imbalance", 1.0)
    record["schema_version"] = SCHEMA_VERSION
    return record


def _validate_section(section: dict[str, Any], workload: Any, where: str, label: str) -> None:
    """One plan's fields, its order graph against its event list, and its stored workload."""
    for key in SECTION_KEYS:
        if not isinstance(section.get(key), (dict, list)):
            raise MpipeError(f"{where}: {label}field '{key}' is missing or malformed; the file is corrupt, re-create it")
    validate_section_fields(section, workload, where=f"{where}, {label[:-2]}" if label else where)
    order = section["order"]
    try:
        events = [parse_event(text) for text in order["events"]]
        num = len(events)
        for s, t, kind in order["edges"]:
            EdgeKind(kind)
            assert 0 <= s < num and 0 <= t < num
        nodes = order["nodes"]
        assert len(nodes) == section["candidate"]["pp"]
        assert all(0 <= i < num for rank_nodes in nodes for i in rank_nodes)
        assert len(section["predicted"]["durations_s"]) == num
        parse_workload({"microbatches": workload["microbatches"]}, where=where)
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        detail = str(exc) if isinstance(exc, MpipeError) else type(exc).__name__
        raise MpipeError(f"{where}: {label}the order section is corrupt ({detail}); re-create the plan") from None
    if "draw" in workload:
        draw_from_dict(workload["draw"], where=f"{where}, {label[:-2]}" if label else where)


def workload_of(record: dict[str, Any]) -> Workload:
    """The plan's stored microbatches as a Workload."""
    w = record["inputs"]["workload"]
    workload = parse_workload({"microbatches": w["microbatches"], "name": w["name"]}, where="plan file")
    if "draw" not in w:
        return workload
    return replace(workload, draw=draw_from_dict(w["draw"], where="plan file"))


def placement_record(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for p in plan.placement:
        entry: dict[str, Any] = {"region": p.region, "layers": list(p.layers), "layout": p.layout.value}
        if isinstance(p.owner, ByLayer):
            entry["slabs"] = [list(s) for s in p.owner.slabs]
        else:
            entry["owners"] = list(p.owner.owners)
        out.append(entry)
    return out


def derivation_record(plan: Plan) -> dict[str, Any]:
    return {
        "schedule": str(plan.schedule),
        "cut": list(plan.cut.boundaries),
        "pp": plan.num_ranks,
        "microbatches": plan.num_microbatches,
        "placement": placement_record(plan),
        "collectives": {
            "seams": [
                {"seam": [s.src_region, s.dst_region], "fwd": s.fwd.value, "bwd": s.bwd.value if s.bwd else None}
                for s in plan.collectives.seams
            ],
            "reduces": [{"region": j, "group": g.value} for j, g in plan.collectives.reduces],
        },
        "nodes": [[str(e) for e in plan.nodes(r)] for r in range(plan.num_ranks)],
        "num_events": len(plan.order.events),
        "num_edges": len(plan.order.edges),
    }


def stored_candidate(section: Mapping[str, Any], *, where: str) -> Candidate:
    """The candidate of a section :func:`load_plan` has checked."""
    try:
        parse_schedule(section["candidate"]["schedule"])
    except MpipeError as exc:
        raise damaged(where, f"candidate field 'schedule': {exc}") from None
    return Candidate.from_dict(section["candidate"])


def derive_stored(section: Mapping[str, Any], model, *, where: str) -> Plan:
    """``derive`` of a checked section's candidate on ``model``; a candidate it refuses is one line naming the file."""
    try:
        return stored_candidate(section, where=where).derive(model)
    except MpipeError as exc:
        raise damaged(where, f"its stored candidate does not derive ({exc})") from None


def validate_derivation(record: Mapping[str, Any], plan: Plan, *, where: str) -> None:
    """The stored placement, collectives, events, per-rank order and edges must be exactly ``derive``'s
    (``plan``) for the stored candidate."""
    derived = derivation_record(plan)
    for key in ("placement", "collectives"):
        if record[key] != derived[key]:
            raise damaged(where, f"its stored {key} differs from what derive gives for its candidate")
    order = record["order"]
    events = [str(e) for e in plan.order.events]
    if order["events"] != events:
        first = next((i for i, (a, b) in enumerate(zip(order["events"], events)) if a != b), min(len(events), len(order["events"])))
        raise damaged(where, f"its stored events differ from what derive gives for its candidate ({len(order['events'])} "
                           f"stored, {len(events)} derived; first difference at event {first})")
    derived_nodes = [list(nodes) for nodes in plan.order.nodes]
    for rank, (stored, derived) in enumerate(zip(order["nodes"], derived_nodes)):
        if stored != derived:
            step = next((k for k, (a, b) in enumerate(zip(stored, derived)) if a != b), min(len(stored), len(derived)))
            got = events[stored[step]] if step < len(stored) else "nothing"
            want = events[derived[step]] if step < len(derived) else "nothing"
            raise damaged(where, f"rank {rank}'s stored order differs from derive's for its candidate: step {step} runs "
                               f"{got} where derive runs {want}")
    edges = [[s, t, kind.value] for s, t, kind in plan.order.edges]
    if [list(e) for e in order["edges"]] != edges:
        raise damaged(where, "its stored dependency edges differ from what derive gives for its candidate")


def _moved(where: str, what: str, spec: str, flag: str) -> MpipeError | None:
    """A one-line error when ``spec`` names a file that is not there any more, else None."""
    path = Path(spec)
    if (path.is_absolute() or "/" in spec) and not path.exists():
        return MpipeError(f"{where}: its {what} file {spec} is not there any more (moved or deleted); point to it "
                          f"with {flag} PATH")
    return None


def load_plan_model(record: Mapping[str, Any], *, where: str, spec: str | None = None):
    """The plan's model (from ``spec`` when given: the same model, moved), with its frozen blocks."""
    from mpipe_tune.specs import load_model

    inputs = record["inputs"]["model"]
    spec = spec or inputs["spec"]
    error = _moved(where, "model", spec, "--model")
    if error is not None:
        raise error
    model = load_model(spec)
    frozen = tuple(inputs.get("frozen") or ())
    return model.with_frozen(frozen) if frozen else model


def load_plan_profile(record: Mapping[str, Any], *, where: str, spec: str | None = None):
    """The plan's hardware profile (from ``spec`` when given: the same profile, moved)."""
    from mpipe_tune.specs import load_profile

    spec = spec or record["inputs"]["profile"]["spec"]
    error = _moved(where, "profile", spec, "--profile")
    if error is not None:
        raise error
    return load_profile(spec)
