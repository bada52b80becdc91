"""Zero-bubble plans run on the executor unchanged and give the single-process step's summed loss and
every gradient (float64): each split backward's input gradient first (the ``Bwd``), its weight
gradients later (the ``Wgrad``), the V of ``zbv`` with its local hand-over between the two chunks.

One local launch at P = 2 runs every plan in turn.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, WORKLOAD, assert_step_equals_reference, reference_of, run_cases  # noqa: E402


FROZEN = ("encoder", "projector")
CASES = {
    "zb1p": ("zb1p", (), ()),
    "zb1p frozen encoder": ("zb1p", (), FROZEN),
    "zbv,zbv": ("zbv,zbv", (6,), ()),
    "zb1p,zb1p": ("zb1p,zb1p", (6,), ()),
    "transpose,zb1p trainable encoder": ("transpose,zb1p", (FIRST_LLM,), ()),
    "transpose,zbv,zbv frozen encoder": ("transpose,zbv,zbv", (FIRST_LLM, 8), FROZEN),
}
P = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero-bubble-p2")
    return run_cases(folder, CASES, P)


@pytest.mark.parametrize("case", list(CASES))
def test_zero_bubble_step_equals_the_single_process_step(runs, case):
    jobs, results = runs
    assert_step_equals_reference(jobs[case].grads_dir, P, results[case]["summary"], reference_of(CASES[case][2]),
                                 len(WORKLOAD))


def test_the_plans_split_their_backwards(runs):
    jobs, _ = runs
    for name, job in jobs.items():
        text = open(job.plan_path).read()
        assert '"W' in text, f"{name}: no weight-gradient event in the plan"
