"""A measured link's sweep read for gradient reduces, and the reduce-scatter as a collective of its own: a
profile that measures both halves of a sharded reduce prices ZeRO's reduce-scatter and all-gather on their
own links; every other profile keeps two halves of its all-reduce."""

import doctest
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import Cut, Degrees, DpReduce, Schedule, Skeleton
from mpipe_tune.cost import CostOptions, LinkCost, load_profile, parse_profile
from mpipe_tune.cost import _collectives
from mpipe_tune.cost._collectives import estimate_collective_s, measured_collective_s, monotone_fit
from mpipe_tune.cost._profile import hierarchical_all_reduce_s, sharded_half_s
from mpipe_tune.errors import MpipeError

from conftest import predict_plan
from cost.test_overlap import MODEL, WORKLOAD, free_update

SIZES = [4096, 65536, 1048576, 16777216, 67108864]


def sweep_entry(alpha: float, beta: float, seconds: list[float], group: int = 2) -> dict:
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "source": "measured", "group_size": group,
            "sizes_bytes": list(SIZES), "median_s": list(seconds)}


def measured(entries: dict, profile=None):
    """``profile`` (default ``ideal``, its update free) with ``entries`` (collective -> link entry) on its
    intra-node links."""
    data = (profile or free_update(load_profile("ideal"))).to_dict()
    data["links"]["intra_node"].update(entries)
    return parse_profile(data, where="test")


def test_closed_forms_in_the_docstrings() -> None:
    assert doctest.testmod(_collectives).failed == 0


def test_the_sweep_is_read_at_its_own_collective_and_group_only() -> None:
    link = LinkCost(1e-4, 1e-9, curve=("reduce_scatter", 2, tuple(map(float, SIZES)), (1e-4, 2e-4, 1e-3, 0.015, 0.08)))
    assert measured_collective_s(link, "reduce_scatter", 16777216, 2) == pytest.approx(0.015)
    # 40 MiB lies between the last two sizes; past the last the last segment goes on
    assert measured_collective_s(link, "reduce_scatter", 41943040, 2) == pytest.approx(0.0475)
    assert measured_collective_s(link, "reduce_scatter", 2 * 67108864, 2) == pytest.approx(0.08 + 0.065 * 4 / 3)
    for collective, group in (("all_gather", 2), ("reduce_scatter", 4)):
        assert measured_collective_s(link, collective, 16777216, group) == estimate_collective_s(link, collective,
                                                                                                 16777216, group)
    sizes = np.array([4096.0, 16777216.0])
    assert measured_collective_s(link, "reduce_scatter", sizes, 2) == pytest.approx([1e-4, 0.015])


def test_a_run_of_falling_medians_is_read_at_its_mean_not_its_fastest() -> None:
    """A slow reading at a small size and fast ones above it (a bimodal latency) give the run's mean to all of
    them: neither the fast reading for the sizes below nor the slow one for those above."""
    link = LinkCost(0.0, 0.0, curve=("all_reduce", 2, tuple(map(float, SIZES)), (1e-3, 2e-4, 3e-4, 0.01, 0.04)))
    assert measured_collective_s(link, "all_reduce", np.array(SIZES[:3], dtype=float), 2) == pytest.approx([5e-4] * 3)
    assert measured_collective_s(link, "all_reduce", SIZES[3], 2) == pytest.approx(0.01)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20))
def test_the_monotone_fit_is_non_decreasing_keeps_the_sum_and_leaves_a_rising_sweep(values) -> None:
    fit = monotone_fit(values)
    assert np.all(np.diff(fit) >= -1e-12) and fit.sum() == pytest.approx(sum(values), abs=1e-9)
    rising = sorted(values)
    assert monotone_fit(rising) == pytest.approx(rising)


def test_a_profile_keeps_its_sweeps_through_a_round_trip() -> None:
    profile = measured({"all_reduce": sweep_entry(1e-4, 1e-9, [1e-4, 2e-4, 1e-3, 0.012, 0.04])})
    link = profile.link("all_reduce")
    assert link.curve == ("all_reduce", 2, tuple(map(float, SIZES)), (1e-4, 2e-4, 1e-3, 0.012, 0.04))
    assert parse_profile(profile.to_dict(), where="again") == profile
    assert profile.link("p2p").curve is None  # a stated link has no sweep
    assert hierarchical_all_reduce_s(profile, 16777216, 2, 1) == pytest.approx(0.012)  # the sweep, not the line


@pytest.mark.parametrize("change, message", [
    ({"median_s": [1e-4, 2e-4]}, r"links\.intra_node\.all_reduce\.median_s = .*must have one time per size \(5\)"),
    ({"sizes_bytes": [4096, 4096, 1e6, 2e6, 3e6]}, r"links\.intra_node\.all_reduce\.sizes_bytes = .*must increase"),
    ({"group_size": 1}, r"links\.intra_node\.all_reduce\.group_size = 1: must be an integer >= 2"),
    ({"group_size": None}, r"links\.intra_node\.all_reduce\.group_size = None: must be an integer >= 2"),
    ({"sizes_bytes": None}, r"links\.intra_node\.all_reduce\.sizes_bytes = None: must be a list of at least 2"),
    ({"median_s": "fast"}, r"links\.intra_node\.all_reduce\.median_s = 'fast': must be a list of at least 2"),
    ({"median_s": [1e-4, -1.0, 1e-3, 0.01, 0.04]}, r"links\.intra_node\.all_reduce\.median_s = -1\.0: must be > 0"),
])
def test_a_broken_sweep_is_one_line_naming_its_field(change: dict, message: str) -> None:
    entry = {**sweep_entry(1e-4, 1e-9, [1e-4, 2e-4, 1e-3, 0.012, 0.04]), **change}
    with pytest.raises(MpipeError, match=message) as info:
        measured({"all_reduce": entry})
    assert "\n" not in str(info.value) and "; " in str(info.value)  # one line, with its fix


def test_shipped_profiles_keep_two_halves_of_the_all_reduce() -> None:
    for name in ("h100-sxm", "ascend-910b", "cpu-generic"):
        profile = load_profile(name)
        for collective in ("reduce_scatter", "all_gather"):
            for group, stride in ((8, 1), (64, 8)):
                assert sharded_half_s(profile, collective, 4e9, group, stride) == \
                    hierarchical_all_reduce_s(profile, 4e9, group, stride) / 2


def test_a_profile_measuring_the_reduce_scatter_times_each_half_on_its_own_link() -> None:
    slow_scatter = [2e-4, 5e-4, 4e-3, 0.06, 0.3]
    profile = measured({"all_reduce": sweep_entry(1e-4, 1e-9, [1e-4, 2e-4, 1e-3, 0.012, 0.04]),
                        "all_gather": sweep_entry(1e-4, 1e-9, [1e-4, 2e-4, 1e-3, 0.01, 0.05]),
                        "reduce_scatter": sweep_entry(1e-4, 1e-9, slow_scatter)})
    assert sharded_half_s(profile, "reduce_scatter", 16777216, 2, 1) == pytest.approx(0.06)
    assert sharded_half_s(profile, "all_gather", 16777216, 2, 1) == pytest.approx(0.01)
    # a group the sweep did not measure: the fitted line of the same link
    assert sharded_half_s(profile, "reduce_scatter", 16777216, 4, 1) == pytest.approx(
        estimate_collective_s(profile.link("reduce_scatter"), "reduce_scatter", 16777216, 4))


def test_zero1_reduce_is_priced_on_the_measured_halves() -> None:
    """A data-parallel step at ZeRO-1 with no overlap: its reduce event lasts the measured reduce-scatter plus
    all-gather of the gradient bytes; at ZeRO-0 the measured all-reduce."""
    times = {"all_reduce": [1e-4, 2e-4, 1e-3, 0.012, 0.04], "all_gather": [1e-4, 2e-4, 1e-3, 0.01, 0.05],
             "reduce_scatter": [2e-4, 5e-4, 4e-3, 0.06, 0.3]}
    profile = measured({k: sweep_entry(1e-4, 1e-9, v) for k, v in times.items()})
    cut, schedule = Cut(()), Schedule((Skeleton("1f1b"),))

    def reduce_s(zero1: bool) -> tuple[float, float]:
        options = CostOptions(shard_optimizer=zero1, overlap_dp_comm=False, degrees=Degrees(1, dp=2))
        prediction = predict_plan(cut, schedule, MODEL, WORKLOAD, profile, 1, options=options)
        [index] = [i for i, e in enumerate(prediction.plan.order.events) if isinstance(e, DpReduce)]
        return prediction.timeline.durations_s[index], 4.0 * float(prediction.table.param_count.sum())

    (plain, gradients), (sharded, _) = reduce_s(False), reduce_s(True)
    link = {k: profile.link(k) for k in times}
    assert 1e6 < gradients < 67108864  # inside the sweep
    assert plain == pytest.approx(measured_collective_s(link["all_reduce"], "all_reduce", gradients, 2))
    assert sharded == pytest.approx(measured_collective_s(link["reduce_scatter"], "reduce_scatter", gradients, 2)
                                    + measured_collective_s(link["all_gather"], "all_gather", gradients, 2))
    assert sharded > 2 * plain


@pytest.mark.parametrize("zero_stage, copied_per_param", [(0, 4 * 4.0), (1, 2 * 4.0 + 4 * 4.0), (3, 0.0)])
def test_flat_buffer_copies_add_their_memory_traffic_to_the_reduce(zero_stage: int, copied_per_param: float) -> None:
    """torch DDP and the executor copy the gradients through flat buffers (in and out: each read once and
    written once), and a distributed optimizer's update the weights too; FSDP2's copies are not these."""
    from mpipe_tune.cost import Framework, predict
    from conftest import candidate

    profile = free_update(load_profile("ideal"))
    cut, schedule = Cut(()), Schedule((Skeleton("1f1b"),))

    def reduce_s(copies: bool, dp: int = 2) -> tuple[float, float]:
        framework = Framework(overlap_dp_comm=False, flat_buffer_copies=copies)
        options = framework.cost_options(Degrees(1, dp=dp), dtype="fp32", zero_stage=zero_stage)
        c = replace(candidate(cut, schedule, 1, len(WORKLOAD), options=options), zero_stage=zero_stage)
        prediction = predict(c, MODEL, WORKLOAD, profile, framework)
        [index] = [i for i, e in enumerate(prediction.plan.order.events) if isinstance(e, DpReduce)]
        return prediction.timeline.durations_s[index], float(prediction.table.param_count.sum())

    (copied, params), (plain, _) = reduce_s(True), reduce_s(False)
    assert copied - plain == pytest.approx(copied_per_param * params / profile.memory_bytes_per_s)
    assert reduce_s(True, dp=1)[0] == reduce_s(False, dp=1)[0]  # nothing reduces, nothing is copied
