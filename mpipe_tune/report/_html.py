"""``mpipe-tune report plan.json --html report.html``: one self-contained HTML page of a plan file.

The page holds the comparison table the search printed, every stored plan's predicted timeline on a
shared time axis, each plan's per-rank memory against the device's capacity, and, where the plan's
study storage can be opened, the study's trials as step time against peak memory with the winner
marked. Pictures are matplotlib PNGs embedded as base64 and the style sheet is inline: no script, no
server, nothing fetched, so the file opens offline in any browser and can be mailed as it is.

Every plan is re-predicted from its stored candidate (as ``show`` does), after the model and profile
hashes are checked, so the page shows what the cost model says of the plan file now.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpipe_tune.cost import bound_text, rank_bounds
from mpipe_tune.errors import MpipeError
from mpipe_tune.outputs import validate_out_path, Column
from mpipe_tune.report._html_figures import PlanFigureData, memory_png, timelines_png, trials_png

HTML_SUFFIXES = (".html", ".htm")

ComparisonFrame = Callable[[dict[str, Any]], Any]
"""A plan file's stored search summary -> its comparison table's rows, a DataFrame in table order."""
StudyTrials = Callable[[str, str], Any]
"""(storage URL, study name) -> the study's trials, a DataFrame; one-line MpipeError where it cannot be read."""


def validate_html_path(path: str | os.PathLike) -> Path:
    """Before any work: ``path`` can take the page, and matplotlib, which draws its pictures, is installed."""
    path = validate_out_path(path, label="HTML report", suffixes=HTML_SUFFIXES)
    if importlib.util.find_spec("matplotlib") is None:
        raise MpipeError(f"HTML report {path}: the report's pictures need matplotlib; install it with: "
                         f"pip install 'mpipe-tune[viz]'", quantities=("HTML report",))
    return path


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { padding: 2px 8px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.best td { font-weight: bold; } img { max-width: 100%; } p.note { color: #666; font-size: 0.85em; }
"""


@dataclass(frozen=True)
class Report:
    """What the page shows, gathered before any of it is drawn."""

    title: str
    inputs: list[tuple[str, str]]
    table_header: list[str]
    table_rows: list[tuple[str, list[tuple[str, bool]]]]
    """(plan name, [(cell text, right-aligned)])."""
    plans: list[PlanFigureData]
    capacity_bytes: float
    trials: Any
    """The study's trials frame, or None."""
    trials_note: str
    best_step_s: float
    best_peak_bytes: float
    bounds: tuple[tuple[str, str], ...] = ()
    """(plan name, what bounds each of its ranks), as re-predicted."""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render(report: Report) -> str:
    """The page's HTML text."""
    e = html.escape
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(report.title)}</title>"
             f"<style>{_STYLE}</style></head><body>", f"<h1>{e(report.title)}</h1>", "<table>"]
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in report.inputs]
    parts.append("</table>")
    if report.table_rows:
        parts.append('<h2 id="comparison">Comparison</h2><table id="comparison-table"><tr>'
                     + "".join(f"<th>{e(h)}</th>" for h in report.table_header) + "</tr>")
        for name, cells in report.table_rows:
            parts.append(f'<tr class="{"best" if name == "best" else "plan"}" data-plan="{e(name)}">' + "".join(
                f'<td{" class=num" if right else ""}>{e(text)}</td>' for text, right in cells) + "</tr>")
        parts.append("</table><p class=note>step ms: the mean predicted step time over the sampled steps, p90 its "
                     "90th percentile; best over: the best plan's speedup over the row, - where the row does not fit memory; !: over memory capacity.</p>")
    names = ", ".join(p.name for p in report.plans)
    parts.append(f'<h2 id="timelines">Timelines</h2><p class=note>Each stored plan\'s first sampled step, '
                 f'predicted, on one time axis: {e(names)}.</p>')
    parts.append(_img(timelines_png(report.plans), "timelines of " + names))
    if report.bounds:
        parts.append('<h2 id="bound-by">What bounds each rank</h2><table id="bound-by-table">'
                     + "".join(f"<tr><th>{e(name)}</th><td>{e(text)}</td></tr>" for name, text in report.bounds)
                     + "</table><p class=note>Per rank, what sets most of its busy time: compute, memory traffic, "
                       "the host's issue of kernels, or communication, with that share.</p>")
    parts.append('<h2 id="memory">Memory per rank</h2>')
    parts.append(_img(memory_png(report.plans, report.capacity_bytes), "peak memory per rank of " + names))
    parts.append('<h2 id="trials">Trials</h2>')
    if report.trials is not None and len(report.trials):
        parts.append(_img(trials_png(report.trials, report.capacity_bytes, report.best_step_s, report.best_peak_bytes),
                          "trials: step time against peak memory"))
    parts.append(f"<p class=note>{e(report.trials_note)}</p></body></html>\n")
    return "\n".join(parts)


def _comparison(search: dict[str, Any] | None, columns: Sequence[Column], comparison_frame: ComparisonFrame,
                ) -> tuple[list[str], list[tuple[str, list[tuple[str, bool]]]]]:
    if not search:
        return [], []
    frame = comparison_frame(search)
    rows = [(str(r["plan"]), [(c.cell(r), c.align == ">") for c in columns]) for _, r in frame.iterrows()]
    return [c.header for c in columns], rows


def _storage_near(storage: str, plan_path: Path) -> str:
    """A relative SQLite storage is relative to where ``plan`` ran: try the working folder, then the
    plan file's folder."""
    prefix = "sqlite:///"
    if not storage.startswith(prefix):
        return storage
    path = Path(storage[len(prefix):])
    if path.is_absolute() or path.is_file() or not (plan_path.parent / path).is_file():
        return storage
    return prefix + str(plan_path.parent / path)


def _trials(search: dict[str, Any] | None, plan_path: Path, storage: str | None, study_trials: StudyTrials):
    """(the study's trials frame or None, a sentence saying what was read or why not)."""
    if not search or not search.get("study"):
        return None, "The plan file holds no search: no trials to show (make it with 'mpipe-tune plan')."
    storage = storage or search.get("storage")
    if not storage:
        return None, f"The plan records no study storage for study '{search['study']}'; give --storage URL."
    storage = _storage_near(storage, plan_path)
    try:
        frame = study_trials(storage, search["study"])
    except MpipeError as exc:
        return None, f"The study's trials are not shown: {exc}. Give --storage URL where the study is."
    return frame, f"Study '{search['study']}' in {storage}: {len(frame)} trials; the star is the plan's best."


def build_report(path: str, *, comparison: tuple[Sequence[Column], ComparisonFrame], study_trials: StudyTrials,
                 model_spec: str | None = None, profile_spec: str | None = None, storage: str | None = None) -> Report:
    """Read the plan file, re-predict every stored plan, and gather the study's trials. The search's
    records are read by what the caller gives: ``comparison``, the table's columns and how the stored
    summary becomes its rows; ``study_trials(storage, study)``, a study's trials as a frame."""
    from mpipe_tune.plan_file import read_plan
    from mpipe_tune.report._repredict import repredict

    plan_file = read_plan(path)
    plans, bounds, model, profile = [], [], model_spec, profile_spec
    for name in plan_file.names:  # the inputs loaded once, with the first plan
        shown = repredict(plan_file, name, model=model, profile=profile)
        model, profile, section = shown.resolved.model, shown.resolved.profile, shown.resolved.section
        t = shown.prediction.timeline
        ranks = section.predicted.ranks
        bounds.append((name, bound_text(rank_bounds(shown.prediction))))
        plans.append(PlanFigureData(name, shown.prediction.plan, np.asarray(t.start_s), np.asarray(t.durations_s),
                                    float(t.makespan_s), tuple(r.memory.static_bytes for r in ranks),
                                    tuple(r.memory.peak_bytes for r in ranks)))
    search = None if plan_file.search is None else plan_file.search.to_stored()
    header, rows = _comparison(search, *comparison)
    trials, note = _trials(search, Path(path), storage, study_trials)
    best = next((r for r in (search or {}).get("comparison", []) if r.get("plan") == "best"), None)
    best_section = plan_file.section()
    inputs = plan_file.inputs
    info = [("model", f"{inputs.model.name} ({inputs.model.spec})"),
            ("profile", f"{profile.name} ({inputs.profile.spec}), {profile.memory_capacity_bytes / 2**30:.4g} GiB"),
            ("workload", best_section.workload.name), ("plans", ", ".join(plan_file.names))]
    if search:
        info.append(("search", f"{search['trials']} trials, {search['samples']} sampled steps, global batch "
                               f"{search['global_batch']}, study '{search['study']}'"))
    return Report(
        title=f"mpipe-tune plan report: {Path(path).name}", inputs=info, table_header=header, table_rows=rows,
        plans=plans, capacity_bytes=float(profile.memory_capacity_bytes), trials=trials, trials_note=note,
        best_step_s=float(best["step_s"]) if best else best_section.predicted_step_s, bounds=tuple(bounds),
        best_peak_bytes=float(best["peak_bytes"]) if best and best.get("peak_bytes") is not None
        else max(best_section.peak_bytes))
