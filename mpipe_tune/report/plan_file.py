"""``plan.json``: a schema-versioned, static plan that the runtime executes and ``show`` re-predicts.

Layout (schema_version 1)::

    {
      "schema": "mpipe-tune/plan", "schema_version": 1, "tool_version": "0.1.0",
      "inputs": {
        "model":    {"spec": "tiny-vit-llm", "name": "...", "frozen": ["encoder"], "hash": "<sha256>"},
        "profile":  {"spec": "ideal", "name": "ideal", "hash": "<sha256>"},
        "workload": {"name": "...", "hash": "<sha256>", "microbatches": [{"image_tokens": .., "text_tokens": .., "images": [..]}]}
      },
      "candidate": {"schedule": "transpose,1f1b", "cut": [9], "pp": 4, "tp": 1, "dp": 1, "dtype": "bf16",
                    "recompute": false, "microbatches": 8, "slabs": [[4, 4, 4, 4]], "owners": [0, 1, 2, 3, 0, 1, 2, 3]},
      "placement": [...], "collectives": {...},
      "order": {"events": ["F1.0#0", ...], "edges": [[src, dst, "activation"], ...],
                "nodes": [[event index, ...] per rank]},
      "predicted": {"makespan_s": .., "ranks": [...], "durations_s": [seconds per event]},
      "baselines": {"megatron": {"candidate": .., "placement": .., "collectives": .., "order": ..,
                                 "predicted": .., "workload": {"name": .., "hash": .., "microbatches": [..]}}, ...},
      "alternatives": {"megatron@own": {...the same fields...}, ..., "current": {...}}
    }

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
schema and every section's event texts; :func:`load_plan` errors are one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune import __version__
from mpipe_tune.algebra.events import EdgeKind, parse_event
from mpipe_tune.inputs.workload import Workload, parse_workload, workload_hash, workload_to_dict
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_data_file
from mpipe_tune.files import write_atomic
from mpipe_tune.report.plan_check import validate_inputs, validate_search, validate_section_fields
from mpipe_tune.report.tables import derivation_record, prediction_record

SCHEMA = "mpipe-tune/plan"
SCHEMA_VERSION = 2
"""2: each section's ``candidate`` is :meth:`Candidate.to_dict` (its owner policy, label and frozen
blocks included) and the MoE load imbalance is an input (``inputs.moe_imbalance``). Files of version 1
(the candidate without those fields, the imbalance in it) load through :func:`upgrade_v1`."""


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made from: enough to re-derive and re-predict it."""

    model_spec: str
    frozen: tuple[str, ...]
    profile_spec: str


SECTION_KEYS = ("candidate", "placement", "collectives", "order", "predicted")
"""The fields of one runnable plan; a baseline's section holds them and its own ``workload``."""
BEST = "best"
"""The name that selects the file's top-level plan (the search's winner)."""
ALTERNATIVES = "alternatives"
"""The field of the plans at layouts of their own (a baseline's own best, the current layout)."""


def plan_section(prediction, model, workload: Workload, profile) -> dict[str, Any]:
    """One runnable plan: candidate (:meth:`Candidate.to_dict`, its slabs and owner map explicit),
    placement, collectives, order, predicted, and the workload it was predicted on.
    :func:`plan_record` builds the file's top-level plan and every baseline with it."""
    plan = prediction.plan
    derivation = derivation_record(plan)
    return {
        "candidate": prediction.candidate.to_dict(),
        "placement": derivation["placement"],
        "collectives": derivation["collectives"],
        "order": {
            "events": [str(e) for e in plan.order.events],
            "edges": [[s, t, kind.value] for s, t, kind in plan.order.edges],
            "nodes": [list(nodes) for nodes in plan.order.nodes],
        },
        "predicted": {
            **{k: v for k, v in prediction_record(prediction, model, workload, profile).items()
               if k in ("makespan_s", "bubble_share", "ranks")},
            "durations_s": [float(d) for d in prediction.timeline.durations_s],
        },
        "workload": {"name": workload.name, "hash": workload_hash(workload),
                     "microbatches": workload_to_dict(workload)["microbatches"]},
    }


def plan_record(prediction, model, workload: Workload, profile, inputs: PlanInputs, *,
                baselines: Mapping[str, dict[str, Any]] | None = None,
                alternatives: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole file: the best plan at the top level, and ``baselines`` and ``alternatives``
    (name -> a section built by :func:`plan_section`) beside it when given. Every section's
    candidate names the file's frozen blocks (``inputs.frozen``: one model per file)."""
    section = plan_section(prediction, model, workload, profile)
    stored_workload = section.pop("workload")
    record = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "inputs": {
            "model": {"spec": inputs.model_spec, "name": model.name, "frozen": list(inputs.frozen),
                      "hash": model.content_hash()},
            "profile": {"spec": inputs.profile_spec, "name": profile.name, "hash": profile.content_hash()},
            "workload": stored_workload,
            "moe_imbalance": prediction.options.moe_imbalance,
        },
        **section,
    }
    if baselines is not None:
        assert BEST not in baselines, f"a baseline may not be called {BEST!r}"
        record["baselines"] = dict(baselines)
    if alternatives:
        assert BEST not in alternatives and not set(alternatives) & set(baselines or {}), "plan names must differ"
        record[ALTERNATIVES] = dict(alternatives)
    for section in (record, *record.get("baselines", {}).values(), *record.get(ALTERNATIVES, {}).values()):
        section["candidate"]["frozen"] = list(inputs.frozen)
    return record


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


def dump_plan(record: dict[str, Any], path: str | os.PathLike) -> None:
    """Write atomically: a crash leaves the old file or the new one, never half of one."""
    write_atomic(path, json.dumps(record, indent=1) + "\n")


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


def workload_of(record: dict[str, Any]) -> Workload:
    """The plan's stored microbatches as a Workload."""
    w = record["inputs"]["workload"]
    return parse_workload({"microbatches": w["microbatches"], "name": w["name"]}, where="plan file")
