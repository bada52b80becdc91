"""Data-parallel reduces overlapped with compute, the reduce dtype, hierarchical all-reduce and the
profile's tensor-parallel overlap: closed forms (issue 16, item 3)."""

import numpy as np
import pytest

from mpipe_tune.algebra import Degrees, Bwd, Cut, DpReduce, Fwd, Schedule, Skeleton, ArchCost, Layer, Model
from mpipe_tune.cost._durations import hierarchical_all_reduce_s
from mpipe_tune.cost import CostOptions
from mpipe_tune.cost._overlap import exposed_gather_s, exposed_reduce_s
from mpipe_tune.cost import LinkCost, estimate_collective_s, load_profile, parse_profile
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError

from conftest import predict_plan, with_link

HIDDEN = 256
MODEL = Model("tiny-dense", (
    Layer("embed", "llm", True, ArchCost("embedding", (("hidden", HIDDEN), ("vocab", 512)))),
    *(Layer(f"dec{i}", "llm", True, ArchCost("dense_block", (("ffn", 4 * HIDDEN), ("heads", 4), ("hidden", HIDDEN))))
      for i in range(4)),
    Layer("head", "llm", True, ArchCost("lm_head", (("hidden", HIDDEN), ("vocab", 512)))),
))
WORKLOAD = Workload(tuple(Microbatch(0, 512) for _ in range(4)), "uniform")
# Compute at the ideal profile's 1 PFLOP/s takes microseconds; a slow all-reduce makes the reduce comparable.
SLOW = LinkCost(0.0, 1e-9)


def free_update(profile):
    """``profile`` with an optimizer update too fast to see (1e300 B/s): the reduces' closed forms below
    read the rank's reduce events, which also carry its update (issue 14, mpipe_tune.cost._update)."""
    data = profile.to_dict()
    data["optimizer_update_bytes_per_s"] = {"value": 1e300, "source": "ideal"}
    return parse_profile(data, where="free update")


def run(options, profile=None, pp=1):
    profile = profile or free_update(with_link("all_reduce", SLOW))
    cut, schedule = Cut(()), Schedule((Skeleton("1f1b"),))
    return predict_plan(cut, schedule, MODEL, WORKLOAD, profile, pp, options=options)


def reduce_and_compute(result):
    events = result.plan.order.events
    d = result.timeline.durations_s
    reduce = sum(d[i] for i, e in enumerate(events) if isinstance(e, DpReduce))
    last_bwd = max((i for i, e in enumerate(events) if isinstance(e, Bwd)), key=lambda i: result.timeline.start_s[i])
    first_fwd = min((i for i, e in enumerate(events) if isinstance(e, Fwd)), key=lambda i: result.timeline.start_s[i])
    return reduce, d[last_bwd], d[first_fwd]


def test_closed_form_exposed_reduce():
    # one slab: the reduce starts once the first bucket (share q of the last backward w) is ready, and
    # its last bucket (q of the reduce R) leaves when the backward ends: exposed = max(0, q w + R - a, w + q R - a)
    a, w, r, q = 2.0, 1.0, 1.5, 0.2
    assert exposed_reduce_s([a], [w], [r], [q]) == pytest.approx(max(0.0, q * w + r - a, w + q * r - a))
    assert exposed_reduce_s([w], [w], [r], [q]) == pytest.approx(q * w + r - w)
    # two slabs on one comm stream: the second waits for the first
    assert exposed_reduce_s([3.0, 1.0], [1.0, 1.0], [2.5, 1.0], [1.0, 1.0]) == pytest.approx(1.5)
    # the whole buffer in one bucket (q = 1) cannot start before the backward ends: nothing hidden
    assert exposed_reduce_s([w], [w], [r], [1.0]) == pytest.approx(r)


def test_closed_form_exposed_gather():
    # the first slab's first bucket (q A_1) waits; later slabs are covered by compute before their forward
    assert exposed_gather_s([0.0, 5.0], [1.0, 1.0], [0.4, 0.4], [0.25, 0.25]) == pytest.approx(0.1)
    # the all-gathers queue: the second slab's finishes at A_1 + A_2 and must be in by b_2 + x_2
    assert exposed_gather_s([0.0, 0.5], [1.0, 1.0], [1.0, 2.0], [0.0, 0.0]) == pytest.approx(1.5)


def test_plain_dp_reduce_exposes_only_what_the_last_backward_does_not_hide():
    options = CostOptions(shard_optimizer=False, dp_bucket_params=1e4, degrees=Degrees(1, dp=4))
    serial = run(CostOptions(shard_optimizer=False, overlap_dp_comm=False, degrees=Degrees(1, dp=4)))
    whole, _, _ = reduce_and_compute(serial)
    params = float(np.sum(serial.table.param_count))
    assert whole == pytest.approx(estimate_collective_s(SLOW, "all_reduce", params * 4, 4), rel=1e-12)
    overlapped = run(options)
    exposed, w, _ = reduce_and_compute(overlapped)
    q = min(1.0, options.dp_bucket_params / params)
    assert exposed == pytest.approx(max(0.0, q * w + whole - w, w + q * whole - w), rel=1e-9)
    assert exposed < whole
    assert overlapped.timeline.makespan_s == pytest.approx(serial.timeline.makespan_s - whole + exposed, rel=1e-9)


def test_zero1_splits_reduce_scatter_into_backward_and_all_gather_into_forward():
    options = CostOptions(shard_optimizer=True, dp_bucket_params=1e4, degrees=Degrees(1, dp=4))
    whole, _, _ = reduce_and_compute(run(CostOptions(shard_optimizer=True, overlap_dp_comm=False,
                                                     degrees=Degrees(1, dp=4))))
    exposed, w, x = reduce_and_compute(run(options))
    params = float(np.sum(run(options).table.param_count))
    q = min(1.0, options.dp_bucket_params / params)
    reduce_scatter = gather = whole / 2
    expected = max(0.0, q * w + reduce_scatter - w, w + q * reduce_scatter - w) \
        + max(0.0, q * gather, gather - x)
    assert exposed == pytest.approx(expected, rel=1e-9)


def test_grad_reduce_dtype_bf16_halves_the_reduced_bytes():
    fp32 = reduce_and_compute(run(CostOptions(overlap_dp_comm=False, degrees=Degrees(1, dp=4))))[0]
    bf16 = reduce_and_compute(run(CostOptions(overlap_dp_comm=False, grad_reduce_dtype="bf16",
                                              degrees=Degrees(1, dp=4))))[0]
    assert bf16 == pytest.approx(fp32 / 2, rel=1e-12)  # alpha is 0: time is linear in bytes
    with pytest.raises(MpipeError, match="gradient reduce dtype 'fp8'.*use fp32 or bf16"):
        run(CostOptions(grad_reduce_dtype="fp8", degrees=Degrees(1, dp=4)))


def test_hierarchical_all_reduce_is_intra_node_ring_plus_inter_node_share():
    h100 = load_profile("h100-sxm")
    intra, inter = h100.link("all_reduce"), h100.link("all_reduce", inter_node=True)
    n = 4e9
    # 32 ranks, one per device: 8 per node on 4 nodes
    expected = estimate_collective_s(intra, "all_reduce", n, 8) + estimate_collective_s(inter, "all_reduce", n / 8, 4)
    assert hierarchical_all_reduce_s(h100, n, 32, 1) == pytest.approx(expected, rel=1e-12)
    # stride 8 (tp 8): one member per node, the flat inter-node ring
    assert hierarchical_all_reduce_s(h100, n, 4, 8) == pytest.approx(
        estimate_collective_s(inter, "all_reduce", n, 4), rel=1e-12)
    # inside one node: the intra-node ring
    assert hierarchical_all_reduce_s(h100, n, 4, 2) == pytest.approx(
        estimate_collective_s(intra, "all_reduce", n, 4), rel=1e-12)


def test_profile_tp_comm_overlap_hides_that_share_of_the_tp_all_reduces():
    base = with_link("all_reduce", SLOW)
    data = base.to_dict()
    data["tp_comm_overlap"] = {"value": 0.75, "source": "assumed", "ref": "test"}
    overlapped = parse_profile(data, where="test")
    assert parse_profile(overlapped.to_dict(), where="again") == overlapped
    options = CostOptions(degrees=Degrees(1, tp=2))
    exposed = run(options, base).table.fwd_s
    hidden = run(options, overlapped).table.fwd_s
    no_tp_comm = run(options, with_link("all_reduce", LinkCost(0.0, 0.0))).table.fwd_s
    np.testing.assert_allclose(hidden - no_tp_comm, 0.25 * (exposed - no_tp_comm), rtol=1e-9)
    data["tp_comm_overlap"]["value"] = 1.5
    with pytest.raises(MpipeError, match=r"tp_comm_overlap.value = 1.5: must lie in \[0, 1\]"):
        parse_profile(data, where="test")
