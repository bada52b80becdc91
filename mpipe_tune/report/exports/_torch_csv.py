"""``export --to torch-csv``: the per-rank compute actions in the CSV that ``torch.distributed.pipelining``'s
``_PipelineScheduleRuntime._load_csv`` reads (torch 2.13, ``schedules.py``).

One row per pipeline rank, cells ``{stage}F{mb}`` / ``{stage}B{mb}`` (``_Action``'s text form; ``B`` the full
backward, and a zero-bubble skeleton's split backward as ``{stage}I{mb}``, the input gradient, and a later
``{stage}W{mb}``, the weight gradient), in the rank's order from ``order.nodes``; stage index = rank + (j - 1)
x P for the j-th Sharded region (``zbv``'s second: 2P - 1 - rank, a V), the stage placement torch infers from
the rows. Plans whose regions are all Sharded only: a torch stage is one slab on one rank.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from mpipe_tune.algebra import Fwd, Wgrad
from mpipe_tune.errors import MpipeError
from mpipe_tune.report.exports._plan import ExportPlan, Output
from mpipe_tune.report.exports._refusals import validate_all_sharded
from mpipe_tune.report.exports._target import ExportTarget

ONE_SLAB_STAGES = "and a torch pipelining stage is one slab on one rank"
"""Why a trainer that runs torch's pipelining stages cannot run a transpose region."""


def _actions(plan: ExportPlan) -> list[list[tuple[int, str, int]]]:
    """Per rank, its compute actions as (stage, ``F``/``B``/``I``/``W``, microbatch), in its order."""
    split = {(e.region, e.rank, e.mb) for order in plan.orders for e in order if isinstance(e, Wgrad)}
    rows = []
    for rank, order in enumerate(plan.orders):
        row = []
        for event in order:
            if isinstance(event, Fwd):
                op = "F"
            elif isinstance(event, Wgrad):
                op = "W"
            else:
                op = "I" if (event.region, event.rank, event.mb) in split else "B"
            row.append((plan.stage_index(event.region, rank), op, event.mb))
        rows.append(row)
    return rows


def validate_schedule_csv(plan: ExportPlan, target: str) -> None:
    """What torch's schedule runtime needs of the CSV: every region Sharded, one backward (full or
    input part) per forward of every stage."""
    validate_all_sharded(plan, target, ONE_SLAB_STAGES)
    counts: dict[tuple[int, str], int] = {}
    for row in _actions(plan):
        for stage, op, _ in row:
            if op != "W":
                kind = "B" if op in "BI" else op
                counts[stage, kind] = counts.get((stage, kind), 0) + 1
    for stage in range(plan.pp * plan.num_chunks):
        if counts.get((stage, "B"), 0) != counts.get((stage, "F"), 0):
            raise MpipeError(f"{target} cannot express {plan.describe()}: stage {stage} runs no backward (its layers "
                             f"and all before them are frozen), and torch's schedule runtime needs one backward per "
                             f"forward; unfreeze a layer of it, or plan with that stage's layers merged into the next")


def schedule_csv(plan: ExportPlan) -> str:
    """The CSV text of a plan :func:`validate_schedule_csv` accepted."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([f"{s}{op}{mb}" for s, op, mb in row] for row in _actions(plan))
    return out.getvalue()


class TorchCsv(ExportTarget):
    name = "torch-csv"
    trainer = "torch-csv"
    help = "torch.distributed.pipelining schedule CSV (compute actions per rank)"
    client = ("torch 2.13's _PipelineScheduleRuntime loads and runs the CSV on gloo with the single-process "
              "gradients (tests/report/test_export_csv_runs.py)")

    def validate(self, plan: ExportPlan) -> None:
        validate_schedule_csv(plan, self.trainer)

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        return (Output(paths[0], schedule_csv(plan)),)
