"""Each export target's text of a plan, through :meth:`ExportTarget.export` (its refusals included), in
the form the export tests read it."""

from __future__ import annotations

import json
from pathlib import Path

from mpipe_tune.report.exports import TARGETS


def exported(target: str, plan, out: str | None = None) -> tuple[str, ...]:
    """The texts of ``plan``'s files in ``target`` (``out``: the path ``--out`` gives)."""
    return tuple(o.text for o in TARGETS[target].export(plan, Path(out) if out else None))


def to_torch_csv(plan) -> str:
    return exported("torch-csv", plan)[0]


def to_megatron(plan) -> str:
    return exported("megatron", plan)[0]


def to_hyper_parallel(plan) -> str:
    return exported("hyper-parallel", plan)[0]


def to_torchtitan(plan, csv_path: str) -> str:
    """The TOML job config that names the CSV at ``csv_path``."""
    return exported("torchtitan", plan, str(Path(csv_path).with_suffix(".toml")))[0]


def to_torchtitan_args(plan, csv_path: str) -> str:
    """torchtitan 0.3's arguments that name the CSV at ``csv_path``."""
    return exported("torchtitan-0.3", plan, str(Path(csv_path).with_suffix(".args")))[0]


def mindspeed_layout(plan) -> dict:
    """The model.json keys."""
    return json.loads(exported("mindspeed-mm", plan, "model.json")[0])


def mindspeed_arguments(plan, model_json: str) -> str:
    """The launch arguments beside ``model_json``."""
    return exported("mindspeed-mm", plan, model_json)[1]
