import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import (
    Bwd, Coll, Comm, Cut, DpReduce, Fwd, Group, Layout, Loss, Owners, Schedule, Skeleton, StepBarrier, derive,
    parse_schedule,
)
from mpipe_tune.algebra import is_interleavable
from mpipe_tune.errors import MpipeError, NotSupportedError

from conftest import make_model

ENC, LLM = 2, 8


def mllm(trainable_encoder=True):
    return make_model(["encoder"] * ENC + ["llm"] * LLM, trainable=[trainable_encoder] * ENC + [True] * LLM)


def test_transpose_1f1b_derives_gather_scatter_seam_and_both_reduces():
    plan = derive(Cut((ENC,)), parse_schedule("transpose,1f1b"), mllm(), 4, 8)
    assert plan.placement[0].layout is Layout.REPLICATED and plan.placement[1].layout is Layout.SHARDED
    (seam,) = plan.collectives.seams
    assert (seam.src_region, seam.dst_region, seam.fwd, seam.bwd) == (1, 2, Comm.GATHER, Comm.SCATTER)
    assert plan.collectives.reduces == ((1, Group.REPLICA), (2, Group.DATA))


def test_transpose_rank_order_encodes_first_then_wavefront_then_cooldown():
    plan = derive(Cut((ENC,)), parse_schedule("transpose,1f1b"), mllm(), 4, 8, Owners(microbatch=(0, 1, 2, 3, 3, 2, 1, 0)))
    nodes = [str(e) for e in plan.nodes(1)]
    assert nodes[:2] == ["F1.1#1", "F1.1#6"]
    assert nodes[2] == "F2.1#0"
    assert nodes[-5:] == ["B1.1#1", "B1.1#6", "reduce(1,replica)", "reduce(2,data,r1)", "barrier"]


def strip(plan, drop):
    return [[str(e) for e in plan.nodes(r) if not drop(e)] for r in range(plan.num_ranks)]


def test_freezing_the_encoder_removes_only_scatter_encoder_backward_and_replica_reduce():
    trained = derive(Cut((ENC,)), parse_schedule("transpose,1f1b"), mllm(True), 4, 8)
    frozen = derive(Cut((ENC,)), parse_schedule("transpose,1f1b"), mllm(False), 4, 8)

    def gated(e):
        return (isinstance(e, Coll) and e.comm is Comm.SCATTER) or (isinstance(e, Bwd) and e.region == 1) or (
            isinstance(e, DpReduce) and e.group is Group.REPLICA)

    removed = set(trained.order.events) - set(frozen.order.events)
    assert removed and all(gated(e) for e in removed)
    assert set(frozen.order.events) <= set(trained.order.events)
    assert strip(trained, gated) == strip(frozen, lambda e: False)
    assert frozen.collectives.seams[0].bwd is None
    assert frozen.collectives.reduces == ((2, Group.DATA),)
    assert frozen.placement == trained.placement


@pytest.mark.parametrize("trainable_encoder", [True, False])
def test_footprint_of_a_cut_is_the_same_under_every_skeleton_list(trainable_encoder):
    model = mllm(trainable_encoder)
    footprints = set()
    for text in ("transpose,1f1b", "1f1b,1f1b", "gpipe,gpipe", "transpose,gpipe"):
        plan = derive(Cut((ENC,)), parse_schedule(text), model, 2, 4)
        footprints.add((tuple(s.bwd is not None for s in plan.collectives.seams),
                        tuple(j for j, _ in plan.collectives.reduces)))
    assert len(footprints) == 1


def test_vpp_seams_are_send_recvgrad():
    plan = derive(Cut((4, 7)), parse_schedule("1f1b,1f1b,1f1b"), mllm(), 2, 4)
    assert [(s.fwd, s.bwd) for s in plan.collectives.seams] == [(Comm.SEND, Comm.RECV_GRAD)] * 2


@pytest.mark.parametrize("sched,cut,P,M,match", [
    ("transpose", (), 2, 4, "lone transpose.*not supported yet"),
    ("1f1b,gpipe", (4,), 2, 4, "mixing 1f1b and gpipe.*not supported yet"),
    ("1f1b,1f1b", (4,), 2, 5, r"2 rounds.*multiple of 2; got M=5, P=2 \(use M=4 or M=6\)"),
])
def test_unsupported_orders_are_refused_not_wrong(sched, cut, P, M, match):
    with pytest.raises(NotSupportedError, match=match):
        derive(Cut(cut), parse_schedule(sched), mllm(), P, M)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_ranks=0), "P must be an integer >= 1"),
    (dict(num_microbatches=0), "M must be an integer >= 1"),
    (dict(owners=Owners(microbatch=(0, 1, 5, 0))), "microbatch 2 is owned by rank 5.*0..3"),
    (dict(owners=Owners(microbatch=(0, 1))), "lists 2 rank"),
    (dict(owners=Owners(slab_counts=((1, 1, 1, 1),))), "summing to the region's 8 layers"),
    (dict(num_ranks=9), "region 2.*8 layer.*P=9"),
])
def test_bad_inputs_name_the_problem(kwargs, match):
    args = dict(cut=Cut((ENC,)), schedule=parse_schedule("transpose,1f1b"), model=mllm(), num_ranks=4, num_microbatches=4)
    args.update(kwargs)
    with pytest.raises(MpipeError, match=match):
        derive(**args)


def test_default_slabs_minimise_the_largest_slab():
    model = mllm()
    weights = (1.0,) * ENC + (1, 1, 1, 1, 1, 1, 1, 9)
    plan = derive(Cut((ENC,)), parse_schedule("transpose,1f1b"), model, 2, 2, Owners(layer_weights=weights))
    assert plan.placement[1].owner.counts() == (7, 1)


# --- properties over random models, cuts, schedules, P, M and owners ---------------------------------

@st.composite
def cases(draw):
    P = draw(st.integers(1, 4))
    skeleton = draw(st.sampled_from([Skeleton.ONE_F_ONE_B, Skeleton.GPIPE]))
    v = draw(st.integers(1, 3))
    transpose = draw(st.booleans())
    M = draw(st.integers(1, 6))
    if skeleton is Skeleton.ONE_F_ONE_B and v > 1:
        M = draw(st.integers(1, 3 * P).filter(lambda m: is_interleavable(P, m)))
    enc = draw(st.integers(1, 3)) if transpose else 0
    sizes = [draw(st.integers(P, P + 3)) for _ in range(v)]
    num_layers = enc + sum(sizes)
    trainable = draw(st.lists(st.booleans(), min_size=num_layers, max_size=num_layers).filter(any))
    blocks = ["encoder"] * enc + ["llm"] * sum(sizes)
    model = make_model(blocks, trainable=trainable)
    bounds, acc = [], enc
    if transpose:
        bounds.append(enc)
    for s in sizes[:-1]:
        acc += s
        bounds.append(acc)
    sched = Schedule(((Skeleton.TRANSPOSE,) if transpose else ()) + (skeleton,) * v)
    owners = tuple(draw(st.integers(0, P - 1)) for _ in range(M))
    return derive(Cut(tuple(bounds)), sched, model, P, M, Owners(microbatch=owners)), model


@given(cases())
def test_order_laws(case):
    plan, model = case
    g = plan.graph()
    assert nx.is_directed_acyclic_graph(g)
    # Every rank's order is a chain of the graph: consecutive events are joined.
    for r in range(plan.num_ranks):
        nodes = plan.nodes(r)
        assert len(set(nodes)) == len(nodes)
        assert all(g.has_edge(a, b) for a, b in zip(nodes, nodes[1:]))
    # No event lost or duplicated: compute and loss events on exactly one rank, collectives on none,
    # the replica reduce and the barrier on every rank.
    count = {}
    for r in range(plan.num_ranks):
        for e in plan.nodes(r):
            count[e] = count.get(e, 0) + 1
    for e in plan.order.events:
        if isinstance(e, Coll):
            assert e not in count
        elif isinstance(e, StepBarrier) or (isinstance(e, DpReduce) and e.group is Group.REPLICA):
            assert count[e] == plan.num_ranks
        else:
            assert count[e] == 1, e
    # Each microbatch's forward precedes its backward, on every stage that has one.
    for e in plan.order.events:
        if isinstance(e, Bwd):
            assert nx.has_path(g, Fwd(e.region, e.rank, e.mb), e)
    # Every microbatch is forwarded through every stage and reaches the loss.
    assert sum(isinstance(e, Loss) for e in plan.order.events) == plan.num_microbatches
    fwd_count = sum(isinstance(e, Fwd) for e in plan.order.events)
    per_mb = len(plan.stages) + (1 if plan.placement[0].layout is Layout.REPLICATED else 0)
    assert fwd_count == per_mb * plan.num_microbatches
