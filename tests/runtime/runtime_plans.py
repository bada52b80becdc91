"""Runtime test helpers: plans of the tiny test model, made with the planner's own functions.

A plain module with a unique name (not a conftest.py): the tests import it by name, and so do the
rank processes that unpickle the test's worker functions.
"""

from __future__ import annotations

from pathlib import Path

from mpipe_tune.algebra import Degrees, Cut, parse_schedule
from mpipe_tune.cost import CostOptions
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model
from conftest import predict_plan

TEST_MODEL = str(Path(__file__).with_name("tiny-mllm.yaml"))
"""Every kind the runtime builds (12 layers: 5 image-stream, then embedding .. lm_head)."""
FIRST_LLM = 5
MLA_MOE_MODEL = str(Path(__file__).with_name("tiny-mllm-mla-moe.yaml"))
"""The same encoder in front of an MLA + MoE backbone (its backbone also starts at layer FIRST_LLM)."""

# Images differ per microbatch (one microbatch has none); text lengths differ too.
WORKLOAD = Workload(
    (Microbatch(3, 8, (1, 2)), Microbatch(0, 6), Microbatch(4, 10, (4,)), Microbatch(4, 7, (2, 1, 1))),
    "runtime-test",
)


def make_plan(folder: Path, schedule: str, cut: tuple[int, ...], num_ranks: int, *, frozen: tuple[str, ...] = (),
              model_spec: str = TEST_MODEL, workload: Workload = WORKLOAD, profile: str = "ideal",
              tp: int = 1, dp: int = 1, dtype: str = "fp32", ep: int = 1, cp: int = 1,
              sequence_parallel: bool = False, encoder_tp: int | None = None, zero_stage: int = 1,
              reshard_after_forward: bool = True) -> Path:
    """Predict one candidate (``num_ranks`` pipeline ranks, each ``tp`` x ``cp`` x ``dp`` devices, ``ep``
    carved from ``dp`` x ``cp``) and write its plan.json; returns the path."""
    model = load_model(model_spec)
    if frozen:
        model = model.with_frozen(frozen)
    hw = load_profile(profile)
    options = CostOptions(dtype=dtype, degrees=Degrees(1, tp=tp, dp=dp, ep=ep, cp=cp, encoder_tp=encoder_tp),
                          sequence_parallel=sequence_parallel, shard_optimizer=zero_stage >= 1,
                          shard_gradients=zero_stage == 2, shard_parameters=zero_stage >= 3,
                          reshard_after_forward=reshard_after_forward)
    prediction = predict_plan(Cut(cut), parse_schedule(schedule), model, workload, hw, num_ranks, options=options)
    degrees = "".join(f"-{k}{v}" for k, v in (("ep", ep), ("cp", cp)) if v > 1) + (
        f"-etp{encoder_tp}" if encoder_tp is not None else "")
    name = (f"{Path(model_spec).stem}-{schedule.replace(',', '_')}-p{num_ranks}-tp{tp}-dp{dp}{degrees}"
            + ("-sp" if sequence_parallel else "") + ("-frozen" if frozen else "") + f"-zero{zero_stage}"
            + ("-keep" if zero_stage == 3 and not reshard_after_forward else "") + ".json")
    path = Path(folder) / name
    dump_plan(plan_record(prediction, model, workload, hw, PlanInputs(model_spec, frozen, profile)), path)
    return path


def assert_step_equals_reference(grads_dir, world_size: int, summary: dict, reference, num_microbatches: int, *,
                                 losses_shared: bool = False, replica_atol: float = 1e-14) -> None:
    """The ranks' saved first step (``RunJob.grads_dir``) against the single-process ``reference``
    (summed loss, gradients): every microbatch's loss once (or, with ``losses_shared``, the same on
    every tensor-parallel rank that computes it), a layer held by several ranks with one gradient on
    all of them, and every trainable parameter's gradient equal to the reference's (float64)."""
    import pytest
    import torch

    ref_loss, ref_grads = reference
    grads, losses = {}, {}
    files = sorted(Path(grads_dir).glob("rank*.pt"))
    assert len(files) == world_size
    for f in files:
        saved = torch.load(f)
        for m, loss in saved["losses"].items():
            if losses_shared and m in losses:
                assert loss == pytest.approx(losses[m], rel=1e-12)
            else:
                assert m not in losses, f"microbatch {m}'s loss computed on two ranks"
            losses[m] = loss
        for name, g in saved["grads"].items():
            if name in grads:  # a layer on several ranks (replicas, tp ranks, the replicated encoder)
                torch.testing.assert_close(g, grads[name], rtol=1e-10 if replica_atol > 1e-14 else 0, atol=replica_atol)
            grads[name] = g
    assert sorted(losses) == list(range(num_microbatches)), "each replica trains its own microbatches"
    assert sum(losses.values()) == pytest.approx(ref_loss, rel=1e-12)
    assert summary["loss_sums"][0] == pytest.approx(ref_loss, rel=1e-12)
    assert set(grads) == set(ref_grads), "every trainable parameter (and no frozen one) has a gradient"
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def make_policy_plan(folder: Path, num_ranks: int, policy: str | None, stored_owners: tuple[int, ...], *,
                     frozen: tuple[str, ...] = (), workload: Workload = WORKLOAD, profile: str = "ideal",
                     model_spec: str = TEST_MODEL, cut: tuple[int, ...] = (FIRST_LLM,)) -> Path:
    """A ``<transpose,1f1b>`` plan whose candidate names owner ``policy`` and stores the explicit map
    ``stored_owners``: an example map that need not be the one the policy gives."""
    from mpipe_tune.algebra import Candidate
    from mpipe_tune.cost import predict

    model = load_model(model_spec)
    if frozen:
        model = model.with_frozen(frozen)
    hw = load_profile(profile)
    c = Candidate("transpose,1f1b", cut, num_ranks, 1, 1, len(workload), policy,
                  owner_map=tuple(stored_owners), dtype="fp32")
    prediction = predict(c, model, workload, hw, CostOptions())
    path = Path(folder) / (f"{Path(model_spec).stem}-{policy}-p{num_ranks}-{''.join(map(str, stored_owners))}"
                           f"{'-frozen' if frozen else ''}.json")
    dump_plan(plan_record(prediction, model, workload, hw, PlanInputs(model_spec, frozen, profile)), path)
    return path


def sampled_problem(num_ranks: int, num_microbatches: int, *, mix: str = "smoke", seed: int = 5,
                    sequences_per_microbatch: int = 2, samples: int = 4):
    """A planning problem of the test model on the ideal profile whose steps are sampled from ``mix``."""
    from mpipe_tune.search import Problem

    return Problem(load_model(TEST_MODEL), load_profile("ideal"), num_ranks,
                   num_microbatches * sequences_per_microbatch, mix=mix, num_samples=samples, seed=seed)


def make_sampled_plan(folder: Path, problem, candidate, name: str = "sampled") -> Path:
    """``candidate``'s plan file as ``plan`` writes it: predicted on the problem's sampled step 0, with
    the draw that makes its later steps."""
    from mpipe_tune.search import Evaluator

    prediction, workload = Evaluator(problem).prediction(candidate)
    path = Path(folder) / f"{name}.json"
    dump_plan(plan_record(prediction, problem.model, workload, problem.profile, PlanInputs(TEST_MODEL, (), "ideal")),
              path)
    return path


def run_cases(folder: Path, cases: dict, num_ranks: int, *, steps: int = 1) -> tuple[dict, dict]:
    """Plan every ``name: (schedule, cut, frozen)`` of ``cases`` at ``num_ranks`` and run them in turn in
    one local launch (float64, each rank saving its first step's gradients): name -> job, name -> result."""
    paths = {name: make_plan(folder, schedule, cut, num_ranks, frozen=frozen)
             for name, (schedule, cut, frozen) in cases.items()}
    return run_plan_files(folder, paths, num_ranks, steps=steps)


def run_plan_files(folder: Path, paths: dict, num_ranks: int, *, steps: int = 1,
                   deadline_s: float = 150) -> tuple[dict, dict]:
    """Run every ``name: plan file`` of ``paths`` in turn in one local launch (float64, each rank saving
    its first step's gradients under ``folder``): name -> job, name -> result."""
    from mpipe_tune.runtime import RunJob, launch_local, run_jobs

    jobs = {}
    for name, path in paths.items():
        grads = folder / f"grads-{len(jobs)}"
        grads.mkdir()
        jobs[name] = RunJob(str(path), steps=steps, dtype="fp64", lr=0.05, grads_dir=str(grads))
    # Hang guards, not timing goals: the deadline counts from the moment every rank joined (a slow start on a
    # loaded host is not counted), and a run of these tiny models takes seconds of it on the loaded 2-core machine.
    results = launch_local(run_jobs, (list(jobs.values()),), num_ranks, timeout_s=300, deadline_s=deadline_s)
    return jobs, dict(zip(jobs, results))


def run_plan_cases(folder: Path, cases: dict, num_ranks: int, *, deadline_s: float = 240) -> tuple[dict, dict]:
    """Plan every ``name: make_plan keyword arguments`` of ``cases`` and run them in one local launch
    (:func:`run_plan_files`): name -> job, name -> result."""
    paths = {name: make_plan(folder, **kwargs) for name, kwargs in cases.items()}
    return run_plan_files(folder, paths, num_ranks, deadline_s=deadline_s)


def assert_case_equals_reference(runs: tuple[dict, dict], name: str, case: dict, num_ranks: int) -> None:
    """Case ``name`` (its ``make_plan`` keyword arguments ``case``) of :func:`run_plan_cases`'s ``runs``
    against one process stepping through every replica's microbatches (tensor-parallel ranks share losses)."""
    jobs, results = runs
    dp, model = case.get("dp", 1), case.get("model_spec", TEST_MODEL)
    assert_step_equals_reference(jobs[name].grads_dir, num_ranks, results[name]["summary"],
                                 reference_of((), model, WORKLOAD.microbatches * dp), dp * len(WORKLOAD),
                                 losses_shared=True, replica_atol=1e-12)


def reference_of(frozen: tuple[str, ...], model_spec: str = TEST_MODEL, microbatches=WORKLOAD.microbatches):
    """The single-process reference step of ``model_spec`` with its ``frozen`` blocks frozen."""
    from mpipe_tune.runtime import blueprint
    from mpipe_tune.runtime._mllm import reference_step

    model = load_model(model_spec)
    return reference_step(blueprint(model.with_frozen(frozen) if frozen else model), microbatches, seed=0)
