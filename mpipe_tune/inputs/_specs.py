"""Resolving the CLI's SPEC arguments: a built-in name or a file path, loaded and validated once.

``load_model`` reads a YAML model file (or a built-in from ``models/``), or a Hugging Face config.json (or a
folder holding one, through :mod:`mpipe_tune.inputs._hf_config`), expands ``compose``, and checks architecture
dimensions (:func:`~mpipe_tune.inputs._arch_dims.validate_arch`), so a bad file fails here with one line.
Hardware profiles are the cost model's: :func:`mpipe_tune.cost.load_profile` loads them.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mpipe_tune.algebra import ArchCost, Model, parse_model
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_data_file
from mpipe_tune.inputs._arch_dims import validate_arch
from mpipe_tune.inputs._hf_config import from_hf_config, is_hf_config
from mpipe_tune.inputs._workload import load_workload

__all__ = ["builtin_models", "load_model", "load_workload", "resolve_spec"]


def _models_dir() -> Path:
    try:
        return Path(str(resources.files("mpipe_tune.models")))
    except ModuleNotFoundError:  # a source checkout on the path without an editable install: models/ beside it
        return Path(__file__).resolve().parents[2] / "models"


def builtin_models() -> list[str]:
    return sorted(p.stem for p in _models_dir().glob("*.yaml"))


def _read_yaml(path: Path) -> Any:
    return load_data_file(path, "model", as_json=False)


def _resolve(name: str) -> Any:
    """The parsed data of model ``name``: a YAML file, a Hugging Face config, or a built-in. A file's own
    relative ``compose`` entries are made absolute here (against its folder), so that they resolve there
    however deep it is composed; the top-level spec is relative to the working folder."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return _absolute_composes(_read_yaml(path), path.resolve().parent)
    if is_hf_config(path):
        return from_hf_config(path)
    builtin = _models_dir() / f"{name}.yaml"
    if builtin.exists():
        return _read_yaml(builtin)
    if path.is_dir():
        raise MpipeError(f"model folder {path} holds no config.json; give a Hugging Face model folder, "
                         f"a config.json, a YAML model file or a built-in model name")
    if path.is_file():
        raise MpipeError(f"model file {path} is neither a YAML model file (.yaml, .yml) nor a Hugging Face "
                         f"config.json; give one of those, or a built-in name ('mpipe-tune models' lists them)")
    raise MpipeError(
        f"model '{name}' is neither a file nor a built-in model (a relative path is looked up in the folder of "
        f"the file that composes it, then in the working folder); 'mpipe-tune models' lists the built-ins"
    )


def _absolute_composes(data: Any, folder: Path) -> Any:
    """``data`` with each ``compose`` entry that names a file next to it (relative to ``folder``) made absolute."""
    if not isinstance(data, dict) or not isinstance(data.get("compose"), list):
        return data
    entries = [str(folder / e) if isinstance(e, str) and not Path(e).is_absolute() and (folder / e).exists() else e
               for e in data["compose"]]
    return {**data, "compose": entries}


def resolve_spec(spec: str, kind: str) -> str:
    """How a plan file records a ``model`` or ``profile`` spec (``kind``): a file's absolute path, so that
    the plan loads from any folder; a built-in name as given. A path is what the loader reads as one."""
    path = Path(spec)
    if kind == "model":
        is_file = (path.suffix in (".yaml", ".yml") and path.exists()) or is_hf_config(path)
    else:
        assert kind == "profile", kind
        is_file = spec.endswith(".json") or os.sep in spec or "/" in spec
    return str(path.resolve()) if is_file else spec


def load_model(spec: str | os.PathLike) -> Model:
    """A built-in model name, the path of a YAML model file, or a Hugging Face config.json or its folder."""
    spec = str(spec)
    where = spec if Path(spec).exists() else f"built-in model '{spec}'"
    model = parse_model(_resolve(spec), where=where, resolve=_resolve)
    for layer in model.layers:
        if isinstance(layer.cost, ArchCost):
            validate_arch(layer.cost.kind, layer.cost.dims_dict(), where=f"{where} layer '{layer.name}'")
    return model
