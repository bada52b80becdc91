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

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of,
    run_plan_files,
)

CASES = {  # name -> (model, schedule, cut, pp, tp, dp, cp)
    "tp2 x dp2, sp": (TEST_MODEL, "1f1b", (), 1, 2, 2, 1),
    "pp2 x tp2, sp, transpose,1f1b": (TEST_MODEL, "transpose,1f1b", (FIRST_LLM,), 2, 2, 1, 1),
    "pp2 x tp2, sp, 1f1b,1f1b cut between ViT blocks": (TEST_MODEL, "1f1b,1f1b", (2,), 2, 2, 1, 1),
    "tp2 x cp2, sp (MLA, MoE)": (MLA_MOE_MODEL, "1f1b", (), 1, 2, 1, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sequence-parallel")
    paths = {name: make_plan(folder, schedule, cut, pp, model_spec=model, tp=tp, dp=dp, cp=cp, sequence_parallel=True)
             for name, (model, schedule, cut, pp, tp, dp, cp) in CASES.items()}
    return run_plan_files(folder, paths, 4, deadline_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    jobs, results = runs
    model, dp = CASES[case][0], CASES[case][5]
    assert_step_equals_reference(jobs[case].grads_dir, 4, results[case]["summary"],
                                 reference_of((), model, WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)
