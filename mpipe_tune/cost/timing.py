"""Reading a step time off the order: longest path, per-rank busy time, bubble and spill.

Every rank runs one event at a time in its order; an event starts when its rank is free and all its
predecessors are done. With the per-rank Sequence edges in the graph this is exactly the longest
path through the node-weighted DAG: ``finish(e) = duration(e) + max(finish(p) for p in preds(e))``.

:class:`CompiledOrder` compiles an order once into flat integer arrays (a topological order and the
predecessors of each event) so that evaluating new durations touches no event objects; the networkx
graph (:func:`longest_path_reference`) stays as the readable reference and the two must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra.derive import Plan
from mpipe_tune.algebra.events import Fwd
from mpipe_tune.algebra.schedule import Layout


class CompiledOrder:
    """An order as arrays: events in topological order and their predecessors."""

    def __init__(self, plan: Plan) -> None:
        n = len(plan.order.events)
        topo = plan.order.topo
        position = [0] * n
        for k, event in enumerate(topo):
            position[event] = k
        preds: list[list[int]] = [[] for _ in range(n)]
        for s, t, _ in plan.order.edges:
            preds[position[t]].append(position[s])
        self.num_events = n
        self.topo = np.array(topo, dtype=np.int64)
        # Predecessors in topological positions, for a loop over plain lists.
        self._preds = [tuple(p) for p in preds]

    def finish_times(self, durations: np.ndarray) -> np.ndarray:
        """Finish time of every event (indexed like ``plan.order.events``)."""
        d = durations[self.topo].tolist()
        finish = [0.0] * self.num_events
        for k, preds in enumerate(self._preds):
            start = 0.0
            for p in preds:
                f = finish[p]
                if f > start:
                    start = f
            finish[k] = start + d[k]
        out = np.empty(self.num_events)
        out[self.topo] = finish
        return out

    def makespan(self, durations: np.ndarray) -> float:
        return float(self.finish_times(durations).max(initial=0.0))


def longest_path_reference(plan: Plan, durations: np.ndarray) -> np.ndarray:
    """Finish times by networkx's topological sort over the event graph (the readable reference)."""
    import networkx as nx

    g = plan.graph()
    weight = {event: float(durations[i]) for i, event in enumerate(plan.order.events)}
    finish = {}
    for event in nx.topological_sort(g):
        finish[event] = weight[event] + max((finish[p] for p in g.predecessors(event)), default=0.0)
    return np.array([finish[event] for event in plan.order.events])


@dataclass(frozen=True)
class Timeline:
    """What a step's prediction reports. Seconds; per-rank tuples are indexed by pipeline rank."""

    makespan_s: float
    busy_s: tuple[float, ...]
    bubble_s: tuple[float, ...]
    spill_s: tuple[float, ...]
    encoder_s: tuple[float, ...]
    """E_r: the Replicated region's forward work on rank r."""
    warmup_slack_s: tuple[float, ...]
    """w_r: when rank r's first Sharded forward could start if it had no encoder work."""
    start_s: np.ndarray
    finish_s: np.ndarray
    durations_s: np.ndarray


def read_timeline(plan: Plan, durations: np.ndarray, compiled: CompiledOrder | None = None) -> Timeline:
    """Makespan, per-rank busy time and bubble, and the paper's spill ``max(0, E_r - w_r)``."""
    compiled = compiled or CompiledOrder(plan)
    finish = compiled.finish_times(durations)
    makespan = float(finish.max(initial=0.0))
    busy = tuple(float(durations[list(nodes)].sum()) for nodes in plan.order.nodes)
    source = plan.placement[0] if plan.placement[0].layout is Layout.REPLICATED else None
    encode = np.zeros(len(durations), dtype=bool)
    if source is not None:
        for i, event in enumerate(plan.order.events):
            encode[i] = isinstance(event, Fwd) and event.region == source.region
    encoder = tuple(float(durations[list(nodes)][encode[list(nodes)]].sum()) for nodes in plan.order.nodes)
    if source is None:
        slack = (0.0,) * plan.num_ranks
    else:
        no_encoder = np.where(encode, 0.0, durations)
        free = compiled.finish_times(no_encoder) - no_encoder
        slack = tuple(float(free[_first_sharded_forward(plan, nodes, encode)]) for nodes in plan.order.nodes)
    return Timeline(
        makespan_s=makespan,
        busy_s=busy,
        bubble_s=tuple(makespan - b for b in busy),
        spill_s=tuple(max(0.0, e - w) for e, w in zip(encoder, slack)),
        encoder_s=encoder,
        warmup_slack_s=slack,
        start_s=finish - durations,
        finish_s=finish,
        durations_s=durations,
    )


def _first_sharded_forward(plan: Plan, nodes: tuple[int, ...], encode: np.ndarray) -> int:
    return next(i for i in nodes if isinstance(plan.order.events[i], Fwd) and not encode[i])
