"""Sequence-parallel runs equal a single-process step (float64), on 4 gloo ranks in one launch.

Between its tensor-parallel regions a decoder or ViT layer holds only its tp rank's rows of the
sequence (and a pipeline transfer carries them): each region all-gathers them on entry and its
row-split projection reduce-scatters on exit (the MoE layer keeps its rows of the summed output, the
ViT's per-image attention its rows of the all-reduced output), and the norms' weight gradients, each
rank's rows' share, are summed over the tp group before the data-parallel reduce. Sequences whose length tp does not
divide (the workload's 7, and with cp 2 shares of 3 and 5) are padded at their end: causal attention
never shows the padding to a real token, the loss ignores its targets, so it adds nothing to the loss
or any gradient.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, MLA_MOE_MODEL, assert_case_equals_reference, run_plan_cases  # noqa: E402

SP = dict(tp=2, sequence_parallel=True)
CASES = {  # name -> make_plan's arguments
    "tp2 x dp2, sp": dict(schedule="1f1b", cut=(), num_ranks=1, dp=2, **SP),
    "pp2 x tp2, sp, transpose,1f1b": dict(schedule="transpose,1f1b", cut=(FIRST_LLM,), num_ranks=2, **SP),
    "pp2 x tp2, sp, 1f1b,1f1b cut between ViT blocks": dict(schedule="1f1b,1f1b", cut=(2,), num_ranks=2, **SP),
    "tp2 x cp2, sp (MLA, MoE)": dict(schedule="1f1b", cut=(), num_ranks=1, cp=2, model_spec=MLA_MOE_MODEL, **SP),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_plan_cases(tmp_path_factory.mktemp("sequence-parallel"), CASES, 4)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    assert_case_equals_reference(runs, case, CASES[case], 4)
