"""Pipeline x tensor x data parallel runs equal a single-process step (float64), on 4 gloo ranks.

Each (dp, tp) coordinate runs its pipeline rank's order; replica ``d`` trains microbatches
``d * M .. d * M + M - 1`` of the stored shapes, so the reference is one process stepping through
``dp * M`` microbatches. Every trained weight's gradient must equal the reference's (the summed loss
over all of them): tensor-parallel shards are gathered whole, data-parallel and replicated-encoder
reduces sum over their real process groups. One launch runs every case on the same 4 ranks.

Tolerance: float64, ``rtol 1e-10, atol 1e-12`` on gradients (sums taken in another order across
ranks), relative ``1e-12`` on the summed loss.
"""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of,
)

from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime import run_jobs  # noqa: E402

FROZEN = ("encoder", "projector")
LAYOUTS = {"pp2xdp2": (2, 1, 2), "pp2xtp2": (2, 2, 1), "pp1xtp2xdp2": (1, 2, 2)}
"""name -> (pp, tp, dp)"""
SCHEDULES = {
    "1f1b": ("1f1b", (), ()),
    "transpose,1f1b": ("transpose,1f1b", (FIRST_LLM,), ()),
    "transpose,1f1b frozen encoder": ("transpose,1f1b", (FIRST_LLM,), FROZEN),
}
MODELS = {"dense GQA": TEST_MODEL, "MLA + MoE": MLA_MOE_MODEL}
CASES = [(m, layout, s) for m in MODELS for layout in LAYOUTS for s in SCHEDULES]


def case_id(case) -> str:
    return " / ".join(case)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel-equivalence")
    jobs = {}
    for case in CASES:
        model, layout, schedule = case
        pp, tp, dp = LAYOUTS[layout]
        name, cut, frozen = SCHEDULES[schedule]
        grads = folder / f"grads-{len(jobs)}"
        grads.mkdir()
        path = make_plan(folder, name, cut, pp, frozen=frozen, model_spec=MODELS[model], tp=tp, dp=dp)
        jobs[case] = RunJob(str(path), steps=1, dtype="fp64", lr=0.05, grads_dir=str(grads))
    results = launch_local(run_jobs, (list(jobs.values()),), 4, timeout_s=300, deadline_s=240)
    return jobs, dict(zip(jobs, results))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    jobs, results = runs
    model, layout, schedule = case
    dp = LAYOUTS[layout][2]
    assert_step_equals_reference(jobs[case].grads_dir, 4, results[case]["summary"],
                                 reference_of(SCHEDULES[schedule][2], MODELS[model], WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)


def test_the_summary_names_the_layout(runs):
    jobs, results = runs
    for (model, layout, schedule), result in results.items():
        pp, tp, dp = LAYOUTS[layout]
        summary = result["summary"]
        assert (summary["pp"], summary["tp"], summary["dp"], summary["world_size"]) == (pp, tp, dp, 4)
