"""A study's trials as data: each trial's candidate and its predicted figures (``mpipe-tune trials``).

The trial number, state, objective value and finishing time are read straight from Optuna's RDB
tables as a stream (``Study.trials_dataframe`` builds every trial through the ORM first, which a large
study cannot afford: see :data:`_TRIAL_ROWS`); the candidate and the figures come from the one user
attribute the driver stores in every trial (:data:`mpipe_tune.search._search_run.ATTR`), decoded through :class:`Candidate`. Columns carry
their unit and hold SI values (seconds, bytes): see :data:`COLUMNS`. A trial the driver settled by
its lower bound (``exact`` false) holds bounds: its ``step_s`` and ``p90_s`` are step-time lower
bounds and its ``peak_bytes`` its static memory, and it was never predicted in full.

Opening the study never creates anything: a SQLite file that does not exist, or a study name the
storage does not hold, is one line that lists the studies it does hold; a damaged, locked or foreign
file is one line too (:mod:`mpipe_tune.search._store`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import sqlalchemy

from mpipe_tune.errors import MpipeError
from mpipe_tune.outputs import MISSING, Column, format_frame, gib, is_missing, ms, text
from mpipe_tune.algebra import Candidate
from mpipe_tune.search._search_run import ATTR
from mpipe_tune.search._store import check_file, fault_of, faults_named

COLUMNS = ("number", "state", "schedule", "cut", "owners", "slab_counts", "pp", "tp", "dp", "microbatches",
           "recompute", "exact", "step_s", "p90_s", "bubble_share", "peak_bytes", "memory_excess_bytes",
           "fits_memory", "datetime_complete")
"""The trial frame's columns. ``step_s`` is Optuna's objective value (the mean predicted step time
over the sampled steps); ``fits_memory`` is None where the trial's peak was never estimated (a plan
slower than the best known then: it could not win)."""
_GIB = 2.0**30


def study_summaries(storage: str) -> list[tuple[str, int]]:
    """(name, trial count) of each study in ``storage``, by name: one counting query (Optuna's own summary
    loads every trial of every study)."""
    _check_storage(storage)
    check_file(storage, write=False)
    try:
        with _engine(storage).connect() as db:
            rows = db.execute(sqlalchemy.text(
                "SELECT s.study_name, COUNT(t.trial_id) FROM studies s LEFT JOIN trials t ON t.study_id = s.study_id "
                "GROUP BY s.study_id, s.study_name")).all()
    except Exception as exc:  # bad URL, missing driver, not an Optuna database: whatever the RDB layer raises
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise fault_of(exc, storage) or MpipeError(
            f"storage {storage}: cannot open it as an Optuna storage ({detail}); give an RDB URL such as "
            f"sqlite:///mpipe-tune.db") from None
    return sorted((name, count) for name, count in rows)


def load_trials_study(storage: str, study_name: str | None):
    """The study ``study_name`` of ``storage`` (``None``: the storage's only study)."""
    held = study_summaries(storage)
    names = [name for name, _ in held]
    if study_name is None and len(names) == 1:
        study_name = names[0]
    if study_name not in names:
        listing = ", ".join(f"'{name}' ({count} trials)" for name, count in held) or "none"
        what = "no study name given" if study_name is None else f"no study '{study_name}' in {storage}"
        raise MpipeError(f"{what}; the studies in {storage}: {listing}")
    with faults_named(storage):
        return optuna.load_study(study_name=study_name, storage=storage)


_TRIAL_ROWS = sqlalchemy.text(
    "SELECT t.number, t.state, t.datetime_complete, v.value, v.value_type, a.value_json "
    "FROM trials t JOIN studies s ON s.study_id = t.study_id "
    "LEFT JOIN trial_values v ON v.trial_id = t.trial_id AND v.objective = 0 "
    "LEFT JOIN trial_user_attributes a ON a.trial_id = t.trial_id AND a.key = :attr "
    "WHERE s.study_name = :study ORDER BY t.number"
).columns(datetime_complete=sqlalchemy.DateTime)
"""A study's trials as rows of Optuna's RDB schema (what ``Study.trials_dataframe`` reads through the ORM,
at about 25 KB and several milliseconds a trial: a study of 10^5 trials took 2.3 GB; this reads them as
a stream)."""
_VALUE_TYPES = {"FINITE": None, "INF_POS": math.inf, "INF_NEG": -math.inf}
_ROWS_PER_FETCH = 10_000


def trials_frame(study, storage: str) -> pd.DataFrame:
    """One row per trial of ``study`` (held in the RDB ``storage``, whose faults the errors name), in trial
    order, in :data:`COLUMNS`."""
    records = []
    with faults_named(storage), _engine(storage).connect() as db:
        result = db.execution_options(yield_per=_ROWS_PER_FETCH).execute(
            _TRIAL_ROWS, {"attr": ATTR, "study": study.study_name})
        for number, state, complete, value, value_type, info in result:
            step_s = _VALUE_TYPES.get(value_type) or value
            records.append({"number": number, "state": state, "datetime_complete": complete,
                            "step_s": math.nan if step_s is None else step_s,
                            **_decode(None if info is None else json.loads(info))})
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))


@functools.lru_cache(maxsize=4)
def _engine(storage: str):
    """A read engine of the RDB URL ``storage`` (one per URL and process)."""
    return sqlalchemy.create_engine(storage)


def _decode(info: Any) -> dict[str, Any]:
    """The candidate and figures of one trial's stored attribute (empty for a trial without one)."""
    if not isinstance(info, dict) or "candidate" not in info:
        return {}
    c = Candidate.from_dict(info["candidate"])
    excess = info["memory_excess_gib"] * _GIB
    peak = info["peak_bytes"]
    exact = bool(info.get("exact", True))
    return {
        "schedule": c.schedule, "cut": list(c.cut), "owners": c.owner_policy,
        "slab_counts": [list(s) for s in c.slab_counts] if c.slab_counts else None,
        "pp": c.pp, "tp": c.tp, "dp": c.dp, "microbatches": c.num_microbatches, "recompute": c.recompute,
        "exact": exact, "p90_s": info["p90_s"], "bubble_share": info["bubble_share"], "peak_bytes": peak,
        "memory_excess_bytes": None if peak is None else excess,
        "fits_memory": _fits(peak, excess, exact),
    }


def _fits(peak_bytes: float | None, excess_bytes: float, exact: bool) -> bool | None:
    """False over capacity (a static bound over it is enough), True for an exact peak within it,
    None where it is unknown (no peak estimated, or only a static bound within capacity)."""
    if peak_bytes is None:
        return None
    if excess_bytes > 0:
        return False
    return True if exact else None


def _check_storage(storage: str) -> None:
    """A SQLite URL must name a file that exists (Optuna would create an empty database)."""
    prefix = "sqlite:///"
    if storage.startswith(prefix) and storage[len(prefix):] not in ("", ":memory:"):
        path = Path(storage[len(prefix):].split("?")[0])
        if not path.is_file():
            raise MpipeError(f"study storage {storage}: no such file {path}; name the database the plan's search "
                             f"wrote, e.g. sqlite:///mpipe-tune.db", quantities=("study storage",))


# --------------------------------------------------------------------------------------- table

BOUND = "*"
"""Marks a trial settled by its lower bound: its step time and peak are bounds."""
OVER = "!"
"""Marks a peak over the device's memory capacity."""


def _step(r: pd.Series) -> str:
    return ms("step_s")(r) + ("" if is_missing(r["exact"]) or r["exact"] else BOUND)


def _peak(r: pd.Series) -> str:
    return gib("peak_bytes")(r) + (OVER if r["fits_memory"] is False else "")


TABLE_COLUMNS = (
    Column("trial", text("number"), ">", 5),
    Column("schedule", text("schedule"), min_width=20),
    Column("cut", lambda r: MISSING if not isinstance(r["cut"], list) else ",".join(map(str, r["cut"])) or MISSING,
           min_width=7),
    Column("owners", text("owners"), min_width=11),
    Column("pp/tp/dp", lambda r: MISSING if is_missing(r["pp"]) else f"{r['pp']}/{r['tp']}/{r['dp']}", min_width=9),
    Column("M", text("microbatches"), ">", 4),
    Column("step ms", _step, ">", 10),
    Column("p90 ms", ms("p90_s"), ">", 10),
    Column("bubble", text("bubble_share", ".1%"), ">", 7),
    Column("peak GiB", _peak, ">", 9),
    Column("recomp", lambda r: MISSING if is_missing(r["recompute"]) else ("yes" if r["recompute"] else "no"), ">", 6),
)
"""The printed trial table: milliseconds and GiB from the frame's seconds and bytes."""


def summary_line(frame: pd.DataFrame, storage: str, study_name: str) -> str:
    """How many trials, how many predicted, settled by bounds and known to fit, and the fastest that fits."""
    exact = frame["exact"].eq(True)
    fits = frame["fits_memory"].eq(True)
    line = (f"study '{study_name}' in {storage}: {len(frame)} trials ({int(exact.sum())} predicted, "
            f"{int(frame['exact'].eq(False).sum())} settled by their lower bound), {int(fits.sum())} known to fit memory")
    if fits.any():
        best = frame[fits].sort_values(["step_s", "number"]).iloc[0]
        line += f"; the fastest that fits: trial {best['number']}, <{best['schedule']}> {best['step_s'] * 1e3:.3f} ms"
    return line


def format_trials(frame: pd.DataFrame, num_rows: int) -> str:
    """The ``num_rows`` fastest trials (predicted ones first, then those settled by their bound), and
    what the step time and the markers mean."""
    shown = frame.assign(_bounded=~frame["exact"].eq(True)).sort_values(["_bounded", "step_s", "number"]).head(num_rows)
    lines = [format_frame(shown, TABLE_COLUMNS), "",
             f"step ms    the mean predicted step time over the study's sampled steps; p90 ms their 90th percentile"]
    if shown["exact"].eq(False).any():
        lines.append(f"{BOUND:<10} after step ms: settled by its lower bound, never predicted; its step ms, p90 ms and "
                     f"peak GiB (static memory) are lower bounds")
    if (shown["exact"].eq(True) & shown["peak_bytes"].isna()).any():
        lines.append(f"{MISSING:<10} in peak GiB: not estimated (slower than the best plan known then, it could not win)")
    if shown["fits_memory"].eq(False).any():
        lines.append(f"{OVER:<10} after peak GiB: the peak is over the device's memory capacity (it does not fit)")
    return "\n".join(lines)
