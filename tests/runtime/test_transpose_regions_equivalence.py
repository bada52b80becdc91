"""Interior and sink transposes run on the executor unchanged: summed loss and every gradient equal a
single-process reference step (float64), the sink's losses computed on their owners.

One local launch per P runs all the plans in turn (as tests/runtime/test_equivalence.py does).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, WORKLOAD, assert_step_equals_reference, reference_of, run_cases  # noqa: E402


HEAD = 11  # the tiny model's lm_head
FROZEN = ("encoder", "projector")
CASES = {
    "1f1b,transpose (sink head)": ("1f1b,transpose", (HEAD,), ()),
    "gpipe,transpose (sink head)": ("gpipe,transpose", (HEAD,), ()),
    "transpose,1f1b,transpose": ("transpose,1f1b,transpose", (FIRST_LLM, HEAD), ()),
    "transpose,1f1b,transpose frozen encoder": ("transpose,1f1b,transpose", (FIRST_LLM, HEAD), FROZEN),
    "1f1b,transpose,1f1b (interior)": ("1f1b,transpose,1f1b", (6, 8), ()),
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def runs(request, tmp_path_factory):
    P = request.param
    folder = tmp_path_factory.mktemp(f"transpose-regions-p{P}")
    return (P, *run_cases(folder, CASES, P))


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    P, jobs, results = runs
    assert_step_equals_reference(jobs[case].grads_dir, P, results[case]["summary"], reference_of(CASES[case][2]),
                                 len(WORKLOAD))


def test_the_sink_s_losses_are_computed_by_their_owners(runs):
    """Each rank saves the losses it computed: with round-robin owners, rank r those of m = r mod P."""
    P, jobs, _ = runs
    saved = {r: torch.load(f"{jobs['1f1b,transpose (sink head)'].grads_dir}/rank{r}.pt") for r in range(P)}
    for r, record in saved.items():
        assert sorted(record["losses"]) == [m for m in range(len(WORKLOAD)) if m % P == r]
    plan = json.loads(open(jobs["1f1b,transpose (sink head)"].plan_path).read())
    assert "scatter(1." in json.dumps(plan) and "gather(2." in json.dumps(plan)
