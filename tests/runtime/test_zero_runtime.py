"""ZeRO-1 in the executor: with a plan's ``zero_stage`` 1 each data-parallel reduce reduce-scatters the
gradients, each rank of the group updates its shard of the weights the group shares and all-gathers the
rest (routed experts over their own group), which must give every rank the weights a whole update gives: the second step's summed loss
equals the unsharded run's (float64, 4 gloo ranks, one launch), and differs from the first step's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import MLA_MOE_MODEL, make_plan  # noqa: E402

from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime import run_jobs  # noqa: E402

LAYOUTS = {"tp2 x dp2, ep2": dict(num_ranks=1, tp=2, dp=2, ep=2),  # split weights (DTensors), experts
           "dp4, ep2": dict(num_ranks=1, dp=4, ep=2)}  # experts sharded over their own group of 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero")
    jobs = {(name, zero): RunJob(str(make_plan(folder, "1f1b", (), model_spec=MLA_MOE_MODEL, zero_stage=zero, **kw)),
                                 steps=2, dtype="fp64", lr=0.05)
            for name, kw in LAYOUTS.items() for zero in (0, 1)}
    results = launch_local(run_jobs, (list(jobs.values()),), 4, timeout_s=300, deadline_s=240)
    return {key: result["summary"] for key, result in zip(jobs, results)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_sharded_update_gives_the_whole_updates_next_step(runs, layout):
    whole, sharded = runs[(layout, 0)]["loss_sums"], runs[(layout, 1)]["loss_sums"]
    assert sharded[0] == pytest.approx(whole[0], rel=1e-12)
    assert sharded[1] == pytest.approx(whole[1], rel=1e-12)
    assert abs(sharded[1] - sharded[0]) > 1e-6 * abs(sharded[0])  # the update changed the weights
