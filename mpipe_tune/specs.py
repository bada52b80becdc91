"""Resolving the CLI's SPEC arguments: a built-in name or a file path, loaded and validated once.

``load_model`` reads a YAML model file (or a built-in from ``models/``), expands ``compose``, and checks
architecture dimensions with the cost model, so a bad file fails here with one line.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mpipe_tune.algebra.model import ArchCost, Model, parse_model
from mpipe_tune.cost import arch
from mpipe_tune.cost.profile import builtin_profiles, load_profile
from mpipe_tune.cost.workload import load_workload
from mpipe_tune.errors import MpipeError

__all__ = ["builtin_models", "builtin_profiles", "load_model", "load_profile", "load_workload"]


def _models_dir() -> Path:
    return Path(str(resources.files("mpipe_tune.models")))


def builtin_models() -> list[str]:
    return sorted(p.stem for p in _models_dir().glob("*.yaml"))


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise MpipeError(f"cannot read model file {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise MpipeError(f"model file {path} is not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None


def _resolve(name: str) -> Any:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return _read_yaml(path)
    builtin = _models_dir() / f"{name}.yaml"
    if builtin.exists():
        return _read_yaml(builtin)
    raise MpipeError(
        f"model '{name}' is neither a file nor a built-in model; built-ins: {', '.join(builtin_models())}"
    )


def load_model(spec: str | os.PathLike) -> Model:
    """A built-in model name or the path of a YAML model file."""
    spec = str(spec)
    where = spec if Path(spec).exists() else f"built-in model '{spec}'"
    model = parse_model(_resolve(spec), where=where, resolve=_resolve)
    for layer in model.layers:
        if isinstance(layer.cost, ArchCost):
            arch.validate_arch(layer.cost.kind, layer.cost.dims_dict(), where=f"{where} layer '{layer.name}'")
    return model
