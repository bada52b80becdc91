"""The encoder under its own tensor-parallel degree (encoder_tp 1 under tp 2) equals a single-process
step (float64, 4 gloo ranks, one launch): each tp group's two encoder groups encode alternate images
of a microbatch (one of them none when it has a single image), their features are gathered in image
order before the projector, and the encoder's gradients are summed over the groups and the
data-parallel or replica group.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of, run_plan_files,
)

from mpipe_tune.runtime import RunJob  # noqa: E402

CASES = {  # name -> (schedule, cut, pp, dp)
    "pp2 x tp2, transpose,1f1b": ("transpose,1f1b", (FIRST_LLM,), 2, 1),
    "tp2 x dp2, 1f1b": ("1f1b", (), 1, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoder-tp")
    paths = {name: make_plan(folder, schedule, cut, pp, tp=2, dp=dp, encoder_tp=1)
             for name, (schedule, cut, pp, dp) in CASES.items()}
    return run_plan_files(folder, paths, 4, deadline_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    jobs, results = runs
    dp = CASES[case][3]
    assert_step_equals_reference(jobs[case].grads_dir, 4, results[case]["summary"],
                                 reference_of((), TEST_MODEL, WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)


def test_a_stage_starting_inside_the_encoder_is_refused_in_one_line(tmp_path):
    from mpipe_tune.errors import MpipeError
    from mpipe_tune.runtime._job import preflight

    path = make_plan(tmp_path, "transpose,1f1b", (2,), 2, tp=2, encoder_tp=1)  # the encoder ends at layer 4
    with pytest.raises(MpipeError) as info:
        preflight(RunJob(str(path)))
    assert "a stage starting at encoder layer 2" in str(info.value) and "\n" not in str(info.value)
    preflight(RunJob(str(path), compute="emulated"))  # emulated compute runs it
