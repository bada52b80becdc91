"""The plan report's pictures, drawn with matplotlib and returned as PNG bytes (embedded by
:mod:`mpipe_tune.report._html`): every stored plan's timeline on one time axis, per-rank memory
against the device's capacity, and the search's trials as step time against peak memory.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mpipe_tune.report._gantt import COLOURS, plan_bars, plot_timeline

GIB = 2.0**30


@dataclass(frozen=True)
class PlanFigureData:
    """What the pictures show of one stored plan."""

    name: str
    plan: object
    """The derived :class:`~mpipe_tune.algebra._plan.Plan` (placement and per-rank order)."""
    start_s: np.ndarray
    durations_s: np.ndarray
    makespan_s: float
    static_bytes: tuple[float, ...]
    peak_bytes: tuple[float, ...]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96)
    _pyplot().close(fig)
    return buffer.getvalue()


def timelines_png(plans: Sequence[PlanFigureData]) -> bytes:
    """One timeline per plan, stacked, on a shared time axis (the slowest plan's step sets its length)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    heights = [0.45 * p.plan.num_ranks + 0.7 for p in plans]
    fig, axes = plt.subplots(len(plans), 1, figsize=(12, sum(heights) + 1.2), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    longest = max(p.makespan_s for p in plans) or 1.0
    split = False
    for ax, p in zip(axes[:, 0], plans):
        bars, links, replicated = plan_bars(p.plan, p.start_s, p.durations_s)
        split |= plot_timeline(ax, bars, links, [f"r{r}" for r in range(p.plan.num_ranks)], replicated, longest)
        ax.set_title(f"{p.name}: <{p.plan.schedule}>  step {p.makespan_s * 1e3:.4g} ms", fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.label_outer()
    shown = [k for k in COLOURS if split or k != "weight grad"]
    fig.legend(handles=[Patch(color=COLOURS[k], label=k) for k in shown], loc="lower center", ncol=len(shown),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _png(fig)


def memory_png(plans: Sequence[PlanFigureData], capacity_bytes: float) -> bytes:
    """Each plan's per-rank peak memory (static part and activations) against the device's capacity."""
    plt = _pyplot()
    columns = min(4, len(plans))
    rows = -(-len(plans) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.4 * rows + 0.4), sharey=True, squeeze=False)
    top = max(capacity_bytes, *(max(p.peak_bytes) for p in plans)) / GIB * 1.08
    for ax, p in zip(axes.flat, plans):
        ranks = np.arange(len(p.peak_bytes))
        static = np.array(p.static_bytes) / GIB
        peak = np.array(p.peak_bytes) / GIB
        over = peak > capacity_bytes / GIB
        ax.bar(ranks, static, color="#8e6bbf", label="static")
        ax.bar(ranks, peak - static, bottom=static, color=np.where(over, "#c8553d", "#4f86c6"), label="activations")
        ax.axhline(capacity_bytes / GIB, color="black", linestyle="--", linewidth=1)
        ax.set_title(p.name + ("  (over capacity)" if over.any() else ""), fontsize=9)
        ax.set_xticks(ranks, [f"r{r}" for r in ranks], fontsize=7)
        ax.set_ylim(0, top)
    for ax in axes.flat[len(plans):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("GiB")
    axes.flat[0].legend(fontsize=7, frameon=False, loc="lower left")
    fig.suptitle(f"peak memory per pipeline rank; dashed: device capacity {capacity_bytes / GIB:.4g} GiB", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def trials_png(frame: pd.DataFrame, capacity_bytes: float, best_step_s: float, best_peak_bytes: float) -> bytes:
    """The study's trials: predicted step time against peak memory, the plan's winner marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    known = frame.dropna(subset=["step_s", "peak_bytes"])
    kind = known["fits_memory"].map({True: "fits", False: "over"}).fillna("unknown")
    for key, colour, label in (("fits", "#4f86c6", "fits memory"), ("over", "#c8553d", "over capacity"),
                               ("unknown", "#9a9a9a", "peak a bound only")):
        rows = known[kind == key]
        if len(rows):
            ax.scatter(rows["peak_bytes"] / GIB, rows["step_s"] * 1e3, s=14, alpha=0.7, color=colour, label=label)
    ax.scatter([best_peak_bytes / GIB], [best_step_s * 1e3], marker="*", s=260, color="#f2a541", edgecolor="black",
               zorder=5, label="best plan")
    ax.axvline(capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="capacity")
    ax.set_xlabel("predicted peak memory (GiB)")
    ax.set_ylabel("mean predicted step time (ms)")
    ax.set_title(f"{len(frame)} trials, {len(known)} with a step time and a peak")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _png(fig)
