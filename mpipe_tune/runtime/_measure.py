"""Measured step times beside the prediction, and the per-event Chrome/Perfetto trace.

Each rank times its own events on its own clock; steps start after a barrier, so rank ``r``'s times
are laid out from its own step start (the barrier's exit skew, well under a millisecond on one host,
is the alignment error). A step's time is the slowest rank's, from its step start to the end of its
optimizer update. Pure Python: the records come from :class:`~mpipe_tune.runtime._executor.StepRecord`.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from mpipe_tune.runtime._plan_view import PlanView


def step_times_s(per_rank: Sequence[Sequence[Any]]) -> list[float]:
    """Per step, the slowest rank's step time."""
    num_steps = len(per_rank[0])
    return [max(steps[k].end - steps[k].start for steps in per_rank) for k in range(num_steps)]


def summary(view: PlanView, per_rank: Sequence[Sequence[Any]], *, views: Sequence[PlanView] | None = None,
            per_step: Sequence[dict[str, Any]] | None = None, **about: Any) -> dict[str, Any]:
    """The ``--json`` record: measured beside predicted, the ratio, per-step times and losses.

    ``views`` holds each step's view (default: ``view`` for every step) and ``per_step`` each step's
    record of its metadata and owner map (:class:`~mpipe_tune.runtime._steps.StepPlan`). The measured
    step time is the median over steps after the first (which pays one-time warm-up), or the only
    step's time when there is one; the predicted one is the median of the same steps' predictions."""
    times = step_times_s(per_rank)
    measured = statistics.median(times[1:]) if len(times) > 1 else times[0]
    predictions = [v.predicted_step_s for v in views] if views is not None else [view.predicted_step_s] * len(times)
    predicted = statistics.median(predictions[1:]) if len(times) > 1 else predictions[0]
    losses = []
    for k in range(len(times)):
        per_mb = {m: loss for steps in per_rank for m, loss in steps[k].losses.items()}
        losses.append(sum(per_mb.values()) if per_mb else None)
    return {
        "plan": view.path,
        "candidate": str(view.candidate),
        "schedule": view.schedule,
        "pp": view.layout.pp,
        "tp": view.layout.tp,
        "dp": view.layout.dp,
        "cp": view.layout.cp,
        "ep": view.layout.ep,
        "sequence_parallel": view.candidate.sequence_parallel,
        "zero_stage": view.candidate.zero_stage,
        "microbatches": view.num_microbatches,
        **about,
        "steps": len(times),
        "step_times_s": times,
        "loss_sums": losses,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        "predicted_step_times_s": predictions,
        "ratio": measured / predicted if predicted > 0 else None,
        "busy_s": [_busy_s(steps[-1]) for steps in per_rank],
        "per_step": list(per_step) if per_step is not None else None,
    }


def _busy_s(step: Any) -> float:
    return sum(end - start for _i, _ready, start, end in step.spans) + step.update_s


def chrome_trace(views: Sequence[PlanView], per_rank: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Chrome/Perfetto ``traceEvents``: one process per rank, one slice per event run (its wait for
    inputs in ``args.wait_us``, its predicted duration in ``args.predicted_us``), and one slice per step.
    ``views`` holds each step's view of the plan (its events and predicted durations)."""
    events: list[dict[str, Any]] = []
    times = step_times_s(per_rank)
    layout = views[0].layout
    for rank, steps in enumerate(per_rank):
        pp_rank, dp_rank, tp_rank = layout.coordinates(rank)
        where = f" (pp {pp_rank}, dp {dp_rank}, tp {tp_rank})" if layout.dp * layout.tp > 1 else ""
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}{where}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "events"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "steps"}})
        offset = 0.0
        for k, step in enumerate(steps):
            def us(t: float) -> float:
                return round((t - step.start + offset) * 1e6, 3)

            events.append({"name": f"step {k}", "ph": "X", "pid": rank, "tid": 1, "ts": us(step.start),
                           "dur": round((step.end - step.start) * 1e6, 3), "args": {"step": k}})
            view = views[k]
            for index, ready, start, end in step.spans:
                events.append({
                    "name": str(view.events[index]), "cat": type(view.events[index]).__name__, "ph": "X",
                    "pid": rank, "tid": 0, "ts": us(start), "dur": round((end - start) * 1e6, 3),
                    "args": {"step": k, "wait_us": round((start - ready) * 1e6, 3),
                             "predicted_us": round(view.durations_s[index] * 1e6, 3)},
                })
            offset += times[k]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def dump_trace(trace: dict[str, Any], path: str | os.PathLike) -> None:
    """Write the trace to ``path`` atomically."""
    from mpipe_tune.outputs import write_atomic

    write_atomic(path, json.dumps(trace), label="trace file", suffixes=(".json",))
