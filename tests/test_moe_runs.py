"""The published MoE runs bench_moe.py predicts: each with its citation, layout and stated MoE settings, and those
settings reaching the prediction."""

from dataclasses import replace

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    yield from benchmark_module("bench_moe")


def test_every_moe_run_is_cited_laid_out_and_split(bench) -> None:
    runs = bench.moe_runs()
    assert {r.suite for r in runs} >= {"dgxc-grok1-314b", "mindspeed-mixtral-8x7b"}
    for run in runs:
        assert run.source.startswith("https://") and run.table and run.step_time_s > 0
        assert run.devices == run.tp * run.pp * run.cp * run.dp and run.dp % run.ep == 0
        assert run.split in ("fit", "held_out")
    mixtral = next(r for r in runs if r.suite == "mindspeed-mixtral-8x7b")
    assert (mixtral.moe_dispatcher, mixtral.moe_capacity_factor) == ("allgather", None)  # core_r0.6's default


def test_the_stated_dispatch_reaches_the_prediction(bench) -> None:
    """Grok-1's runs pad every expert to a capacity of 1.0: at balanced routing the rows dropless routing gives, so
    the same step but for the token counts dropless routing exchanges before each dispatch (a small collective);
    under the all-gather dispatcher (the group's tokens gathered, whatever top-k) a slower one."""
    from published import predict_run, run_options

    run = next(r for r in bench.moe_runs() if r.name == "dgxc-grok1-314b@32-L4")
    assert run_options(run).moe_settings().pad_to_capacity
    step = predict_run(run).timeline.makespan_s
    dropless = replace(run, moe_capacity_factor=None, moe_pad_to_capacity=False)
    assert step < predict_run(dropless).timeline.makespan_s < 1.01 * step  # balanced: the same rows, and the counts
    assert predict_run(replace(run, moe_dispatcher="allgather")).timeline.makespan_s > step


def test_the_ascend_moe_fit_reads_only_the_single_node_rows_and_mixtral_stays_held_out(bench) -> None:
    """published_moe_runs.yaml's rule: the 910B MoE rows on one node (1x8) are the fit runs, every multi-node row
    is held out; the profile's index curve names exactly those fit runs as its source."""
    from mpipe_tune.cost import load_profile

    ascend = [r for r in bench.moe_runs() if r.profile == "ascend-910b" and not r.excluded]
    assert {r.name for r in ascend if r.split == "fit"} == {r.name for r in ascend if r.devices == 8}
    assert {r.split for r in ascend if r.devices > 8} == {"held_out"}
    assert next(r for r in ascend if r.suite == "mindspeed-mixtral-8x7b").split == "held_out"
    profile = load_profile("ascend-910b")
    origin = profile.provenance["kernel_efficiency.index"]
    assert origin["source"] == "fitted" and 0 < profile.kernel_efficiency.index.max < 1
    named = {r.name for r in ascend if r.name in origin["ref"]}
    assert named == {r.name for r in ascend if r.split == "fit"}
