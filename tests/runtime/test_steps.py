"""Each step's metadata, owner map and order at run time (mpipe_tune.runtime._steps), without processes.

The per-step map is checked against the search's evaluator, which reads the encodes and the slack
its own way (its own derive of the round-robin plan per sampled step); the step's order against a
fresh derive of the candidate with that map.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from runtime_plans import FIRST_LLM, WORKLOAD, make_policy_plan, make_plan, make_sampled_plan, sampled_problem

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost import CostOptions, predict
from mpipe_tune.errors import MpipeError
from mpipe_tune.runtime import read_plan_file, StepModes, StepPlanner, resolve_modes
from mpipe_tune.search import Evaluator

P, M = 3, 4


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """A greedy ``<transpose,1f1b>`` plan whose steps are drawn from the smoke mix (two sequences per microbatch)."""
    problem = sampled_problem(P, M)
    candidate = Candidate("transpose,1f1b", (FIRST_LLM,), P, 1, 1, M, "greedy")
    path = make_sampled_plan(tmp_path_factory.mktemp("steps"), problem, candidate)
    return problem, candidate, str(path)


def test_each_step_runs_the_policy_on_that_steps_metadata(sampled):
    problem, c, path = sampled
    view = read_plan_file(path)
    modes = resolve_modes(view)
    assert modes == StepModes("per-step", "sampled")
    planner = StepPlanner(view, modes)
    evaluator = Evaluator(problem)
    maps = []
    for k in range(problem.samples):
        step = planner.plan(k)
        assert step.view.microbatches == problem.replica_workload(k, 1, M).microbatches
        assert step.owners == evaluator.owners(c, k) and step.policy == "greedy"
        assert step.view.predicted_step_s == pytest.approx(evaluator.evaluate(c, memory=False).makespans_s[k], rel=1e-9)
        # The re-timed order is derive's for that map, event for event and rank by rank.
        derived = replace(c, slab_counts=evaluator.slab_counts(c), owner_map=step.owners).derive(problem.model)
        assert step.view.plan.order.events == derived.order.events
        assert step.view.plan.order.nodes == derived.order.nodes
        assert set(step.view.plan.order.edges) == set(derived.order.edges)
        assert step.view.plan.placement == derived.placement
        maps.append(step.owners)
    assert maps[0] == view.candidate.owner_map, "step 0 is the stored step: its map is the stored example"
    assert len(set(maps)) > 1, "other images give other owner maps"


def test_fixed_owners_on_sampled_steps_keep_the_stored_map(sampled):
    problem, c, path = sampled
    view = read_plan_file(path)
    planner = StepPlanner(view, resolve_modes(view, owners="fixed", data="sampled"))
    for k in (0, 2):
        step = planner.plan(k)
        assert step.owners == view.candidate.owner_map and step.policy is None and step.owners_s == 0.0
        workload = problem.replica_workload(k, 1, M)
        expected = predict(view.candidate, problem.model, workload, problem.profile, CostOptions())
        assert step.view.predicted_step_s == pytest.approx(expected.timeline.makespan_s, rel=1e-9)
        assert step.view.durations_s == pytest.approx(tuple(expected.timeline.durations_s), rel=1e-9)


def test_the_stored_plan_runs_as_stored_when_owners_are_fixed(sampled):
    view = read_plan_file(sampled[2])
    step = StepPlanner(view, resolve_modes(view, owners="fixed")).plan(3)
    assert step.view is view and step.owners == view.candidate.owner_map


def test_ranks_that_read_the_same_metadata_hold_the_same_key(sampled):
    view = read_plan_file(sampled[2])
    modes = resolve_modes(view)
    a, b = StepPlanner(view, modes), StepPlanner(view, modes)
    assert a.plan(1).key == b.plan(1).key
    assert a.plan(1).key != a.plan(2).key


def test_per_step_owners_need_a_policy_and_a_transpose(tmp_path):
    explicit = make_policy_plan(tmp_path, P, None, (0, 0, 1, 2))
    with pytest.raises(MpipeError, match="holds an explicit owner map and no owner policy.*owner mode fixed"):
        resolve_modes(read_plan_file(str(explicit)), owners="per-step")
    assert resolve_modes(read_plan_file(str(explicit))) == StepModes("fixed", "stored")
    plain = make_plan(tmp_path, "1f1b", (), 2)
    with pytest.raises(MpipeError, match="does not start with a transpose region"):
        resolve_modes(read_plan_file(str(plain)), owners="per-step")
    with pytest.raises(MpipeError, match="owner mode 'sometimes' is unknown; use one of per-step, fixed"):
        resolve_modes(read_plan_file(str(plain)), owners="sometimes")


def test_an_unknown_owner_policy_is_refused_in_one_line(tmp_path):
    path = make_policy_plan(tmp_path, P, "greedy", (0, 0, 1, 2))
    record = json.loads(path.read_text())
    record["candidate"]["owner_policy"] = "lottery"
    path.write_text(json.dumps(record))
    view = read_plan_file(str(path))
    with pytest.raises(MpipeError, match="owner policy 'lottery' is unknown; owner policies are round-robin, greedy, "
                                         "optimal: run the stored map with owner mode fixed"):
        resolve_modes(view)
    assert resolve_modes(view, owners="fixed") == StepModes("fixed", "stored")


def test_sampling_needs_a_draw_that_matches_the_stored_metadata(tmp_path, sampled):
    from_file = make_policy_plan(tmp_path, P, "greedy", (0, 0, 1, 2), workload=WORKLOAD)
    view = read_plan_file(str(from_file))
    assert resolve_modes(view) == StepModes("per-step", "stored")  # a workload file: every step is the stored one
    with pytest.raises(MpipeError, match="is a fixed list of microbatches, not a draw from a named mix"):
        resolve_modes(view, data="sampled")
    record = json.loads(open(sampled[2]).read())
    record["inputs"]["workload"]["microbatches"][1]["text_tokens"] += 1  # edited metadata
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(record))
    with pytest.raises(MpipeError, match="its stored microbatches are not step 0 of its recorded draw"):
        resolve_modes(read_plan_file(str(edited)))


def test_a_damaged_draw_is_refused_when_the_plan_is_read(tmp_path, sampled):
    record = json.loads(open(sampled[2]).read())
    record["inputs"]["workload"]["draw"]["mix"] = "no-such-mix"
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(record))
    with pytest.raises(MpipeError, match="the workload's draw .* must be"):
        read_plan_file(str(damaged))


def test_run_refuses_per_step_owners_without_a_policy_in_one_line(tmp_path):
    explicit = make_policy_plan(tmp_path, 2, None, (0, 0, 1, 1))
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "run", str(explicit), "--owners", "per-step"],
                          capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no owner policy" in lines[0], proc.stderr
