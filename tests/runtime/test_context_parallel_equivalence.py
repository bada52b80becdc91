"""Context-parallel runs equal a single-process step (float64), on 4 gloo ranks in one launch.

Each cp rank of a data replica holds two of the ``2 * cp`` chunks of every decoder sequence (the
load-balanced split; the workload's lengths 6, 7, 8 and 10 give uneven chunks, and at cp 4 empty
ones), attention passes keys and values round the ring (forward) and their gradients back (backward),
each rank's loss is its positions' share of the mean, and the replicated weights' gradients are
summed over dp x cp. The cp ranks of a replica share its microbatches, so the reference is one
process stepping through ``dp * M`` microbatches. Cases mix cp with pp, dp, tp and ep.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of,
    run_plan_files,
)

CASES = {  # name -> (model, schedule, cut, pp, tp, dp, cp, ep)
    "cp4 (a ring of four, empty chunks)": (TEST_MODEL, "1f1b", (), 1, 1, 1, 4, 1),
    "pp2 x cp2, transpose,1f1b": (TEST_MODEL, "transpose,1f1b", (FIRST_LLM,), 2, 1, 1, 2, 1),
    "cp2 x tp2 (MLA, MoE)": (MLA_MOE_MODEL, "1f1b", (), 1, 2, 1, 2, 1),
    "dp2 x cp2, ep2 (MLA, MoE), zb1p": (MLA_MOE_MODEL, "zb1p", (), 1, 1, 2, 2, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("context-parallel")
    paths = {name: make_plan(folder, schedule, cut, pp, model_spec=model, tp=tp, dp=dp, cp=cp, ep=ep)
             for name, (model, schedule, cut, pp, tp, dp, cp, ep) in CASES.items()}
    return run_plan_files(folder, paths, 4, deadline_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    jobs, results = runs
    model, dp = CASES[case][0], CASES[case][5]
    assert_step_equals_reference(jobs[case].grads_dir, 4, results[case]["summary"],
                                 reference_of((), model, WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)
