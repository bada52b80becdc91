"""Reading a step time off the order: longest path, per-rank busy time, bubble and spill.

Every rank runs one event at a time in its order; an event starts when its rank is free and all its
predecessors are done. With the per-rank Sequence edges in the graph this is exactly the longest
path through the node-weighted DAG: ``finish(e) = duration(e) + max(finish(p) for p in preds(e))``.

:class:`CompiledOrder` compiles an order once into flat integer arrays (a topological order, the
predecessors of each event, which rank runs it) so that evaluating new durations is one compiled
pass (:mod:`mpipe_tune.cost._kernels`) that touches no event objects; the networkx graph
(:func:`longest_path_reference`) stays as the readable reference and the two agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import topological_order, Plan
from mpipe_tune.cost import _kernels as kernels
from mpipe_tune.cost._event_arrays import FWD, EventArrays


def predecessor_lists(num_events: int, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Compressed predecessor lists: ``pred[ptr[e]:ptr[e + 1]]`` are the sources of edges into ``e``."""
    by_target = np.argsort(dst, kind="stable")
    ptr = np.zeros(num_events + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_events), out=ptr[1:])
    return ptr, np.ascontiguousarray(src[by_target], dtype=np.int64)


def _first_of_each(nodes: tuple[np.ndarray, ...], is_wanted: np.ndarray) -> np.ndarray:
    """Per rank, its first event that ``is_wanted`` (its first event when none is)."""
    flat = np.concatenate(nodes)
    starts = np.cumsum([0] + [len(x) for x in nodes[:-1]])
    position = np.where(is_wanted[flat], np.arange(len(flat)), len(flat))
    first = np.minimum.reduceat(position, starts)
    return flat[np.where(first < len(flat), first, starts)]


class CompiledOrder:
    """An order as arrays: a topological order, each event's predecessors, the rank that runs each
    event, and the encoder work and first backbone forward that the spill reads."""

    def __init__(self, plan: Plan, arrays: EventArrays | None = None) -> None:
        a = arrays or EventArrays.of(plan)
        n = len(a.kind)
        encode = a.is_encode()
        args = (a.edge_src, a.edge_dst, list(a.nodes), np.flatnonzero(encode),
                _first_of_each(a.nodes, (a.kind == FWD) & ~encode), a.source_region >= 0)
        topo = plan.order.columns.topo
        if len(topo) != n:  # an order built by hand, without its topological order
            self.__dict__.update(vars(CompiledOrder.from_arrays(n, *args)))
            return
        self._build(n, args[0], args[1], args[2], topo, *args[3:])

    @classmethod
    def from_arrays(cls, num_events: int, src: np.ndarray, dst: np.ndarray, nodes: list[np.ndarray],
                    encode: np.ndarray, first_forward: np.ndarray, has_source: bool) -> "CompiledOrder":
        """An order given as edges and per-rank event lists (its topological order computed here)."""
        out = cls.__new__(cls)
        topo = topological_order(num_events, np.ascontiguousarray(src, dtype=np.int64),
                                 np.ascontiguousarray(dst, dtype=np.int64))
        assert len(topo) == num_events, "a cyclic order"
        out._build(num_events, src, dst, nodes, topo, encode, first_forward, has_source)
        return out

    def _build(self, n, src, dst, nodes, topo, encode, first_forward, has_source) -> None:
        self.num_events, self.num_ranks = n, len(nodes)
        self.src, self.dst = src, dst
        self.nodes = nodes
        """Per rank, the indices of its events in the order it runs them."""
        self.topo = topo
        self.pred_ptr, self.pred_idx = predecessor_lists(n, src, dst)
        self.on_rank = np.concatenate(nodes) if nodes else np.zeros(0, dtype=np.int64)
        self.rank_of_on_rank = np.repeat(np.arange(len(nodes)), [len(x) for x in nodes])
        rank_of = np.full(n, -1, dtype=np.int64)
        rank_of[self.on_rank] = self.rank_of_on_rank
        self.encode = encode
        """The Replicated region's forwards (the encodes): empty without a transposed region."""
        self.encode_rank = rank_of[encode]
        self.first_forward = first_forward
        """Per rank, its first backbone (Sharded) forward."""
        self.has_source = has_source
        self._scratch = np.empty(n)

    def with_actions(self, at: np.ndarray, after: np.ndarray) -> "CompiledOrder":
        """This order with one more node per action, numbered from :attr:`num_events` on in the order of
        ``at``: action ``k`` runs on the rank of event ``at[k]``, right before it (``after[k]`` False: the
        rank's previous event, then the action, then the event) or right after it (then the rank's next
        event). Every edge stays; each action takes the sequence edges to its neighbours on the rank, so an
        event's edges to other ranks skip the actions beside it (:mod:`mpipe_tune.cost._sharding_events`)."""
        n, k = self.num_events, len(at)
        position = np.empty(n, dtype=np.int64)
        for nodes in self.nodes:
            position[nodes] = np.arange(len(nodes))
        rank_of = np.full(n, -1, dtype=np.int64)
        rank_of[self.on_rank] = self.rank_of_on_rank
        action_rank = rank_of[at]
        # Sort keys on a rank: before-actions of the event at position p, then the event, then its after-actions.
        action_key = 3 * position[at] + np.where(after, 2, 0)
        nodes, src, dst = [], [self.src], [self.dst]
        for r, events in enumerate(self.nodes):
            mine = np.flatnonzero(action_rank == r)
            keys = np.concatenate((3 * np.arange(len(events)) + 1, action_key[mine]))
            merged = np.concatenate((events, n + mine))[np.argsort(keys, kind="stable")]
            nodes.append(merged)
            touches = (merged[:-1] >= n) | (merged[1:] >= n)
            src.append(merged[:-1][touches])
            dst.append(merged[1:][touches])
        return CompiledOrder.from_arrays(n + k, np.concatenate(src), np.concatenate(dst), nodes, self.encode,
                                         self.first_forward, self.has_source)

    def finish_times(self, durations: np.ndarray) -> np.ndarray:
        """Finish time of every event (indexed like ``plan.order.events``)."""
        out = np.empty(self.num_events)
        kernels.finish_times(durations, self.topo, self.pred_ptr, self.pred_idx, out)
        return out

    def makespan(self, durations: np.ndarray) -> float:
        return float(kernels.finish_times(durations, self.topo, self.pred_ptr, self.pred_idx, self._scratch))

    def timeline(self, durations: np.ndarray) -> "Timeline":
        """Makespan, per-rank busy time and bubble, and the paper's spill ``max(0, E_r - w_r)``."""
        P = self.num_ranks
        finish = self.finish_times(durations)
        makespan = float(finish.max(initial=0.0))
        busy = np.bincount(self.rank_of_on_rank, weights=durations[self.on_rank], minlength=P)
        if not self.has_source:
            encoder = slack = np.zeros(P)
        else:
            encoder = np.bincount(self.encode_rank, weights=durations[self.encode], minlength=P)
            no_encoder = durations.copy()
            no_encoder[self.encode] = 0.0
            free = self.finish_times(no_encoder) - no_encoder
            slack = free[self.first_forward]
        encoder, slack, busy = encoder.tolist(), slack.tolist(), busy.tolist()
        return Timeline(
            makespan_s=makespan,
            busy_s=tuple(busy),
            bubble_s=tuple(makespan - b for b in busy),
            spill_s=tuple(max(0.0, e - w) for e, w in zip(encoder, slack)),
            encoder_s=tuple(encoder),
            warmup_slack_s=tuple(slack),
            start_s=finish - durations,
            finish_s=finish,
            durations_s=durations,
        )


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
    actions_s: np.ndarray | None = None
    """The per-microbatch sharding actions' seconds (:class:`~mpipe_tune.cost._sharding_events.ShardingEvents`,
    in its order); None without any."""
    actions_start_s: np.ndarray | None = None
    """When each of those actions starts."""
    actions_at: np.ndarray | None = None
    """The event each of those actions is placed at (before or after it, on its rank)."""

    def charged_s(self) -> np.ndarray:
        """Per event, its seconds with the sharding actions placed at it added: what its rank spends on it when
        FSDP2 runs the actions in the event's own hooks (the runtime's, and its emulation's, per-event time)."""
        if self.actions_s is None:
            return self.durations_s
        out = self.durations_s.copy()
        np.add.at(out, self.actions_at, self.actions_s)
        return out


