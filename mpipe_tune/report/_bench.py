"""``mpipe-tune bench``: which plans of a file to time, and the record and table of their timings.

A bench runs the chosen plans of one plan file in rounds (``best``, ``megatron``, ..., ``best``,
``megatron``, ...), so a slow spell of the machine falls on every plan alike. A plan's measured step
time is the median over rounds of each round's measured step time (the run's own: the median of the
steps after the first, or the only step). Speedups are over the Megatron-style baseline at the best
plan's degrees (``megatron``, not ``megatron@own``), predicted (its predicted step time over the
plan's) and measured (the same with measured times); a bench whose plans leave ``megatron`` out has
none. By default a bench runs the best plan and its baselines at its degrees; ``--plans`` may name
any plan of the file, the alternatives at their own layouts too (``megatron@own``, ``current``).

>>> round_robin(("best", "megatron"), 2)
[('best', 0), ('megatron', 0), ('best', 1), ('megatron', 1)]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import pandas as pd

from mpipe_tune.errors import MpipeError
from mpipe_tune.outputs import Column, format_frame, ms, text
from mpipe_tune.plan_file import REFERENCE, PlanFile


def validate_rounds(num_rounds: int) -> None:
    if num_rounds < 1:
        raise MpipeError(f"round count is {num_rounds}, but a bench runs every plan at least once: give 1 or more",
                         quantities=("round count",))


def bench_plans(file: PlanFile, names: Sequence[str] | None) -> tuple[str, ...]:
    """The plans to time, in order: ``names`` (checked against every plan the file holds), or by
    default the best plan and its baselines at its degrees (:attr:`PlanFile.plan_names`)."""
    held, where = file.plan_names, file.where
    if len(held) == 1:
        raise MpipeError(f"{where} holds no baselines, only its best plan, so there is nothing to compare it with; "
                         f"re-create it with 'mpipe-tune plan', or time the one plan with 'mpipe-tune run'")
    if names is None:
        return held
    chosen = tuple(dict.fromkeys(names))
    if not chosen:
        raise MpipeError(f"the list of plans to run is empty; name one or more of {', '.join(held)} ({where})")
    every = file.names
    unknown = [n for n in chosen if n not in every]
    if unknown:
        raise MpipeError(f"{where} holds no plan named {', '.join(map(repr, unknown))}; it holds {', '.join(every)}")
    return chosen


def round_robin(names: Sequence[str], num_rounds: int) -> list[tuple[str, int]]:
    """(plan, round) of each run, in the order they run."""
    return [(name, k) for k in range(num_rounds) for name in names]


def bench_record(summaries: Sequence[dict[str, Any]], names: Sequence[str], num_rounds: int, *,
                 plan_file: str, compute: str, device: str, steps: int) -> dict[str, Any]:
    """The ``--json`` object from the run summaries in :func:`round_robin` order (a bench cut short
    passes the ones that finished; ``complete`` says whether that was all of them)."""
    runs = round_robin(names, num_rounds)
    per_plan: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for (name, _k), s in zip(runs, summaries):
        per_plan[name].append(s)
    plans = [_plan_entry(name, done) for name, done in per_plan.items() if done]
    by_name = {p["name"]: p for p in plans}
    reference = by_name.get(REFERENCE)
    for p in plans:
        p["speedup_predicted"] = _ratio(reference, p, "predicted_step_s")
        p["speedup_measured"] = _ratio(reference, p, "measured_step_s")
    best = by_name.get("best", {})
    return {
        "plan_file": plan_file, "compute": compute, "device": device, "rounds": num_rounds, "steps": steps,
        "reference": REFERENCE,
        "complete": len(summaries) == len(runs),
        "plans": plans,
        "speedup": {"predicted": best.get("speedup_predicted"), "measured": best.get("speedup_measured")},
    }


def _plan_entry(name: str, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    first = summaries[0]
    measured = statistics.median(s["measured_step_s"] for s in summaries)
    predicted = first["predicted_step_s"]
    return {
        "name": name, "schedule": first["schedule"], "pp": first["pp"], "tp": first.get("tp", 1),
        "dp": first.get("dp", 1), "microbatches": first["microbatches"],
        "predicted_step_s": predicted, "measured_step_s": measured,
        "ratio": measured / predicted if predicted > 0 else None,
        "round_measured_s": [s["measured_step_s"] for s in summaries],
        "step_times_s": [t for s in summaries for t in s["step_times_s"]],
    }


def _ratio(reference: dict[str, Any] | None, plan: dict[str, Any], key: str) -> float | None:
    if reference is None or not plan[key] > 0:
        return None
    return reference[key] / plan[key]


def progress_line(name: str, k: int, num_rounds: int, summary: dict[str, Any]) -> str:
    """One line per finished run, for stderr."""
    ratio = f"{summary['ratio']:.3f}" if summary.get("ratio") is not None else "-"
    schedule = f"<{summary['schedule']}>"
    return (f"round {k + 1}/{num_rounds}  {name:<13} {schedule:<22} measured "
            f"{summary['measured_step_s'] * 1e3:.3f} ms, predicted {summary['predicted_step_s'] * 1e3:.3f} ms ({ratio})")


_FRAME_COLUMNS = ("plan", "schedule", "pp", "tp", "dp", "microbatches", "predicted_step_s", "measured_step_s",
                  "ratio", "speedup_predicted", "speedup_measured")


def bench_frame(record: dict[str, Any]) -> pd.DataFrame:
    """The bench table of a :func:`bench_record`: one row per plan, step times in seconds."""
    return pd.DataFrame.from_records(
        [{"plan": p["name"], **{k: p[k] for k in _FRAME_COLUMNS[1:]}} for p in record["plans"]],
        columns=list(_FRAME_COLUMNS))


COLUMNS = (
    Column("plan", text("plan"), min_width=13),
    Column("schedule", text("schedule"), min_width=20),
    Column("pp/tp/dp", lambda r: f"{r['pp']}/{r['tp']}/{r['dp']}", min_width=9),
    Column("M", text("microbatches"), ">", 4),
    Column("pred ms", ms("predicted_step_s"), ">", 11),
    Column("meas ms", ms("measured_step_s"), ">", 11),
    Column("meas/pred", text("ratio", ".3f"), ">", 9),
    Column("speedup pred", text("speedup_predicted", ".3f", suffix="x"), ">", 12),
    Column("speedup meas", text("speedup_measured", ".3f", suffix="x"), ">", 12),
)
"""The printed bench table: milliseconds from the frame's seconds."""


def format_bench(record: dict[str, Any]) -> str:
    """A fixed-width table: predicted beside measured, step time and speedup, one line per plan."""
    basis = "median of steps 2.. of each round" if record["steps"] > 1 else "one step per round"
    lines = [f"bench {record['plan_file']}: {len(record['plans'])} plan(s), {record['rounds']} round(s) of "
             f"{record['steps']} step(s), compute {record['compute']} on {record['device']}; measured: median over "
             f"rounds ({basis}); speedup over {record['reference']}"
             + ("" if any(p["name"] == record["reference"] for p in record["plans"]) else " (not run here: none)")]
    lines += ["", format_frame(bench_frame(record), COLUMNS)]
    if not record["complete"]:
        lines.append("(cut short: the rows hold the rounds that finished)")
    lines.append("\npred ms    the plan file's predicted step time, of the one step it stores (the step every run trains)")
    return "\n".join(lines)
