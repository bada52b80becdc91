"""Per-rank timeline pictures in the style of the paper's Figure 2: predicted (:func:`draw_gantt`,
from a prediction's timeline) and measured (:func:`draw_measured_gantt`, from a run's Chrome trace).

One row per rank; encoder forwards, backbone forwards, backwards (input gradients, where a
zero-bubble skeleton splits them), weight gradients, encoder backwards and reduces in distinct colours, microbatch numbers on the bars. Collectives occupy links, not ranks, so
they are drawn as thin bars under the row of the rank that sends them. A plan at ZeRO-2, or at ZeRO-3
keeping its weights, has its stages' sharding actions (:mod:`mpipe_tune.algebra._sharding`) marked on
their rank's row: a gather where the stage's first event starts, a reduce-scatter and a free where its
last backward ends.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from mpipe_tune.algebra import (
    Plan, Bwd, Coll, DpReduce, Fwd, Loss, ReduceGrad, Reshard, Unshard, Wgrad, parse_event, sharded_program,
    Layout,
)
from mpipe_tune.errors import MpipeError
from mpipe_tune.outputs import validate_out_path, write_together

PICTURE_SUFFIXES = (".png",)
"""What a timeline picture's path must end in."""

COLOURS = {
    "encoder fwd": "#f2a541",
    "encoder bwd": "#c8553d",
    "forward": "#4f86c6",
    "backward": "#7bb661",
    "weight grad": "#2e8b8b",
    "reduce": "#8e6bbf",
    "collective": "#9a9a9a",
}


def _category(replicated: set[int], event) -> str | None:
    if isinstance(event, Fwd):
        return "encoder fwd" if event.region in replicated else "forward"
    if isinstance(event, Bwd):
        return "encoder bwd" if event.region in replicated else "backward"
    if isinstance(event, Wgrad):
        return "weight grad"
    if isinstance(event, DpReduce):
        return "reduce"
    if isinstance(event, Coll):
        return "collective"
    return None


def validate_picture_path(path: str | os.PathLike, *, label: str = "timeline picture") -> Path:
    """Before any work: ``path`` can take a PNG (see :func:`~mpipe_tune.outputs._files.validate_out_path`)
    and matplotlib is installed; ``label`` names the path in the error."""
    path = validate_out_path(path, label=label, suffixes=PICTURE_SUFFIXES)
    if importlib.util.find_spec("matplotlib") is None:
        raise MpipeError(f"{label} {path}: drawing a timeline needs matplotlib; install it with: pip install 'mpipe-tune[viz]'")
    return path


def _time_unit(makespan_s: float) -> tuple[float, str]:
    return (1e3, "ms") if makespan_s < 10 else (1.0, "s")


def draw_gantt(plan: Plan, start_s: np.ndarray, durations_s: np.ndarray, path: str | os.PathLike, *, title: str = "",
               zero: tuple[int, bool] = (1, False), actions: list[tuple[int, float, float]] = ()) -> None:
    """Write a PNG of the predicted per-rank timeline to ``path`` (atomically); ``zero``: the plan's ZeRO
    stage and whether it reshards after forward, whose sharding actions are marked (:func:`sharding_marks`);
    ``actions``: the per-microbatch sharding actions' (rank, start, seconds), drawn thin under their rank's row
    as its transfers are (:func:`action_spans`)."""
    bars, links, replicated = plan_bars(plan, start_s, durations_s)
    links = [*links, *actions]
    makespan = float((start_s + durations_s).max(initial=0.0))
    scale, unit = _time_unit(makespan)
    title = title or f"<{plan.schedule}>  P={plan.num_ranks}  M={plan.num_microbatches}  step {makespan * scale:.3g} {unit}"
    _draw(bars, links, [f"rank {r}" for r in range(plan.num_ranks)], replicated, makespan, path, title,
          marks=sharding_marks(plan, start_s, durations_s, *zero))


def action_spans(plan: Plan, timeline) -> list[tuple[int, float, float]]:
    """(rank, start, seconds) of each per-microbatch sharding action on a predicted ``timeline`` of ``plan``
    (:class:`~mpipe_tune.cost._timing.Timeline`; none without any): on the rank of the event it is placed at."""
    if timeline.actions_s is None:
        return []
    ranks = plan.order.columns.rank[timeline.actions_at]
    return [(int(r), float(a), float(d)) for r, a, d in zip(ranks, timeline.actions_start_s, timeline.actions_s)]


def zero_of(options) -> tuple[int, bool]:
    """The ZeRO setting a prediction's cost options mark (:func:`draw_gantt`'s ``zero``): none where one
    data-parallel rank leaves nothing to shard."""
    if options.degrees.dp * options.degrees.cp < 2:
        return (0, False)
    return (options.zero_stage, options.reshard_after_forward)


MARKS = {Unshard: ("v", "gather"), ReduceGrad: ("^", "reduce-scatter"), Reshard: ("x", "free")}
"""How each sharding action is marked: its marker and its legend label."""


def sharding_marks(plan: Plan, start_s: np.ndarray, durations_s: np.ndarray, zero_stage: int,
                   reshards_after_forward: bool) -> list[tuple[int, type, float]]:
    """(rank, action kind, time) of every sharding action of the plan's program: an action before an
    event at that event's start, one after an event at its finish.

    >>> from mpipe_tune.algebra import Cut, Model, Schedule, Skeleton, derive, Layer
    >>> plan = derive(Cut(()), Schedule((Skeleton("1f1b"),)), Model("m", (Layer("u", "llm", True, 1.0),)), 1, 1)
    >>> start, durations = np.arange(len(plan.order.events), dtype=float), np.ones(len(plan.order.events))
    >>> [(rank, kind.__name__, t) for rank, kind, t in sharding_marks(plan, start, durations, 3, False)]
    [(0, 'Unshard', 0.0), (0, 'ReduceGrad', 3.0), (0, 'Reshard', 3.0)]
    """
    marks = []
    for rank in range(plan.num_ranks):
        program = sharded_program(plan, rank, zero_stage=zero_stage, reshards_after_forward=reshards_after_forward)
        previous_end = 0.0
        pending: list[type] = []
        for item in program:
            if type(item) in MARKS:
                pending.append(type(item))
                continue
            i = plan.index[item]
            for kind in pending:  # actions between two events: an unshard at the next one's start, the rest at the last one's end
                marks.append((rank, kind, float(start_s[i]) if kind is Unshard else previous_end))
            pending = []
            previous_end = float(start_s[i] + durations_s[i])
        marks += [(rank, kind, previous_end) for kind in pending]
    return marks


def draw_measured_gantt(trace: dict[str, Any], path: str | os.PathLike, *, replicated_regions: Iterable[int] = (),
                        title: str = "", step: int | None = None) -> None:
    """Draw one measured step of a Chrome trace (:func:`mpipe_tune.runtime._measure.chrome_trace`) in
    the look of :func:`draw_gantt` (``title`` is followed by the step and its measured time): each event's measured span (its wait for inputs left out), from
    its rank's step start. ``step``: which step (default the last); ``replicated_regions``: the
    plan's replicated regions, drawn in the encoder colours. Transfers run inside the events' spans,
    so there are no collective bars."""
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    step = max(e["args"]["step"] for e in slices) if step is None else step
    step_start = {e["pid"]: e for e in slices if e["tid"] == 1 and e["args"]["step"] == step}
    rows = sorted(step_start)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    bars = [(rows.index(e["pid"]), parse_event(e["name"]), (e["ts"] - step_start[e["pid"]]["ts"]) * 1e-6, e["dur"] * 1e-6)
            for e in slices if e["tid"] == 0 and e["args"]["step"] == step]
    makespan = max((e["dur"] * 1e-6 for e in step_start.values()), default=0.0)
    scale, unit = _time_unit(makespan)
    title = (f"{title}: " if title else "") + f"measured step {step}, {makespan * scale:.4g} {unit}"
    _draw(bars, [], [names.get(pid, f"rank {pid}") for pid in rows], set(replicated_regions), makespan, path, title,
          legend=[k for k in COLOURS if k != "collective"])


def _draw(bars: list[tuple[int, Any, float, float]], links: list[tuple[int, float, float]], row_labels: list[str],
          replicated: set[int], makespan_s: float, path: str | os.PathLike, title: str,
          legend: list[str] | None = None, marks: list[tuple[int, type, float]] = ()) -> None:
    """The picture: ``bars`` (row, event, start, duration) on ranks, ``links`` (row, start, duration)
    thin under the row that sends them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise MpipeError("drawing a timeline needs matplotlib; install it with: pip install 'mpipe-tune[viz]'") from None
    path = validate_out_path(path, label="timeline picture", suffixes=PICTURE_SUFFIXES)
    num_rows = len(row_labels)
    fig, ax = plt.subplots(figsize=(12, 0.6 * num_rows + 1.6))
    split = plot_timeline(ax, bars, links, row_labels, replicated, makespan_s or 1.0)
    scale, _ = _time_unit(makespan_s or 1.0)
    for row, kind, at in marks:
        ax.plot(at * scale, row - 0.45, marker=MARKS[kind][0], color="black", markersize=4, linestyle="none")
    ax.set_title(title)
    shown = [k for k in (legend or COLOURS) if split or k != "weight grad"]
    handles = [Patch(color=COLOURS[k], label=k) for k in shown]
    handles += [plt.Line2D([], [], marker=MARKS[kind][0], color="black", linestyle="none", label=MARKS[kind][1])
                for kind in MARKS if any(k is kind for _, k, _ in marks)]
    ax.legend(handles=handles, loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if num_rows < 4 else -0.18), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        write_together([(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))])
    finally:
        plt.close(fig)


def plan_bars(plan: Plan, start_s: np.ndarray, durations_s: np.ndarray):
    """(bars, links, replicated regions) of a predicted timeline, as :func:`plot_timeline` takes them."""
    replicated = {p.region for p in plan.placement if p.layout is Layout.REPLICATED}
    bars = [(rank, plan.order.events[i], float(start_s[i]), float(durations_s[i]))
            for rank, nodes in enumerate(plan.order.nodes) for i in nodes]
    links = [(event.src[1], float(start_s[i]), float(durations_s[i]))
             for i, event in enumerate(plan.order.events) if isinstance(event, Coll)]
    return bars, links, replicated


def plot_timeline(ax, bars: list[tuple[int, Any, float, float]], links: list[tuple[int, float, float]],
                  row_labels: list[str], replicated: set[int], makespan: float) -> bool:
    """Draw ``bars`` (row, event, start, duration) on ranks and ``links`` (row, start, duration) thin
    under the row that sends them into ``ax``, in the unit ``makespan`` (seconds) reads best in;
    returns whether any weight gradient was drawn (a zero-bubble plan's)."""
    num_rows = len(row_labels)
    scale, unit = _time_unit(makespan)
    label_min = makespan * 0.012
    for row, event, start, duration in bars:
        category = _category(replicated, event)
        if category is None or duration <= 0:
            continue
        x, w = start * scale, duration * scale
        ax.barh(row, w, left=x, height=0.7, color=COLOURS[category], edgecolor="white", linewidth=0.4)
        if duration >= label_min and not isinstance(event, (DpReduce, Loss)):
            ax.text(x + w / 2, row, str(event.mb), ha="center", va="center", fontsize=6, color="black")
    for row, start, duration in links:
        if duration > 0:
            ax.barh(row + 0.42, duration * scale, left=start * scale, height=0.12, color=COLOURS["collective"])
    ax.set_yticks(range(num_rows), row_labels)
    ax.set_ylim(num_rows - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    return any(isinstance(event, Wgrad) for _, event, _, _ in bars)  # only zero-bubble plans have weight grads


def draw_prediction(prediction, path, title: str) -> None:
    """The predicted timeline of one prediction (a plan's first sampled step) as a Gantt picture, its step
    time in the title."""
    t = prediction.timeline
    draw_gantt(prediction.plan, t.start_s, t.durations_s, path, title=f"{title}: step {t.makespan_s * 1e3:.4g} ms",
               zero=zero_of(prediction.options), actions=action_spans(prediction.plan, t))
