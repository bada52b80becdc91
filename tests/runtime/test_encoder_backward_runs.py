"""The runtime runs placed encoder backwards unchanged: with each rank's encoder backwards at the earliest
placement, or each at its smallest legal slot (as soon as the order allows), the summed loss and every
gradient equal a single-process reference step (float64), as tests/runtime/test_equivalence.py checks
for the cooldown."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, TEST_MODEL, WORKLOAD, assert_step_equals_reference, reference_of, run_plan_files)

from mpipe_tune.algebra import Candidate  # noqa: E402
from mpipe_tune.cost import CompiledPlan  # noqa: E402
from mpipe_tune.cost import CostOptions  # noqa: E402
from mpipe_tune.cost import predict  # noqa: E402
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record  # noqa: E402
from mpipe_tune.cost import load_profile  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402


def _predict(P, placement="cooldown", slots=None):
    model, profile = load_model(TEST_MODEL), load_profile("ideal")
    c = Candidate("transpose,1f1b", (FIRST_LLM,), pp=P, tp=1, dp=1, num_microbatches=len(WORKLOAD),
                  owner_policy="round-robin", dtype="fp32", encoder_backward=placement, encoder_backward_slots=slots)
    return predict(c, model, WORKLOAD, profile, CostOptions(dtype="fp32")), model, profile


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def runs(request, tmp_path_factory):
    P = request.param
    folder = tmp_path_factory.mktemp(f"encoder-backward-p{P}")
    cooldown, model, profile = _predict(P)
    compiled = CompiledPlan(cooldown.plan, model, profile, cooldown.options)
    soonest = compiled.backbone_steps.min_slots(compiled.owners)
    predictions = {"earliest": _predict(P, "earliest")[0], "soonest": _predict(P, "optimised", soonest)[0]}
    paths = {}
    for name, prediction in predictions.items():
        assert prediction.plan.order.nodes != cooldown.plan.order.nodes, "the placement moves an encoder backward"
        paths[name] = folder / f"{name}.json"
        dump_plan(plan_record(prediction, model, WORKLOAD, profile, PlanInputs(TEST_MODEL, (), "ideal")), paths[name])
    return P, *run_plan_files(folder, paths, P)


@pytest.mark.parametrize("name", ["earliest", "soonest"])
def test_placed_encoder_backwards_compute_the_single_process_step(runs, name):
    P, jobs, results = runs
    reference = reference_of(())
    assert_step_equals_reference(jobs[name].grads_dir, P, results[name]["summary"], reference, len(WORKLOAD))
