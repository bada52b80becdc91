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

from runtime_plans import FIRST_LLM, MLA_MOE_MODEL, assert_case_equals_reference, run_plan_cases  # noqa: E402

CASES = {  # name -> make_plan's arguments
    "cp4 (a ring of four, empty chunks)": dict(schedule="1f1b", cut=(), num_ranks=1, cp=4),
    "pp2 x cp2, transpose,1f1b": dict(schedule="transpose,1f1b", cut=(FIRST_LLM,), num_ranks=2, cp=2),
    "cp2 x tp2 (MLA, MoE)": dict(schedule="1f1b", cut=(), num_ranks=1, tp=2, cp=2, model_spec=MLA_MOE_MODEL),
    "dp2 x cp2, ep2 (MLA, MoE), zb1p": dict(schedule="zb1p", cut=(), num_ranks=1, dp=2, cp=2, ep=2,
                                            model_spec=MLA_MOE_MODEL),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_plan_cases(tmp_path_factory.mktemp("context-parallel"), CASES, 4)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    assert_case_equals_reference(runs, case, CASES[case], 4)
