"""A profile's ``fabric``: pods joined by an oversubscribed spine slow a data-parallel ring that leaves its pod
only where the rings leaving a pod ask more than the spine carries."""

from __future__ import annotations

import pytest

from mpipe_tune.cost._collectives import Fabric, spine_slowdown
from mpipe_tune.cost._profile import hierarchical_all_reduce_s, load_profile, parse_profile
from mpipe_tune.errors import MpipeError

POD, RATIO = 64, 4.0  # a small fabric: pods of 8 nodes, a 1:4 spine


def _with_fabric(pod=POD, ratio=RATIO):
    data = load_profile("h100-sxm").to_dict()
    data["fabric"] = {"devices_per_pod": {"value": pod, "source": "assumed", "ref": "test"},
                      "pod_oversubscription": {"value": ratio, "source": "assumed", "ref": "test"}}
    return parse_profile(data, where="test")


def test_a_data_parallel_group_spanning_pods_is_slower_than_one_inside_a_pod() -> None:
    """Eight members one every 32 devices span four pods; with 32 groups' rings leaving each pod against a
    spine of 64 / 4 = 16 links, each ring's inter-node bytes run 2x slower. The same group inside one pod
    (one member a node, 8 nodes) and the same group on the profile without a fabric see the NIC rate."""
    fabric, plain = _with_fabric(), load_profile("h100-sxm")
    n = 4e9
    assert hierarchical_all_reduce_s(fabric, n, 8, 8) == hierarchical_all_reduce_s(plain, n, 8, 8)
    across, flat = hierarchical_all_reduce_s(fabric, n, 8, 32), hierarchical_all_reduce_s(plain, n, 8, 32)
    inter = plain.link("all_reduce", inter_node=True)
    latency = 2 * 7 * inter.alpha_s
    assert across - latency == pytest.approx(2.0 * (flat - latency), rel=1e-12)
    assert hierarchical_all_reduce_s(fabric, n, 8, 32) > hierarchical_all_reduce_s(fabric, n, 8, 8)


def test_the_slowdown_is_the_rings_demand_over_the_spine_never_below_one_nor_above_the_ratio() -> None:
    pods = Fabric(3072, 7.0)
    # the Llama 3 paper's DP 64 over replicas of 128 GPUs: 128 rings a pod against 3072 / 7 = 439 spine links
    assert spine_slowdown(pods, 64, 128) == 1.0
    assert spine_slowdown(pods, 8, 1024) == pytest.approx(1024 * 7 / 3072)
    assert spine_slowdown(pods, 2, 3072) == 7.0 == spine_slowdown(pods, 2, 8192)
    assert spine_slowdown(None, 2, 8192) == 1.0


def test_the_fabric_round_trips_and_a_bad_one_is_refused_in_one_line() -> None:
    profile = _with_fabric()
    assert profile.fabric == Fabric(POD, RATIO)
    assert parse_profile(profile.to_dict(), where="again") == profile
    assert profile != load_profile("h100-sxm")  # the fabric is part of the content hash: caches tell them apart
    for pod, ratio, message in ((60, 4.0, "whole number of nodes"), (64, 0.5, "must be >= 1")):
        with pytest.raises(MpipeError, match=message):
            _with_fabric(pod, ratio)
