"""Exports of a plan to other trainers: one :class:`ExportTarget` per trainer's format, one module each.

:func:`read_export_plan` reads one plan of a plan file (the best or a stored baseline) and the model it
was made for into an :class:`ExportPlan`, the one value every target reads; :func:`export_outputs` runs a
target by its ``--to`` name (:meth:`ExportTarget.export`: the output paths, then what the target can
express, one refusal line otherwise, then its files). The refusals several targets share are written
once, in :mod:`._refusals`.

A new target is one module holding an :class:`ExportTarget` subclass (``name``, ``trainer``, ``help``,
``client``, ``files``; ``validate`` and ``write``) and one line in :data:`TARGETS` below.
"""

from __future__ import annotations

from pathlib import Path

from mpipe_tune.errors import MpipeError
from mpipe_tune.report.exports._hyper_parallel import HyperParallel
from mpipe_tune.report.exports._megatron import Megatron
from mpipe_tune.report.exports._mindspeed_mm import MindSpeedMM
from mpipe_tune.report.exports._plan import ExportPlan, Output, export_plan, read_export_plan
from mpipe_tune.report.exports._target import ExportTarget, TwoFiles
from mpipe_tune.report.exports._torch_csv import TorchCsv
from mpipe_tune.report.exports._torchtitan import TorchTitan
from mpipe_tune.report.exports._torchtitan_03 import TorchTitan03

TARGETS: dict[str, ExportTarget] = {t.name: t for t in (
    TorchCsv(),
    TorchTitan(),
    TorchTitan03(),
    Megatron(),
    HyperParallel(),
    MindSpeedMM(),
)}
"""Every export target by its ``--to`` name, in the order ``export --help`` lists them."""


def export_outputs(plan: ExportPlan, fmt: str, out: Path | None) -> tuple[Output, ...]:
    """The files (or the standard output text) of ``plan`` in format ``fmt``."""
    if fmt not in TARGETS:
        raise MpipeError(f"export format {fmt!r} is unknown; use one of {', '.join(TARGETS)}")
    return TARGETS[fmt].export(plan, out)


__all__ = ["TARGETS", "ExportPlan", "ExportTarget", "Output", "TwoFiles", "export_outputs", "export_plan",
           "read_export_plan"]
