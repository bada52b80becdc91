"""``plan.json``: a schema-versioned, static plan that the runtime executes and ``show`` re-predicts.

This package is the one owner of the file, below ``report`` and ``runtime``:

- :mod:`._schema`: the typed, frozen records (:class:`PlanFile`, a :class:`Section` per plan: the
  :class:`~mpipe_tune.algebra._candidate.Candidate`, placement, collectives, order, prediction and
  workload; the search summary), none with a ``dict`` field; :mod:`._check` reads them from JSON,
  checking every field by its type and range.
- :mod:`._names`: the names that mark stored plans (``best``, the baselines, ``@own``, ``current``).
- :mod:`._read`: :func:`read_plan` loads, upgrades (version 1) and checks a file into a
  :class:`PlanFile`; :func:`load_plan` gives the same file's checked record in its stored form.
- :mod:`._write`: :func:`plan_record` and :func:`dump_plan` (atomic).
- :mod:`._resolve`: :func:`resolve`, what ``show``, ``run``, ``bench`` and ``export`` call: a plan
  picked by name, its model (and profile) loaded and checked against the file's hashes, its
  candidate derived and the stored order checked against the derivation (:mod:`._derivation`).

Layout (schema_version 3)::

    {
      "schema": "mpipe-tune/plan", "schema_version": 3, "tool_version": "0.1.0",
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
                    "zero_stage": 1, "reshard_after_forward": null, "sequence_parallel": false, "dtype": "bf16", "frozen": ["encoder"],
                    "label": ""},
      "placement": [...], "collectives": {...},
      "order": {"events": ["F1.0#0", ...], "edges": [[src, dst, "activation"], ...],
                "nodes": [[event index, ...] per rank]},
      "predicted": {"makespan_s": .., "ranks": [...], "durations_s": [seconds per event, its sharding actions in it]},
      "baselines": {"megatron": {"candidate": .., "placement": .., "collectives": .., "order": ..,
                                 "predicted": .., "workload": {"name": .., "hash": .., "microbatches": [..]}}, ...},
      "alternatives": {"megatron@own": {...the same fields...}, ..., "current": {...}}
    }

A workload sampled from a named mix also records its ``draw`` (optional: absent for a workload file),
:class:`~mpipe_tune.inputs._workload.MixDraw`: what ``run`` draws each later step's microbatches from.
The top level is the search's winner (``best``); ``baselines`` (optional: ``plan`` writes it,
``predict``-made files lack it) holds each baseline planned beside it as a section of the same
fields, with its own workload (interleaving may take another microbatch count), at the same degrees.
``alternatives`` (optional) holds plans at layouts of their own, in the same sections: each
baseline at its own best layout (``megatron@own``, ...) and the user's current layout
(``current``); their degrees differ from the best plan's, their device count does not.
:attr:`PlanFile.plan_names` lists the best and its baselines (what ``bench`` runs by default),
:attr:`PlanFile.names` every plan the file holds; :func:`select_plan` turns any of them into a
top-level record. The workloads' microbatches are
stored in full, so a plan runs and re-predicts without its source file. Loading checks every field
and every section's event texts; its errors are one line (:class:`~mpipe_tune.errors.PlanFileError`).
Version-1 files (before the candidate had one stored form) load through :func:`upgrade_v1`, version-2 files
(before ZeRO-3's reshard policy) through :func:`upgrade_v2`.
"""

from __future__ import annotations

from mpipe_tune.plan_file._check import damaged
from mpipe_tune.plan_file._derivation import derivation_record, placement_record, validate_derivation
from mpipe_tune.plan_file._read import (
    ALTERNATIVES, SCHEMA, SCHEMA_VERSION, PlanFile, all_plan_names, load_plan, plan_names, read_plan, select_plan,
    upgrade_v1, upgrade_v2,
)
from mpipe_tune.plan_file._resolve import ResolvedPlan, load_plan_model, load_plan_profile, resolve, validate_input
from mpipe_tune.plan_file._names import BASELINES, BEST, CURRENT, MPIPE_RR, OWN, REFERENCE
from mpipe_tune.plan_file._schema import Inputs, SearchSummary, Section
from mpipe_tune.plan_file._write import PlanInputs, dump_plan, plan_record, plan_section, predicted_record

SECTION_KEYS = Section.FIELDS

__all__ = [
    "ALTERNATIVES", "BASELINES", "BEST", "CURRENT", "MPIPE_RR", "OWN", "REFERENCE", "SCHEMA", "SCHEMA_VERSION", "SECTION_KEYS", "Inputs", "PlanFile", "PlanInputs",
    "ResolvedPlan", "SearchSummary", "Section", "all_plan_names", "damaged", "derivation_record", "dump_plan", "load_plan",
    "load_plan_model", "load_plan_profile", "placement_record", "plan_names", "plan_record", "plan_section",
    "predicted_record", "read_plan", "resolve", "select_plan", "upgrade_v1", "upgrade_v2", "validate_derivation", "validate_input",
]
