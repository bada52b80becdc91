"""ZeRO-2 with its reduce-scatters deferred (``defer_gradient_reduce``, the Llama 3 paper's asynchronous FSDP):
a backward's last reduce-scatter is waited for where the rank's next backward ends, not at its own end."""

import copy

import numpy as np
import pytest

from mpipe_tune.algebra import Bwd, Cut, Degrees, Model, Schedule, Skeleton
from mpipe_tune.cost import Framework, load_profile, parse_profile
from mpipe_tune.inputs import load_model

from conftest import charged_s, predict_plan, uniform_workload

H100 = load_profile("h100-sxm")
BACKBONE = Model("backbone", load_model("tiny-vit-llm").layers[4:])


def slow_links(factor: float):
    """H100 whose NVLink moves ``factor`` times fewer bytes a second: the reduce-scatters outlast the compute."""
    data = copy.deepcopy(H100.to_dict())
    for entry in data["links"]["intra_node"].values():
        entry["beta_s_per_byte"] *= factor
    return parse_profile(data, where="test")


def options(zero: int, defer: bool = False):
    return Framework(defer_gradient_reduce=defer).cost_options(Degrees(1, dp=4), zero_stage=zero)


def run(opts, profile=H100, M=4):
    return predict_plan(Cut(()), Schedule((Skeleton("1f1b"),)), BACKBONE, uniform_workload(M, 0, 64), profile, 2,
                        slab_counts=((3, 3),), options=opts)


@pytest.mark.parametrize("factor", [1.0, 1e3])
def test_deferring_lies_between_stage1_and_waiting_at_each_backwards_end(factor):
    profile = slow_links(factor)
    one, waited, deferred = (run(o, profile) for o in (options(1), options(2), options(2, defer=True)))
    assert one.timeline.makespan_s <= deferred.timeline.makespan_s <= waited.timeline.makespan_s
    if factor > 1:  # the pending reduce-scatters outlast the next forward and backward: the step waits on them
        assert one.timeline.makespan_s < deferred.timeline.makespan_s < waited.timeline.makespan_s


def test_a_ranks_first_backward_waits_for_nothing_and_the_next_for_what_its_compute_leaves():
    """On each rank the first backward's action holds only the slab's own stream wait (nothing is pending);
    every later one's wait is the previous reduce-scatter less the compute since that backward ended."""
    profile = slow_links(1e4)  # each reduce-scatter outlasts the forward and backward that follow it
    deferred = run(options(2, defer=True), profile)
    waited = run(options(2), profile)
    events = deferred.plan.order.events
    extra_deferred = charged_s(deferred) - deferred.timeline.durations_s
    extra_waited = charged_s(waited) - waited.timeline.durations_s
    for rank in range(2):
        backwards = [i for i in deferred.plan.order.nodes[rank] if isinstance(events[i], Bwd)]
        assert extra_deferred[backwards[0]] < extra_waited[backwards[0]]
        assert all(extra_deferred[i] > 0.0 for i in backwards[1:])


def test_a_deferred_reduce_holds_one_more_full_gradient():
    waited, deferred = (run(o) for o in (options(2), options(2, defer=True)))
    params = waited.table.param_count / 1  # tp 1
    per_rank_largest = [max(params[0:3]) * 4.0, max(params[3:6]) * 4.0]  # fp32 gradients, slabs of 3 layers
    assert np.allclose(np.subtract(deferred.memory.static_bytes, waited.memory.static_bytes), per_rank_largest)
