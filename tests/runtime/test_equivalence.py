"""Every schedule's summed loss and every gradient equal a single-process reference step (float64).

One local launch per P runs all the plans in turn on the same process group; each rank saves its
first step's gradients (before the update) and the losses it computed.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, WORKLOAD, assert_step_equals_reference, reference_of, run_cases  # noqa: E402


FROZEN = ("encoder", "projector")
CASES = {
    "1f1b (encoder in the first stage)": ("1f1b", (), ()),
    "transpose,1f1b trainable encoder": ("transpose,1f1b", (FIRST_LLM,), ()),
    "transpose,1f1b frozen encoder": ("transpose,1f1b", (FIRST_LLM,), FROZEN),
    "gpipe": ("gpipe", (), ()),
    "interleaved 1f1b,1f1b": ("1f1b,1f1b", (6,), ()),
    # Not named in the issue: schedules the executor was never written for run unchanged.
    "interleaved gpipe,gpipe": ("gpipe,gpipe", (6,), ()),
    "transpose,1f1b,1f1b": ("transpose,1f1b,1f1b", (FIRST_LLM, 8), ()),
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def runs(request, tmp_path_factory):
    P = request.param
    folder = tmp_path_factory.mktemp(f"equivalence-p{P}")
    # two Sharded regions of >= 4 layers each need 8 backbone layers; the test model has 7
    cases = {name: case for name, case in CASES.items() if not (case[0] == "transpose,1f1b,1f1b" and P == 4)}
    return (P, *run_cases(folder, cases, P, steps=2))


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    P, jobs, results = runs
    if case not in jobs:
        pytest.skip("not run at this P")
    assert_step_equals_reference(jobs[case].grads_dir, P, results[case]["summary"], reference_of(CASES[case][2]),
                                 len(WORKLOAD))


def test_frozen_encoder_ships_features_only(runs):
    P, jobs, _ = runs
    text = open(jobs["transpose,1f1b frozen encoder"].plan_path).read()
    assert "scatter(" not in text and '"B1.' not in text
    assert '"B1.' in open(jobs["transpose,1f1b trainable encoder"].plan_path).read()


def test_the_update_changes_the_loss(runs):
    """Step 2 runs after one SGD update: its summed loss differs from step 1's, the same on every schedule."""
    _P, _jobs, results = runs
    trained = {name: r["summary"]["loss_sums"] for name, r in results.items() if "frozen" not in name}
    first = next(iter(trained.values()))
    assert first[1] != first[0]
    for losses in trained.values():
        assert losses[1] == pytest.approx(first[1], rel=1e-10)
