"""pp = 1 on the executor: the whole model on every rank, the step gradient accumulation over the
microbatches, the data-parallel (or tensor x data-parallel) ranks each training their own. At ZeRO 0, 1,
2 and 3 (3: FSDP2's ``fully_shard`` of every layer over the four data ranks, the layout torchtitan and
MindSpeed-MM's FSDP2 run for small models, resharding after forward, pp 1's default, and keeping the
weights through the step, its sharding actions run by the executor) the first step's loss and every gradient equal the
single-process step's, and the second step's loss is the same at every stage, so each stage's update
is the whole one (float64, 4 gloo ranks, one launch for every case).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of  # noqa: E402

from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime import read_plan_file  # noqa: E402
from mpipe_tune.runtime import run_jobs  # noqa: E402

RANKS = 4
LAYOUTS = {"dp4": dict(dp=4), "tp2 x dp2": dict(tp=2, dp=2)}
STAGES = (0, 1, 2, 3, "3-keep")
SETTINGS = {"3-keep": dict(zero_stage=3, reshard_after_forward=False)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp1")
    jobs = {}
    for name, degrees in LAYOUTS.items():
        for zero in STAGES:
            where = folder / f"case{len(jobs)}"
            (where / "grads").mkdir(parents=True)
            path = make_plan(where, "1f1b", (), 1, **SETTINGS.get(zero, dict(zero_stage=zero)), **degrees)
            jobs[(name, zero)] = RunJob(str(path), steps=2, dtype="fp64", lr=0.05, grads_dir=str(where / "grads"))
    results = launch_local(run_jobs, (list(jobs.values()),), RANKS, timeout_s=300, deadline_s=240)
    return jobs, dict(zip(jobs, results))


def test_a_pp_1_plan_is_one_rank_running_every_microbatch_forward_then_backward(runs):
    jobs, _ = runs
    view = read_plan_file(jobs[("dp4", 3)].plan_path)
    (order,) = view.nodes
    kinds = [type(view.events[e]).__name__ for e in order]
    computed = [k for k in kinds if k in ("Fwd", "Bwd")]
    assert computed == ["Fwd", "Bwd"] * len(WORKLOAD)  # 1F1B at P = 1: one microbatch's activations at a time


@pytest.mark.parametrize("zero", STAGES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_first_step_equals_the_single_process_step(runs, layout, zero):
    jobs, results = runs
    dp = LAYOUTS[layout]["dp"]
    reference = reference_of((), TEST_MODEL, WORKLOAD.microbatches * dp)
    assert_step_equals_reference(jobs[(layout, zero)].grads_dir, RANKS, results[(layout, zero)]["summary"],
                                 reference, dp * len(WORKLOAD), losses_shared=LAYOUTS[layout].get("tp", 1) > 1,
                                 replica_atol=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_stage_updates_the_weights_the_same(runs, layout):
    _, results = runs
    whole = results[(layout, 0)]["summary"]["loss_sums"]
    assert abs(whole[1] - whole[0]) > 1e-6 * abs(whole[0])  # the update changed the weights
    for zero in STAGES[1:]:
        assert results[(layout, zero)]["summary"]["loss_sums"] == pytest.approx(whole, rel=1e-12), zero
