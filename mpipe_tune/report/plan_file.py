"""Writing ``plan.json`` (:mod:`mpipe_tune.plan_file` describes the schema and reads it back).

:func:`plan_record` builds the whole file from the best plan's prediction and a section per baseline
and alternative (:func:`plan_section`); :func:`dump_plan` writes it atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpipe_tune import __version__
from mpipe_tune.files import write_atomic
from mpipe_tune.inputs.workload import Workload, workload_hash, workload_to_dict
from mpipe_tune.plan_file import ALTERNATIVES, BEST, SCHEMA, SCHEMA_VERSION, derivation_record
from mpipe_tune.report.tables import prediction_record


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made from: enough to re-derive and re-predict it."""

    model_spec: str
    frozen: tuple[str, ...]
    profile_spec: str


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
                     "microbatches": workload_to_dict(workload)["microbatches"],
                     **({"draw": workload.draw.to_dict()} if workload.draw is not None else {})},
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
            **prediction.options.framework(),
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


def dump_plan(record: dict[str, Any], path: str | os.PathLike) -> None:
    """Write atomically: a crash leaves the old file or the new one, never half of one."""
    write_atomic(path, json.dumps(record, indent=1) + "\n")
