"""Runs with per-step owner maps (gloo, P = 3): each step's map is the policy's on that step's
metadata, the ranks agree on it, and a step run on a map other than the stored one computes the
single-process step's loss and gradients (float64)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_policy_plan, make_sampled_plan, sampled_problem,
)

from mpipe_tune.algebra import Candidate  # noqa: E402
from mpipe_tune.cost import CostOptions  # noqa: E402
from mpipe_tune.runtime import blueprint  # noqa: E402
from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime._launch import RankFailed, launch_local  # noqa: E402
from mpipe_tune.runtime._mllm import reference_step  # noqa: E402
from mpipe_tune.runtime._worker import run_jobs, validate_agreement  # noqa: E402
from mpipe_tune.search import Evaluator, Problem  # noqa: E402
from mpipe_tune.cost import load_profile  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402

P, M = 3, 4
FROZEN = ("encoder", "projector")
STORED = (0, 0, 0, 0)
"""The stored example map: every encode on rank 0, which has no warmup slack (greedy moves them)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("step-owners")
    problem = sampled_problem(P, M)
    sampled = Candidate("transpose,1f1b", (FIRST_LLM,), P, 1, 1, M, "greedy")
    plans = {
        "trainable": make_policy_plan(folder, P, "greedy", STORED),
        "frozen": make_policy_plan(folder, P, "greedy", STORED, frozen=FROZEN),
        "sampled": make_sampled_plan(folder, problem, sampled),
    }
    jobs = {}
    for name in ("trainable", "frozen", "sampled"):
        grads = folder / f"grads-{name}"
        grads.mkdir()
        jobs[name] = RunJob(str(plans[name]), steps=3 if name == "sampled" else 2, dtype="fp64", lr=0.05,
                            grads_dir=str(grads))
    jobs["sampled fixed emulated"] = RunJob(str(plans["sampled"]), steps=2, compute="emulated", owners="fixed",
                                            data="sampled")
    results = launch_local(run_jobs, (list(jobs.values()),), P, timeout_s=300, deadline_s=150)
    return problem, sampled, jobs, {name: r["summary"] for name, r in zip(jobs, results)}


def _policy_owners(frozen=()):
    """The greedy map of the stored workload, as the search's evaluator computes it."""
    model = load_model(TEST_MODEL)
    problem = Problem(model.with_frozen(frozen) if frozen else model, load_profile("ideal"), P, len(WORKLOAD),
                      workload=WORKLOAD, options=CostOptions(dtype="fp32"))
    c = Candidate("transpose,1f1b", (FIRST_LLM,), P, 1, 1, len(WORKLOAD), "greedy", dtype="fp32")
    return Evaluator(problem).owners(c, 0)


@pytest.mark.parametrize("case", ["trainable", "frozen"])
def test_a_step_on_its_own_map_equals_the_single_process_step(runs, case):
    _problem, _c, jobs, summaries = runs
    summary = summaries[case]
    assert summary["owners"] == "per-step" and summary["data"] == "stored"
    wanted = _policy_owners(FROZEN if case == "frozen" else ())
    assert wanted != STORED
    assert [tuple(s["owners"]) for s in summary["per_step"]] == [wanted, wanted]
    frozen = FROZEN if case == "frozen" else ()
    model = load_model(TEST_MODEL)
    reference = reference_step(blueprint(model.with_frozen(frozen) if frozen else model), WORKLOAD.microbatches, seed=0)
    assert_step_equals_reference(jobs[case].grads_dir, P, summary, reference, len(WORKLOAD))


def test_sampled_steps_run_the_policy_on_each_steps_metadata(runs):
    problem, c, jobs, summaries = runs
    summary = summaries["sampled"]
    assert summary["owners"] == "per-step" and summary["data"] == "sampled"
    evaluator = Evaluator(problem)
    for k, step in enumerate(summary["per_step"]):
        assert step["image_tokens"] == [mb.image_tokens for mb in problem.replica_workload(k, 1, M).microbatches]
        assert tuple(step["owners"]) == evaluator.owners(c, k)
    reference = reference_step(blueprint(load_model(TEST_MODEL)), problem.replica_workload(0, 1, M).microbatches, seed=0)
    assert_step_equals_reference(jobs["sampled"].grads_dir, P, summary, reference, M)


def test_fixed_owners_on_sampled_steps_run_the_stored_map_with_each_steps_prediction(runs):
    problem, c, _jobs, summaries = runs
    fixed, per_step = summaries["sampled fixed emulated"], summaries["sampled"]
    assert fixed["owners"] == "fixed" and fixed["data"] == "sampled"
    stored = per_step["per_step"][0]["owners"]
    assert [s["owners"] for s in fixed["per_step"]] == [stored, stored]
    assert [s["image_tokens"] for s in fixed["per_step"]] == [s["image_tokens"] for s in per_step["per_step"][:2]]
    assert fixed["predicted_step_times_s"][0] == pytest.approx(per_step["predicted_step_times_s"][0], rel=1e-12)


def agree_or_not(ctx, same: bool) -> str:
    validate_agreement(7 if same else 7 + ctx.rank, "the test's metadata", torch.device("cpu"))
    return "agreed"


def test_ranks_that_disagree_are_refused_in_one_line():
    assert launch_local(agree_or_not, (True,), 2, timeout_s=300, deadline_s=60) == "agreed"
    with pytest.raises(RankFailed, match=r"^rank \d: the ranks disagree on the test's metadata \(digests from "
                                         r"0000000000000007 to 0000000000000008") as info:
        launch_local(agree_or_not, (False,), 2, timeout_s=300, deadline_s=60)
    assert info.value.user_error and not info.value.details


def test_an_emulated_per_step_run_from_the_cli_never_beats_each_steps_prediction(tmp_path, capsys):
    """``run --compute emulated`` on a greedy plan whose stored map is not greedy's: the default is
    per-step owners, each step waits its own predicted longest path, and the table names the maps."""
    from mpipe_tune.cli import main
    from mpipe_tune.inputs import Microbatch, Workload

    workload = Workload(tuple(Microbatch(300 * m, 1000) for m in range(4)), "emulated")
    plan = make_policy_plan(tmp_path, 2, "greedy", (0, 0, 0, 0), workload=workload, model_spec="example-mllm",
                            cut=(8,))
    assert main(["run", str(plan), "--compute", "emulated", "--steps", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["owners"] == "per-step" and record["data"] == "stored"
    maps = [tuple(step["owners"]) for step in record["per_step"]]
    assert maps[0] == maps[1] != (0, 0, 0, 0)
    assert all(t >= p for t, p in zip(record["step_times_s"], record["predicted_step_times_s"]))
    assert main(["run", str(plan), "--compute", "emulated", "--steps", "1"]) == 0
    assert f"step 0 owners {','.join(map(str, maps[0]))}" in capsys.readouterr().out
