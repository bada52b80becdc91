"""Event columns read off a derived order, against the event objects themselves."""

from mpipe_tune.algebra import Bwd, Coll, Cut, DpReduce, Fwd, Loss, parse_schedule
from mpipe_tune.cost._event_arrays import BARRIER, BWD, COLL, COMMS, FWD, LOSS, REDUCE, EventArrays
from mpipe_tune.cost import load_profile

from conftest import make_model, uniform_workload, predict_plan


def test_columns_describe_every_event_and_slab():
    model = make_model(["encoder"] * 2 + ["llm"] * 6)
    plan = predict_plan(Cut((2, 5)), parse_schedule("transpose,1f1b,1f1b"), model, uniform_workload(4),
                   load_profile("ideal"), 2, microbatch_owners=(1, 0, 0, 1)).plan
    a = EventArrays.of(plan)
    assert a.source_region == 1
    for i, e in enumerate(plan.order.events):
        if isinstance(e, (Fwd, Bwd)):
            assert (a.kind[i], a.region[i], a.rank[i], a.mb[i]) == (FWD if isinstance(e, Fwd) else BWD, *e[:3])
            assert (a.slab_lo[e.region, e.rank], a.slab_hi[e.region, e.rank]) == plan.slab(e.region, e.rank)
        elif isinstance(e, Coll):
            assert a.kind[i] == COLL and COMMS[a.comm[i]] is e.comm and a.mb[i] == e.mb
            assert (a.region[i], a.rank[i], a.other_region[i], a.other_rank[i]) == (*e.src, *e.dst)
        elif isinstance(e, DpReduce):
            assert a.kind[i] == REDUCE and a.region[i] == e.region and a.rank[i] == (-1 if e.rank is None else e.rank)
        elif isinstance(e, Loss):
            assert a.kind[i] == LOSS and a.mb[i] == e.mb
        else:
            assert a.kind[i] == BARRIER
    assert list(zip(a.edge_src.tolist(), a.edge_dst.tolist())) == [(s, t) for s, t, _ in plan.order.edges]
    assert [n.tolist() for n in a.nodes] == [list(n) for n in plan.order.nodes]
    assert a.is_encode().tolist() == [isinstance(e, Fwd) and e.region == 1 for e in plan.order.events]
    table = a.index_of(BWD)
    assert all(table[e.region, e.rank, e.mb] == i for i, e in enumerate(plan.order.events) if isinstance(e, Bwd))
