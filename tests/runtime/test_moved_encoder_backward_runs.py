"""The runtime runs encoder backwards moved off their owners (full recomputation): each microbatch's
encoder backward on the next rank after its owner, at its smallest legal slot there or in that
rank's cooldown; the rank re-runs the encode from the microbatch's images, and the summed loss and
every gradient equal a single-process reference step (float64)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, TEST_MODEL, WORKLOAD, assert_step_equals_reference, reference_of, run_plan_files)

from mpipe_tune.algebra import Candidate  # noqa: E402
from mpipe_tune.algebra import Bwd, Coll  # noqa: E402
from mpipe_tune.cost import CompiledPlan  # noqa: E402
from mpipe_tune.cost import CostOptions  # noqa: E402
from mpipe_tune.cost import predict  # noqa: E402
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record  # noqa: E402
from mpipe_tune.runtime import read_plan_file  # noqa: E402
from mpipe_tune.cost import load_profile  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402


def _predict(P, slots=None, ranks=None):
    model, profile = load_model(TEST_MODEL), load_profile("ideal")
    c = Candidate("transpose,1f1b", (FIRST_LLM,), pp=P, tp=1, dp=1, num_microbatches=len(WORKLOAD),
                  owner_policy="round-robin", dtype="fp32", recompute="full",
                  encoder_backward="cooldown" if slots is None else "optimised", encoder_backward_slots=slots,
                  encoder_backward_ranks=ranks)
    return predict(c, model, WORKLOAD, profile, CostOptions(dtype="fp32")), model, profile


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"P{p}")
def runs(request, tmp_path_factory):
    P = request.param
    folder = tmp_path_factory.mktemp(f"moved-encoder-backward-p{P}")
    cooldown, model, profile = _predict(P)
    compiled = CompiledPlan(cooldown.plan, model, profile, cooldown.options)
    ranks = tuple((owner + 1) % P for owner in compiled.owners)
    steps = compiled.backbone_steps
    predictions = {"soonest": _predict(P, steps.min_slots(ranks), ranks)[0],
                   "cooldown": _predict(P, steps.cooldown_slots(ranks), ranks)[0]}
    paths = {}
    for name, prediction in predictions.items():
        paths[name] = folder / f"{name}.json"
        dump_plan(plan_record(prediction, model, WORKLOAD, profile, PlanInputs(TEST_MODEL, (), "ideal")), paths[name])
        view = read_plan_file(str(paths[name]))  # the stored order is derive's, with the moved events
        for m, r in enumerate(ranks):
            assert view.plan.index[Bwd(1, r, m)] in view.nodes[r]
            assert any(isinstance(e, Coll) and e.dst == (1, r) and e.mb == m for e in view.events)
    return P, *run_plan_files(folder, paths, P)


@pytest.mark.parametrize("name", ["soonest", "cooldown"])
def test_moved_encoder_backwards_compute_the_single_process_step(runs, name):
    P, jobs, results = runs
    reference = reference_of(())
    assert_step_equals_reference(jobs[name].grads_dir, P, results[name]["summary"], reference, len(WORKLOAD))
