"""Every degree at once equals a single-process step (float64), on 8 gloo ranks in one launch:
pp 2 x tp 2 with expert parallelism 2 carved from dp 2, and from cp 2 with sequence parallelism (the
MLA + MoE model, its encoder a stage of its own under transpose,1f1b); the first also at ZeRO stage 3
(FSDP2 per layer on the 2-D dp x tp mesh, the routed experts whole on their one-rank data group)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, MLA_MOE_MODEL, assert_case_equals_reference, run_plan_cases  # noqa: E402

ALL = dict(num_ranks=2, tp=2, ep=2, model_spec=MLA_MOE_MODEL)
CASES = {  # name -> make_plan's arguments
    "pp2 x tp2 x dp2, ep2, 1f1b": dict(schedule="1f1b", cut=(), dp=2, **ALL),
    "pp2 x tp2 x dp2, ep2, 1f1b, ZeRO-3": dict(schedule="1f1b", cut=(), dp=2, zero_stage=3, **ALL),
    "pp2 x tp2 x cp2, ep2, sp, transpose,1f1b": dict(schedule="transpose,1f1b", cut=(FIRST_LLM,), cp=2,
                                                     sequence_parallel=True, **ALL),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_plan_cases(tmp_path_factory.mktemp("combined-parallel"), CASES, 8, deadline_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    assert_case_equals_reference(runs, case, CASES[case], 8)
