"""Interior and sink transposes (``1f1b,transpose,1f1b``, ``1f1b,transpose``, ``transpose,1f1b,transpose``):
placement, seams, footprints, and where the owners run their events."""

import networkx as nx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import (
    Bwd, Coll, Comm, Cut, DpReduce, EdgeKind, Fwd, Group, Layout, Loss, Owners, Schedule, Skeleton, StepBarrier,
    derive,
    parse_schedule,
)
from mpipe_tune.algebra import is_interleavable
from mpipe_tune.cost import longest_path_reference
from mpipe_tune.cost._timing import CompiledOrder
from mpipe_tune.errors import MpipeError, NotSupportedError

from conftest import make_model

T = Skeleton.TRANSPOSE


def model_of(sizes, trainable=None):
    """One block per region size (``llm`` throughout: the blocks do not matter to derive)."""
    n = sum(sizes)
    return make_model(["llm"] * n, trainable=trainable or [True] * n)


def cut_of(sizes):
    return Cut(tuple(int(b) for b in np.cumsum(sizes)[:-1]))


def strs(plan, rank):
    return [str(e) for e in plan.nodes(rank)]


def test_sink_transpose_scatters_to_the_owner_which_runs_forward_loss_and_backward_together():
    owners = (1, 0, 0, 1)
    plan = derive(cut_of([4, 1]), parse_schedule("1f1b,transpose"), model_of([4, 1]), 2, 4, Owners(microbatch=owners))
    (seam,) = plan.collectives.seams
    assert (seam.fwd, seam.bwd) == (Comm.SCATTER, Comm.GATHER)
    assert plan.collectives.reduces == ((1, Group.DATA), (2, Group.REPLICA))
    assert plan.placement[1].owner.owners == owners
    index = plan.index
    for m, o in enumerate(owners):
        assert Coll(Comm.SCATTER, (1, 1), (2, o), m) in index and Coll(Comm.GATHER, (2, o), (1, 1), m) in index
        nodes = strs(plan, o)
        at = nodes.index(f"F2.{o}#{m}")
        # the loss is the sink's; its turnaround runs at once on the owner
        assert nodes[at:at + 3] == [f"F2.{o}#{m}", f"L#{m}", f"B2.{o}#{m}"]
    for r in range(2):
        assert strs(plan, r)[-3:] == [f"reduce(1,data,r{r})", "reduce(2,replica)", "barrier"]


def test_interior_transpose_runs_each_microbatch_on_its_owner_between_the_two_wavefront_chunks():
    owners = (0, 1, 1, 0)
    plan = derive(cut_of([2, 1, 2]), parse_schedule("1f1b,transpose,1f1b"), model_of([2, 1, 2]), 2, 4,
                  Owners(microbatch=owners))
    assert [(s.fwd, s.bwd) for s in plan.collectives.seams] == [(Comm.SCATTER, Comm.GATHER),
                                                               (Comm.GATHER, Comm.SCATTER)]
    assert plan.stages == ((1, 0), (1, 1), (3, 0), (3, 1))  # the two Sharded regions woven, v = 2
    g = plan.graph()
    for m, o in enumerate(owners):
        path = [Fwd(1, 1, m), Coll(Comm.SCATTER, (1, 1), (2, o), m), Fwd(2, o, m),
                Coll(Comm.GATHER, (2, o), (3, 0), m), Fwd(3, 0, m)]
        assert all(g.edges[a, b]["kind"] is EdgeKind.ACTIVATION for a, b in zip(path, path[1:]))
        back = [Bwd(3, 0, m), Coll(Comm.SCATTER, (3, 0), (2, o), m), Bwd(2, o, m),
                Coll(Comm.GATHER, (2, o), (1, 1), m), Bwd(1, 1, m)]
        assert all(g.edges[a, b]["kind"] is EdgeKind.GRADIENT for a, b in zip(back, back[1:]))
    # the loss stays on the last Sharded stage; the interior region's events are on their owners only
    assert all(f"L#{m}" in strs(plan, 1) for m in range(4))
    for r in range(2):
        mine = [e for e in plan.nodes(r) if isinstance(e, (Fwd, Bwd)) and e.region == 2]
        assert sorted((e.mb, type(e).__name__) for e in mine) == sorted(
            (m, kind) for m in range(4) if owners[m] == r for kind in ("Fwd", "Bwd"))


def test_an_owned_event_runs_where_its_input_arrives_in_the_owner_s_idle_time():
    """P=2, M=4, 1f1b over [2 | 1 | 2] layers, round-robin owners: each owner runs its region-2 forward
    as soon as the Scatter from rank 1 lands, while its next program event (the second chunk's forward)
    still waits for that very output (rank 0) or for rank 0 (rank 1)."""
    plan = derive(cut_of([2, 1, 2]), parse_schedule("1f1b,transpose,1f1b"), model_of([2, 1, 2]), 2, 4)
    assert strs(plan, 0)[:4] == ["F1.0#0", "F1.0#1", "F2.0#0", "F3.0#0"]
    assert strs(plan, 1)[:4] == ["F1.1#0", "F1.1#1", "F2.1#1", "F3.1#0"]


def test_generator_head_shares_the_encoder_s_owner_map():
    owners = (2, 0, 1, 2, 0, 1)
    sizes = [1, 6, 1]
    plan = derive(cut_of(sizes), parse_schedule("transpose,1f1b,transpose"), model_of(sizes), 3, 6,
                  Owners(microbatch=owners))
    assert plan.source.region == 1 and [p.region for p in plan.inner_transposes] == [3]
    for m, o in enumerate(owners):
        assert {str(e) for e in plan.nodes(o)} >= {f"F1.{o}#{m}", f"F3.{o}#{m}", f"L#{m}", f"B3.{o}#{m}",
                                                   f"B1.{o}#{m}"}
    # the source keeps its placement: encodes first, encoder backwards in the cooldown
    for r in range(3):
        nodes = strs(plan, r)
        mine = [m for m, o in enumerate(owners) if o == r]
        assert nodes[:len(mine)] == [f"F1.{r}#{m}" for m in mine]
        assert nodes[-4 - len(mine):-4] == [f"B1.{r}#{m}" for m in mine]
        assert nodes[-4:] == ["reduce(1,replica)", f"reduce(2,data,r{r})", "reduce(3,replica)", "barrier"]


def test_footprint_with_frozen_blocks_reads_trainable_bits_only():
    """Lemma 1 through a Replicated region: a frozen interior region still passes gradients to a
    trainable region before it (its backward runs, no reduce); a frozen first region sends none."""
    def plan(text, trainable, sizes=(2, 1, 2)):
        return derive(cut_of(sizes), parse_schedule(text), model_of(sizes, trainable), 2, 4)

    frozen_mid = plan("1f1b,transpose,1f1b", [True, True, False, True, True])
    assert [s.bwd for s in frozen_mid.collectives.seams] == [Comm.GATHER, Comm.SCATTER]
    assert frozen_mid.collectives.reduces == ((1, Group.DATA), (3, Group.DATA))
    assert Bwd(2, 0, 0) in frozen_mid.index and DpReduce(2, Group.REPLICA) not in frozen_mid.index
    frozen_first = plan("1f1b,transpose,1f1b", [False, False, True, True, True])
    assert [s.bwd for s in frozen_first.collectives.seams] == [None, Comm.SCATTER]
    assert not any(isinstance(e, Bwd) and e.region == 1 for e in frozen_first.order.events)
    assert not any(isinstance(e, Coll) and e.comm is Comm.GATHER and e.dst[0] == 1 for e in frozen_first.order.events)
    # Corollary 1: the same cut has the same footprint under every skeleton list
    for trainable in ([True] * 2 + [False] * 2 + [True] * 2, [False] * 2 + [True] * 4, [False] * 4 + [True] * 2):
        footprints = {(tuple(s.bwd is not None for s in p.collectives.seams), tuple(j for j, _ in p.collectives.reduces))
                      for p in (plan(t, trainable, (2, 2, 2)) for t in (
                          "1f1b,transpose,1f1b", "1f1b,1f1b,1f1b", "gpipe,transpose,gpipe", "transpose,1f1b,transpose",
                          "gpipe,gpipe,transpose", "transpose,gpipe,gpipe"))}
        assert len(footprints) == 1


def test_a_frozen_sink_head_still_turns_the_gradient_around():
    plan = derive(cut_of([4, 1]), parse_schedule("1f1b,transpose"), model_of([4, 1], [True] * 4 + [False]), 2, 4)
    assert plan.collectives.reduces == ((1, Group.DATA),)
    assert plan.collectives.seams[0].bwd is Comm.GATHER
    assert all(Bwd(2, m % 2, m) in plan.index for m in range(4))


@pytest.mark.parametrize("sched,sizes,P,M,error,match", [
    ("transpose", [3], 2, 4, NotSupportedError, "lone transpose.*not supported yet"),
    ("1f1b,transpose,gpipe", [2, 1, 2], 2, 4, NotSupportedError, "mixing 1f1b and gpipe"),
    ("1f1b,transpose,1f1b", [2, 1, 2], 2, 5, NotSupportedError, r"multiple of 2; got M=5"),
    ("1f1b,transpose,1f1b", [2, 1, 1], 2, 4, MpipeError, "region 3 .1f1b. has 1 layer"),
    ("1f1b,transpose,transpose", [2, 1, 1], 2, 4, MpipeError, "not normal form"),
])
def test_what_derive_still_refuses_names_the_problem(sched, sizes, P, M, error, match):
    with pytest.raises(error, match=match):
        derive(cut_of(sizes), parse_schedule(sched), model_of(sizes), P, M)


@st.composite
def transpose_cases(draw):
    """A random schedule with Replicated regions anywhere (source, between Sharded regions, sink)."""
    P = draw(st.integers(1, 4))
    skeleton = draw(st.sampled_from([Skeleton.ONE_F_ONE_B, Skeleton.GPIPE]))
    v = draw(st.integers(1, 3))
    M = draw(st.integers(1, 3 * P))
    if skeleton is Skeleton.ONE_F_ONE_B and v > 1:
        M = draw(st.integers(1, 3 * P).filter(lambda m: is_interleavable(P, m)))
    gaps = [draw(st.booleans()) for _ in range(v + 1)]  # a transpose before each Sharded region, and a sink
    if not any(gaps[1:]):
        gaps[draw(st.integers(1, v))] = True  # at least one interior or sink transpose
    skeletons, sizes = [], []
    for k in range(v + 1):
        if gaps[k]:
            skeletons.append(T)
            sizes.append(draw(st.integers(1, 2)))
        if k < v:
            skeletons.append(skeleton)
            sizes.append(draw(st.integers(P, P + 2)))
    trainable = draw(st.lists(st.booleans(), min_size=sum(sizes), max_size=sum(sizes)).filter(any))
    owners = tuple(draw(st.integers(0, P - 1)) for _ in range(M))
    return derive(cut_of(sizes), Schedule(tuple(skeletons)), model_of(sizes, trainable), P, M,
                  Owners(microbatch=owners)), owners


@given(transpose_cases())
def test_order_laws_with_interior_and_sink_transposes(case):
    plan, owners = case
    g = plan.graph()
    assert nx.is_directed_acyclic_graph(g)
    replicated = {p.region for p in plan.replicated}
    count = {}
    for r in range(plan.num_ranks):
        nodes = plan.nodes(r)
        assert all(g.has_edge(a, b) for a, b in zip(nodes, nodes[1:]))
        assert isinstance(nodes[-1], StepBarrier)
        for e in nodes:
            count[e] = count.get(e, 0) + 1
            if isinstance(e, (Fwd, Bwd)) and e.region in replicated:
                assert e.rank == owners[e.mb] == r
    sink = plan.placement[-1].layout is Layout.REPLICATED
    for e in plan.order.events:
        if isinstance(e, Coll):
            assert e not in count
            assert not (e.src[0] in replicated and e.dst[0] in replicated)
        elif isinstance(e, StepBarrier) or (isinstance(e, DpReduce) and e.group is Group.REPLICA):
            assert count[e] == plan.num_ranks
        else:
            assert count[e] == 1, e
        if isinstance(e, Bwd):
            assert nx.has_path(g, Fwd(e.region, e.rank, e.mb), e)
        if isinstance(e, Loss):
            (fwd,) = [p for p in g.predecessors(e) if isinstance(p, Fwd) and p.mb == e.mb]
            assert fwd.region == plan.placement[-1].region
            assert e in plan.nodes(owners[e.mb] if sink else plan.stages[-1][1])
    units = len(plan.stages) + len(replicated)
    assert sum(isinstance(e, Fwd) for e in plan.order.events) == units * plan.num_microbatches
    # the compiled longest path equals the networkx reference on these orders too
    durations = np.random.default_rng(len(plan.order.events)).uniform(0.1, 1.0, len(plan.order.events))
    makespan = CompiledOrder(plan).makespan(durations)
    assert max(longest_path_reference(plan, durations)) == pytest.approx(makespan, rel=1e-12)


def test_a_large_sink_plan_lists_every_event_once():
    """P=16, M=128 with a sink head: every stage event, the sink's forward, loss and backward per
    microbatch, and each rank's two reduces and barrier, on ranks."""
    sizes = [32, 1]
    plan = derive(cut_of(sizes), parse_schedule("1f1b,transpose"), model_of(sizes), 16, 128)
    assert sum(len(n) for n in plan.order.nodes) == 16 * 128 * 2 + 128 * 3 + 16 * 3


def test_an_encoder_backward_placement_beside_a_sink_transpose_is_refused_in_one_line():
    from mpipe_tune.algebra import EARLIEST, EncoderBackward

    sizes = (2, 4, 1)
    cooldown = derive(cut_of(sizes), parse_schedule("transpose,1f1b,transpose"), model_of(sizes), 2, 4)
    assert any(isinstance(e, Bwd) and e.region == 1 for e in cooldown.order.events)
    with pytest.raises(NotSupportedError, match="use the cooldown placement") as error:
        derive(cut_of(sizes), parse_schedule("transpose,1f1b,transpose"), model_of(sizes), 2, 4,
               encoder_backward=EncoderBackward(EARLIEST))
    assert "\n" not in str(error.value)
