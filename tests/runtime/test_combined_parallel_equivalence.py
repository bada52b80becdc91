"""Every degree at once equals a single-process step (float64), on 8 gloo ranks in one launch:
pp 2 x tp 2 with expert parallelism 2 carved from dp 2, and from cp 2 with sequence parallelism (the
MLA + MoE model, its encoder a stage of its own under transpose,1f1b)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of, run_plan_files,
)

CASES = {  # name -> (schedule, cut, dp, cp, sequence parallel)
    "pp2 x tp2 x dp2, ep2, 1f1b": ("1f1b", (), 2, 1, False),
    "pp2 x tp2 x cp2, ep2, sp, transpose,1f1b": ("transpose,1f1b", (FIRST_LLM,), 1, 2, True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("combined-parallel")
    paths = {name: make_plan(folder, schedule, cut, 2, model_spec=MLA_MOE_MODEL, tp=2, dp=dp, cp=cp, ep=2,
                             sequence_parallel=sp)
             for name, (schedule, cut, dp, cp, sp) in CASES.items()}
    return run_plan_files(folder, paths, 8, deadline_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    jobs, results = runs
    dp = CASES[case][2]
    assert_step_equals_reference(jobs[case].grads_dir, 8, results[case]["summary"],
                                 reference_of((), MLA_MOE_MODEL, WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)
