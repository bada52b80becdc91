"""derive's order equals a straightforward reference build over a few hundred random small candidates.

derive builds microbatch 0's dataflow once and repeats it for every microbatch as index arrays,
lowers each rank's program straight to event indices and sorts with Kahn over edge columns. The
reference here is the plain build those replace: every microbatch's edges added to a dictionary of
events and a dictionary of edges (first kind wins), each rank's event list built as event objects and
joined by Sequence edges through the same dictionaries, then Kahn's algorithm over Python lists.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpipe_tune.algebra import (
    Bwd, Cut, DpReduce, EdgeKind, Fwd, Group, Layout, Loss, Owners, Schedule, Skeleton, StepBarrier, Wgrad, derive,
)
from mpipe_tune.algebra._derive import _microbatch_edges, rank_program, stage_gates, topological_order
from mpipe_tune.algebra import is_interleavable

from conftest import make_model


class ReferenceBuilder:
    """Events in order of first use, edges in order of first insertion, by dictionary look-up."""

    def __init__(self) -> None:
        self.index: dict = {}
        self.edges: dict = {}

    def add(self, event) -> int:
        return self.index.setdefault(event, len(self.index))

    def edge(self, src, dst, kind) -> None:
        self.edges.setdefault((self.add(src), self.add(dst)), kind)


def reference_rank_events(plan, rank, gates, skeleton):
    source, sharded = plan.source, plan.sharded_regions()
    P, M, v = plan.num_ranks, plan.num_microbatches, len(sharded)
    seq = []
    if source:
        seq += [Fwd(source.region, rank, m) for m in range(M) if source.owner.owners[m] == rank]
    for op, chunk, m in rank_program(skeleton, rank, P, M, v):
        stage = (sharded[chunk], rank)
        if op == "F":
            seq.append(Fwd(*stage, m))
            if stage == plan.stages[-1]:
                seq.append(Loss(m))
        elif op == "B" and gates.has_bwd[stage]:
            seq.append(Bwd(*stage, m))
        elif op == "W" and gates.reduces[stage]:
            seq.append(Wgrad(*stage, m))
    if gates.source_bwd:
        seq += [Bwd(source.region, rank, m) for m in range(M) if source.owner.owners[m] == rank]
    if gates.replica_reduce is not None:
        seq.append(gates.replica_reduce)
    seq += [DpReduce(j, Group.DATA, rank) for j in sharded if gates.reduces[(j, rank)]]
    return seq + [StepBarrier()]


def reference_kahn(num_events, edges):
    indegree = [0] * num_events
    succ = [[] for _ in range(num_events)]
    for s, t, _ in edges:
        succ[s].append(t)
        indegree[t] += 1
    ready = [i for i in reversed(range(num_events)) if indegree[i] == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for t in succ[i]:
            indegree[t] -= 1
            if indegree[t] == 0:
                ready.append(t)
    return order


def reference_order(plan, model):
    """(events, edges, nodes, topo) of ``plan``'s placement, built the plain way."""
    stages = list(plan.stages)
    gates = stage_gates(model, plan.placement, stages)
    owners = plan.source.owner.owners if plan.source else ()
    skeleton = next(s for s in plan.schedule.skeletons if s.layout is Layout.SHARDED)
    b = ReferenceBuilder()
    for m in range(plan.num_microbatches):
        _microbatch_edges(b, m, gates, owners, skeleton.splits_backward)
    for key in [e for e in b.index if isinstance(e, DpReduce)]:
        b.edge(key, StepBarrier(), EdgeKind.SEQUENCE)
    nodes = []
    for rank in range(plan.num_ranks):
        ids = [b.add(e) for e in reference_rank_events(plan, rank, gates, skeleton)]
        for pair in zip(ids, ids[1:]):
            b.edges.setdefault(pair, EdgeKind.SEQUENCE)
        nodes.append(tuple(ids))
    edges = tuple((s, t, kind) for (s, t), kind in b.edges.items())
    return tuple(b.index), edges, tuple(nodes), tuple(reference_kahn(len(b.index), edges))


def random_candidate(rng, zero_bubble=False):
    """A random small candidate: skeleton, wavefront width, transpose, P, M, slab cuts, owners and
    trainable bits (at least one trainable layer); with ``zero_bubble`` the skeleton is zb1p or zbv."""
    P = int(rng.integers(1, 5))
    skeleton = Skeleton.ONE_F_ONE_B if rng.random() < 0.6 else Skeleton.GPIPE
    v = int(rng.integers(1, 4))
    if zero_bubble:
        skeleton = Skeleton.ZB1P if skeleton is Skeleton.ONE_F_ONE_B else Skeleton.ZBV
        v = 2 if skeleton is Skeleton.ZBV else v
    M = int(rng.integers(1, 3 * P + 3))
    if skeleton.runs_in_rounds and v > 1:
        M = int(rng.choice([m for m in range(1, 3 * P + 3) if is_interleavable(P, m)]))
    transpose = bool(rng.random() < 0.6)
    enc = int(rng.integers(1, 4)) if transpose else 0
    sizes = [int(rng.integers(P, P + 4)) for _ in range(v)]
    trainable = rng.random(enc + sum(sizes)) < 0.7
    if not trainable.any():
        trainable[int(rng.integers(0, len(trainable)))] = True
    model = make_model(["encoder"] * enc + ["llm"] * sum(sizes), trainable=[bool(t) for t in trainable])
    bounds = ([enc] if transpose else []) + [enc + int(x) for x in np.cumsum(sizes)[:-1]]
    schedule = Schedule(((Skeleton.TRANSPOSE,) if transpose else ()) + (skeleton,) * v)
    slab_counts = tuple(tuple(int(c) for c in 1 + rng.multinomial(size - P, [1 / P] * P)) for size in sizes)
    owners = tuple(int(r) for r in rng.integers(0, P, M)) if transpose and rng.random() < 0.7 else None
    return Cut(tuple(bounds)), schedule, model, P, M, Owners(slab_counts=slab_counts, microbatch=owners)


@pytest.mark.parametrize("seed", range(300))
def test_derive_equals_the_plain_reference_build(seed):
    assert_derive_equals_reference(random_candidate(np.random.default_rng(seed)))


@pytest.mark.parametrize("seed", range(150))
def test_zero_bubble_derive_equals_the_plain_reference_build(seed):
    """Split backwards (Wgrad events, V placement) too: the same plain build with the W ops."""
    assert_derive_equals_reference(random_candidate(np.random.default_rng(seed), zero_bubble=True))


def assert_derive_equals_reference(candidate):
    cut, schedule, model, P, M, owners = candidate
    plan = derive(cut, schedule, model, P, M, owners)
    events, edges, nodes, topo = reference_order(plan, model)
    assert plan.order.events == events
    assert plan.order.edges == edges
    assert plan.order.nodes == nodes
    assert plan.order.topo == topo
    assert tuple(topological_order(len(events), edges)) == topo


def test_topological_order_reports_a_cycle():
    assert topological_order(3, [(0, 1, EdgeKind.SEQUENCE), (1, 2, EdgeKind.SEQUENCE), (2, 1, EdgeKind.SEQUENCE)]) is None
