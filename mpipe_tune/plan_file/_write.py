"""Writing ``plan.json`` (:mod:`mpipe_tune.plan_file` describes the schema; :mod:`._read` reads it back).

:func:`plan_record` builds the whole file from the best plan's prediction and a section per baseline
and alternative (:func:`plan_section`); :func:`dump_plan` writes it atomically. A prediction is read
by its fields (``plan``, ``timeline``, ``memory``, ``candidate``, ``options``): the plan file sits
below the cost model and imports none of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpipe_tune import __version__
from mpipe_tune.outputs import write_atomic
from mpipe_tune.inputs import Workload, workload_hash, workload_to_dict
from mpipe_tune.plan_file._derivation import collectives_record, order_record, placement_record
from mpipe_tune.plan_file._read import ALTERNATIVES, SCHEMA, SCHEMA_VERSION
from mpipe_tune.plan_file._schema import BEST


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made from: enough to re-derive and re-predict it."""

    model_spec: str
    frozen: tuple[str, ...]
    profile_spec: str


def predicted_record(prediction) -> dict[str, Any]:
    """A prediction's step time, bubble share and per-rank figures (times and memory), as stored and
    as ``predict --json`` prints them."""
    t, mem, num_ranks = prediction.timeline, prediction.memory, prediction.plan.num_ranks
    return {
        "makespan_s": t.makespan_s,
        "bubble_share": sum(t.bubble_s) / (t.makespan_s * num_ranks) if t.makespan_s > 0 else 0.0,
        "ranks": [
            {"rank": r, "busy_s": t.busy_s[r], "bubble_s": t.bubble_s[r], "spill_s": t.spill_s[r],
             "encoder_s": t.encoder_s[r], "warmup_slack_s": t.warmup_slack_s[r],
             "memory": {"static_bytes": mem.static_bytes[r], "activation_peak_bytes": mem.activation_peak_bytes[r],
                        "peak_bytes": mem.peak_bytes[r], "over_capacity": mem.over_capacity[r]}}
            for r in range(num_ranks)
        ],
    }


def plan_section(prediction, workload: Workload) -> dict[str, Any]:
    """One runnable plan: candidate (:meth:`Candidate.to_dict`, its slabs and owner map explicit),
    placement, collectives, order, predicted, and the workload it was predicted on.
    :func:`plan_record` builds the file's top-level plan and every baseline with it."""
    plan = prediction.plan
    return {
        "candidate": prediction.candidate.to_dict(),
        "placement": placement_record(plan),
        "collectives": collectives_record(plan),
        "order": order_record(plan),
        "predicted": {**predicted_record(prediction),
                      "durations_s": [float(d) for d in prediction.timeline.charged_s()]},
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
    section = plan_section(prediction, workload)
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
