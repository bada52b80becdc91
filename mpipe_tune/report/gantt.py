"""Per-rank timeline pictures in the style of the paper's Figure 2.

One row per pipeline rank; encoder forwards, backbone forwards, backwards, encoder backwards and
reduces in distinct colours, microbatch numbers on the bars. Collectives occupy links, not ranks, so
they are drawn as thin bars under the row of the rank that sends them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.events import Bwd, Coll, DpReduce, Fwd, Loss
from mpipe_tune.algebra.schedule import Layout
from mpipe_tune.errors import MpipeError

COLOURS = {
    "encoder fwd": "#f2a541",
    "encoder bwd": "#c8553d",
    "forward": "#4f86c6",
    "backward": "#7bb661",
    "reduce": "#8e6bbf",
    "collective": "#9a9a9a",
}


def _category(plan: Plan, event) -> str | None:
    replicated = {p.region for p in plan.placement if p.layout is Layout.REPLICATED}
    if isinstance(event, Fwd):
        return "encoder fwd" if event.region in replicated else "forward"
    if isinstance(event, Bwd):
        return "encoder bwd" if event.region in replicated else "backward"
    if isinstance(event, DpReduce):
        return "reduce"
    if isinstance(event, Coll):
        return "collective"
    return None


def draw_gantt(plan: Plan, start_s: np.ndarray, durations_s: np.ndarray, path: str | os.PathLike, *, title: str = "") -> None:
    """Write a PNG (or any matplotlib format by suffix) of the per-rank timeline to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise MpipeError("--gantt needs matplotlib; install it with: pip install 'mpipe-tune[viz]'") from None
    path = Path(path)
    if not path.parent.exists():
        raise MpipeError(f"--gantt {path}: folder {path.parent} does not exist; create it or pick another path")
    makespan = float((start_s + durations_s).max(initial=0.0)) or 1.0
    fig, ax = plt.subplots(figsize=(12, 0.6 * plan.num_ranks + 1.6))
    scale, unit = (1e3, "ms") if makespan < 10 else (1.0, "s")
    label_min = makespan * 0.012
    for rank, nodes in enumerate(plan.order.nodes):
        for i in nodes:
            event = plan.order.events[i]
            category = _category(plan, event)
            if category is None or durations_s[i] <= 0:
                continue
            x, w = start_s[i] * scale, durations_s[i] * scale
            ax.barh(rank, w, left=x, height=0.7, color=COLOURS[category], edgecolor="white", linewidth=0.4)
            if durations_s[i] >= label_min and not isinstance(event, (DpReduce, Loss)):
                ax.text(x + w / 2, rank, str(event.mb), ha="center", va="center", fontsize=6, color="black")
    for i, event in enumerate(plan.order.events):
        if isinstance(event, Coll) and durations_s[i] > 0:
            ax.barh(event.src[1] + 0.42, durations_s[i] * scale, left=start_s[i] * scale, height=0.12,
                    color=COLOURS["collective"])
    ax.set_yticks(range(plan.num_ranks), [f"rank {r}" for r in range(plan.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"<{plan.schedule}>  P={plan.num_ranks}  M={plan.num_microbatches}  step {makespan * scale:.3g} {unit}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if plan.num_ranks < 4 else -0.18), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=".gantt-", suffix=path.suffix or ".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=130)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
