"""Interleaved plans whose microbatch count is not a multiple of P (torch's rounds of M // P) give
the single-process step's summed loss and gradients (float64), like every schedule in
test_equivalence.py: the executor runs the order it is given, whatever M.

P = 2 with M = 3 (one round of 3) and P = 4 with M = 6 (one round of 6); one local launch per P.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan  # noqa: E402

from mpipe_tune.algebra import is_interleavable  # noqa: E402
from mpipe_tune.inputs import Microbatch, Workload  # noqa: E402
from mpipe_tune.runtime import blueprint  # noqa: E402
from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime._mllm import reference_step  # noqa: E402
from mpipe_tune.runtime import run_jobs  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402

MICROBATCHES = WORKLOAD.microbatches + (Microbatch(2, 9, (2,)), Microbatch(0, 5))
NUM_MICROBATCHES = {2: 3, 4: 6}
"""P -> M: neither a multiple of P, both accepted by torch's ScheduleInterleaved1F1B."""
CASES = {
    "1f1b,1f1b": ("1f1b,1f1b", (6,)),
    "transpose,1f1b,1f1b": ("transpose,1f1b,1f1b", (FIRST_LLM, 8)),
}


def workload(P: int) -> Workload:
    return Workload(MICROBATCHES[: NUM_MICROBATCHES[P]], f"runtime-test-m{NUM_MICROBATCHES[P]}")


@pytest.fixture(scope="module", params=sorted(NUM_MICROBATCHES), ids=lambda p: f"P{p}")
def runs(request, tmp_path_factory):
    P = request.param
    M = NUM_MICROBATCHES[P]
    assert M % P and is_interleavable(P, M)
    folder = tmp_path_factory.mktemp(f"interleaved-p{P}-m{M}")
    jobs = {}
    for name, (schedule, cut) in CASES.items():
        if schedule == "transpose,1f1b,1f1b" and P == 4:
            continue  # two Sharded regions of >= 4 layers each need 8 backbone layers; the test model has 7
        grads = folder / f"grads-{len(jobs)}"
        grads.mkdir()
        path = make_plan(folder, schedule, cut, P, workload=workload(P))
        jobs[name] = RunJob(str(path), steps=1, dtype="fp64", lr=0.05, grads_dir=str(grads))
    results = launch_local(run_jobs, (list(jobs.values()),), P, timeout_s=300, deadline_s=150)
    return P, jobs, dict(zip(jobs, results))


@pytest.mark.parametrize("case", list(CASES))
def test_interleaved_step_with_m_not_a_multiple_of_p_equals_the_single_process_step(runs, case):
    P, jobs, results = runs
    if case not in jobs:
        pytest.skip("not run at this P")
    microbatches = workload(P).microbatches
    reference = reference_step(blueprint(load_model(TEST_MODEL)), microbatches, seed=0)
    assert_step_equals_reference(jobs[case].grads_dir, P, results[case]["summary"], reference, len(microbatches))
