"""Expert-parallel runs equal a single-process step (float64), on 4 gloo ranks.

The MLA + MoE backbone's routed experts are sharded over ``ep`` ranks carved from the data-parallel
ranks (each holds 4 / ep experts), tokens are dispatched and combined by all-to-all with the router's
split sizes, and the experts' gradients are reduced over their own data-parallel group (dp / ep
ranks); the router, the shared experts and the rest over the whole DataGroup. Each replica trains
its own microbatches, so the reference is one process stepping through ``dp * M`` microbatches:
every gradient (an expert's from the one rank group holding it) and the summed loss must equal it.
One launch runs every case.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of, run_plan_files,
)

CASES = {  # name -> (schedule, cut, pp, tp, dp, ep)
    "pp2 x dp2, ep2, transpose,1f1b": ("transpose,1f1b", (FIRST_LLM,), 2, 1, 2, 2),
    "dp4, ep2 (experts reduced over 2 ranks)": ("1f1b", (), 1, 1, 4, 2),
    "tp2 x dp2, ep2": ("1f1b", (), 1, 2, 2, 2),
    "pp2 x dp2, ep2, zb1p": ("zb1p", (), 2, 1, 2, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("expert-parallel")
    paths = {name: make_plan(folder, schedule, cut, pp, model_spec=MLA_MOE_MODEL, tp=tp, dp=dp, ep=ep)
             for name, (schedule, cut, pp, tp, dp, ep) in CASES.items()}
    return run_plan_files(folder, paths, 4, deadline_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    jobs, results = runs
    dp = CASES[case][4]
    assert_step_equals_reference(jobs[case].grads_dir, 4, results[case]["summary"],
                                 reference_of((), MLA_MOE_MODEL, WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)


def test_each_rank_holds_only_its_experts(runs):
    jobs, _ = runs
    job = jobs["dp4, ep2 (experts reduced over 2 ranks)"]
    held = [{name.split(".")[3] for name in torch.load(job.grads_dir + f"/rank{r}.pt")["grads"]
             if ".mlp.experts." in name} for r in range(4)]
    assert held == [{"0", "1"}, {"2", "3"}, {"0", "1"}, {"2", "3"}]  # ep rank = dp rank mod 2
