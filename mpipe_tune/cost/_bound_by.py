"""What bounds each pipeline rank's step: compute, memory traffic, host issue or communication.

A rank's step is its events' seconds (its busy time) and its waits. Its compute events (forwards, backwards,
weight gradients, the loss) are split by the layer table's own split of each pass
(:attr:`~mpipe_tune.cost._layers.LayerTable.bound_s`: the seconds the compute roof, the memory roof, the host's
issue and the layer's collectives set) over the layers the rank holds and every microbatch; its transfers and
reduces are communication. The largest share names the bound. Waits (the bubble) bound nothing of the rank's
own: they are what the other ranks' bounds leave it.

>>> from mpipe_tune.algebra import Candidate
>>> from mpipe_tune.cost._framework import Framework
>>> from mpipe_tune.cost._predict import predict
>>> from mpipe_tune.cost import load_profile
>>> from mpipe_tune.inputs import load_model, Microbatch, Workload
>>> p = predict(Candidate("1f1b", (), pp=2, num_microbatches=2), load_model("tiny-vit-llm"),
...             Workload((Microbatch(0, 64),) * 2), load_profile("h100-sxm"), Framework(kernel_mode="eager"))
>>> [b.bound for b in rank_bounds(p)]
['host', 'host']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import BWD, COLL, FWD, LOSS, REDUCE, WGRAD

BOUNDS = ("compute", "memory", "host", "communication")
"""What can bound a rank's step, in :attr:`~mpipe_tune.cost._layers.LayerTable.bound_s`'s order."""


@dataclass(frozen=True)
class RankBound:
    """One rank's busy seconds by what set them, and the largest."""

    rank: int
    seconds: tuple[float, float, float, float]
    """Busy seconds by :data:`BOUNDS`."""

    @property
    def bound(self) -> str:
        return BOUNDS[int(np.argmax(self.seconds))] if any(self.seconds) else "idle"

    @property
    def share(self) -> float:
        """The bound's share of the rank's busy seconds (0 when idle)."""
        total = sum(self.seconds)
        return max(self.seconds) / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {"rank": self.rank, "bound": self.bound, "share": round(self.share, 4),
                **{f"{name}_s": value for name, value in zip(BOUNDS, self.seconds)}}


def rank_bounds(prediction) -> tuple[RankBound, ...]:
    """Per pipeline rank of ``prediction`` (a :class:`~mpipe_tune.cost._predictor.Prediction`), what bounds its
    step (see the module docstring)."""
    from mpipe_tune.cost._memory import rank_layers

    plan, table, durations = prediction.plan, prediction.table, prediction.timeline.durations_s
    kind = plan.order.columns.kind
    layers = rank_layers(plan)
    out = []
    for rank, nodes in enumerate(plan.order.nodes):
        nodes = np.asarray(nodes, dtype=np.int64)
        compute_s = float(durations[nodes[np.isin(kind[nodes], (FWD, BWD, WGRAD, LOSS))]].sum())
        comm_s = float(durations[nodes[np.isin(kind[nodes], (COLL, REDUCE))]].sum())
        shares = np.zeros(4)
        if table.bound_s is not None:
            for start, stop in layers[rank]:
                shares += [float(b[start:stop].sum()) for b in table.bound_s]
        if shares.sum() > 0:
            seconds = shares / shares.sum() * compute_s
        else:
            seconds = np.array([compute_s, 0.0, 0.0, 0.0])
        seconds[3] += comm_s
        out.append(RankBound(rank, tuple(float(x) for x in seconds)))
    return tuple(out)


def bound_text(bounds: tuple[RankBound, ...]) -> str:
    """One line: each rank's bound and its share, e.g. ``r0 host 71%, r1 compute 64%``."""
    return ", ".join(f"r{b.rank} {b.bound} {b.share:.0%}" for b in bounds)
