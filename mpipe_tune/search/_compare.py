"""The best plan beside the baselines: rows of one comparison table (plain dicts, what ``--json`` prints).

Three kinds of rows beside ``best``:

- ``<baseline>``: each baseline at the best plan's degrees, microbatch count and recomputation;
- ``<baseline>@own``: each baseline at its own best layout (:mod:`mpipe_tune.search._families`);
- ``current``: a layout the user gives (:mod:`mpipe_tune.search._layout`).

Every row carries two ratios: ``speedup``, its speedup over ``megatron`` at the best plan's degrees
(the reference ``bench`` keeps), and ``best_speedup``, the best plan's speedup over the row. So for a
baseline the two speedups of the best plan are ``best_speedup`` on its row and on its ``@own`` row.

The table is a DataFrame of those rows (:func:`comparison_frame`, SI columns: what ``--csv``
writes); the printed table is made from it (:data:`COLUMNS`: milliseconds, GiB).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pandas as pd

from mpipe_tune.interrupt import mark
from mpipe_tune.outputs import MISSING, Cell, Column, TextTable, format_frame, gib, is_missing, ms, text
from mpipe_tune.search._baselines import UNPIPELINED, baseline
from mpipe_tune.search._evaluate import Evaluation, Evaluator
from mpipe_tune.search._families import OwnBest
from mpipe_tune.search._space import SearchSpace
from mpipe_tune.plan_file import BASELINES, CURRENT, OWN, REFERENCE


def evaluate_baselines(evaluator: Evaluator, space: SearchSpace, best: Evaluation) -> list[tuple[str, Evaluation | None]]:
    """Every baseline at the best plan's degrees, microbatch count and recomputation setting (None
    where it does not exist)."""
    c = best.candidate
    vpp_counts = space.microbatch_choices(c.pp, c.dp, "1f1b,1f1b")
    out = []
    for name in BASELINES:
        mark("baseline")  # a named point of the Ctrl-C tests (a Ctrl-C here stops the plan before its writing)
        candidate = baseline(name, evaluator.problem.model, c.pp, c.tp, c.dp, c.num_microbatches, vpp_counts)
        if candidate is not None:
            candidate = replace(candidate, recompute=c.recompute, ep=c.ep, cp=c.cp, zero_stage=c.zero_stage,
                                reshard_after_forward=c.reshard_after_forward,
                                sequence_parallel=c.sequence_parallel,
                                encoder_tp=c.encoder_tp)  # the best plan's degrees and memory policy
        out.append((name, None if candidate is None else evaluator.evaluate(candidate)))
    return out


def _ratio(slow: Evaluation | None, fast: Evaluation | None) -> float | None:
    """``slow``'s step time over ``fast``'s: how many times faster ``fast`` is."""
    if slow is None or fast is None or not fast.mean_s > 0:
        return None
    return slow.mean_s / fast.mean_s


def row(label: str, e: Evaluation, reference: Evaluation | None, best: Evaluation | None = None) -> dict[str, Any]:
    c = e.candidate
    return {
        "plan": label,
        "schedule": c.schedule,
        "cut": list(c.cut),
        "owners": c.owner_policy,
        "slabs": [list(s) for s in e.slab_counts],
        "pp": c.pp, "tp": c.tp, "dp": c.dp, "ep": c.ep, "cp": c.cp,
        "encoder_tp": c.tp if c.encoder_tp is None else c.encoder_tp,
        "encoder_dp": c.dp * c.cp * c.tp // (c.encoder_tp or c.tp),  # the encoder's own data parallelism:
        # its gradients reduce over dp x cp x tp / encoder_tp ranks (the groups inside a slab encode other images)
        "microbatches": c.num_microbatches,
        "recompute": c.recompute,
        "zero_stage": c.zero_stage, "sequence_parallel": c.sequence_parallel,
        "step_s": e.mean_s,
        "p90_s": e.p90_s,
        "step_samples_s": list(e.makespans_s),
        "speedup": _ratio(reference, e),
        "best_speedup": _ratio(e, best),
        "bubble_share": e.bubble_share,
        "spill_s": e.max_spill_s,
        "peak_bytes": e.peak_bytes,
        "fits_memory": e.fits,
    }


def comparison_rows(best: Evaluation, baselines: list[tuple[str, Evaluation | None]]) -> list[dict[str, Any]]:
    """``best``, then each baseline at its degrees."""
    reference = dict(baselines).get(REFERENCE)
    rows = [row("best", best, reference, best)]
    rows += [row(name, e, reference, best) for name, e in baselines if e is not None]
    return rows


def own_best_rows(best: Evaluation, baselines: list[tuple[str, Evaluation | None]],
                  families: list[OwnBest]) -> list[dict[str, Any]]:
    """One row per baseline whose family has a plan that fits memory: ``<name>@own``."""
    reference = dict(baselines).get(REFERENCE)
    return [row(f.label, f.best, reference, best) for f in families if f.best is not None]


def current_row(best: Evaluation, baselines: list[tuple[str, Evaluation | None]], current: Evaluation) -> dict[str, Any]:
    return row(CURRENT, current, dict(baselines).get(REFERENCE), best)


def family_record(families: list[OwnBest]) -> dict[str, dict[str, int]]:
    """What each family's search covered: candidates, predicted, settled by bounds."""
    return {f.name: {"candidates": f.num_candidates, "evaluated": f.num_evaluated, "bounded": f.num_bounded}
            for f in families}


def speedups(best: Evaluation, baselines: list[tuple[str, Evaluation | None]], families: list[OwnBest],
             current: Evaluation | None) -> dict[str, Any]:
    """The best plan's speedups: over each baseline at its degrees and at the baseline's own best
    (None where that plan does not exist or none fits), and over the current layout."""
    return {
        "at_best_degrees": {name: _ratio(e, best) for name, e in baselines},
        "at_own_best": {f.name: _ratio(f.best, best) for f in families},
        "over_current": _ratio(current, best),
    }


# --------------------------------------------------------------------------------------- table

ROW_COLUMNS = ("plan", "schedule", "cut", "owners", "slabs", "pp", "tp", "dp", "ep", "cp", "encoder_tp",
               "encoder_dp", "microbatches", "recompute", "zero_stage", "sequence_parallel",
               "step_s", "p90_s", "step_samples_s", "speedup", "best_speedup", "bubble_share", "spill_s",
               "peak_bytes", "fits_memory", "bound_by")
"""The columns of a comparison frame: the keys of :func:`row`, values in SI units (seconds, bytes)."""
OVER = "!"
"""Marks a peak over the device's memory capacity in the printed table."""


def rows_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows of :func:`row` as a DataFrame, one row per plan in the given order (what ``--csv`` writes)."""
    return pd.DataFrame.from_records(rows, columns=list(ROW_COLUMNS))


def comparison_frame(search: dict[str, Any]) -> pd.DataFrame:
    """The rows of a ``plan`` summary (``comparison``, and where present ``own_best`` and ``current``)
    in table order: ``best``, each baseline followed by its ``@own`` row, the current layout last."""
    rows = {r["plan"]: r for r in search["comparison"]}
    own = {r["plan"]: r for r in search.get("own_best", [])}
    ordered = [rows["best"]]
    for name in BASELINES:
        ordered += [r for r in (rows.get(name), own.get(name + OWN)) if r is not None]
    if search.get("current") is not None:
        ordered.append(search["current"])
    return rows_frame(ordered)


def _times(key: str) -> Cell:
    return text(key, ".3f", suffix="x")


def _best_over(r: pd.Series) -> str:
    """The best plan's speedup over a row that could run instead (none over itself or a plan that does not fit)."""
    return MISSING if r["plan"] == "best" or not r["fits_memory"] else _times("best_speedup")(r)


def _peak(r: pd.Series) -> str:
    return gib("peak_bytes")(r) + ("" if is_missing(r["peak_bytes"]) or r["fits_memory"] else OVER)


COLUMNS = (
    Column("plan", text("plan"), min_width=13),
    Column("schedule", text("schedule"), min_width=20),
    Column("cut", lambda r: ",".join(map(str, r["cut"])) or MISSING, min_width=7),
    Column("owners", text("owners"), min_width=11),
    Column("pp/tp/dp", lambda r: f"{r['pp']}/{r['tp']}/{r['dp']}" + (
        f" etp{r['encoder_tp']} edp{r['encoder_dp']}" if r.get("encoder_tp", r["tp"]) != r["tp"] else ""),
        min_width=9),
    Column("M", text("microbatches"), ">", 4),
    Column("step ms", ms("step_s"), ">", 10),
    Column("p90 ms", ms("p90_s"), ">", 10),
    Column("speedup", _times("speedup"), ">", 8),
    Column("best over", _best_over, ">", 9),
    Column("bubble", text("bubble_share", ".1%"), ">", 7),
    Column("peak GiB", _peak, ">", 9),
    Column("recomp", lambda r: "yes" if r["recompute"] else "no", ">", 6),
    # right-aligned as the last column: a shorter left-aligned last cell would end its line (stripped) early
    Column("bound by", lambda r: MISSING if is_missing(r["bound_by"]) else str(r["bound_by"]), ">", 8),
)
"""The printed comparison table: milliseconds and GiB from the frame's seconds and bytes."""


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: one line per plan, in the given order (a peak over capacity is marked ``!``)."""
    return format_frame(rows_frame(rows), COLUMNS)


def format_comparison(search: dict[str, Any]) -> str:
    """The table of a ``plan`` summary (:func:`comparison_frame`), with a line for each baseline whose
    own layouts none fits memory, and what the columns and markers mean."""
    frame = comparison_frame(search)
    table = TextTable.fit(frame, COLUMNS)
    line = {r["plan"]: table.line(r) for _, r in frame.iterrows()}
    families = search.get("families", {})
    lines = [table.header, table.rule, line["best"]]
    unpipelined = frame["pp"].iloc[0] == 1  # the best plan's: the baselines' degrees
    for name in BASELINES:
        if name in line:
            lines.append(line[name])
        elif unpipelined and name in UNPIPELINED:
            lines.append(f"{table.pad(0, name)} - {UNPIPELINED[name]}")
        if name + OWN in line:
            lines.append(line[name + OWN])
        elif families.get(name, {}).get("candidates"):
            lines.append(f"{table.pad(0, name + OWN)} none of its {families[name]['candidates']} layouts in the "
                         f"space fits memory")
    if CURRENT in line:
        lines.append(line[CURRENT])
    samples = search.get("samples", 1)
    step = (["step ms    the predicted step time of the one step (plan.json, 'mpipe-tune show' and the Gantt",
             "           picture hold the same step), p90 ms the same"] if samples == 1 else
            [f"step ms    the mean predicted step time over the {samples} sampled steps, p90 ms their 90th "
             f"percentile;", "           plan.json, 'mpipe-tune show' and the Gantt picture hold each plan's first "
             "sampled step only"])
    notes = [
        *step,
        f"speedup    the row's speedup over {REFERENCE} at the best plan's degrees",
        "best over  the best plan's speedup over the row (- where the row does not fit memory: it cannot run)",
        "rows       <baseline>: at the best plan's degrees, M and recomputation; <baseline>@own: at its own best",
        "           layout, the fastest (degrees, M, recomputation, VPP chunks) of the same space that fits memory"
        + ("" if search.get("current") is None else ";\n           current: the current layout given"),
    ]
    if not frame["fits_memory"].all():
        notes.append(f"{OVER:<10} after peak GiB: the plan's peak is over the device's memory capacity (it does not fit)")
    return "\n".join([*lines, "", *notes])
