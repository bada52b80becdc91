"""ZeRO-2 and ZeRO-3 in the executor (FSDP2's ``fully_shard`` per layer on the data-parallel dimension):
a stage-3 run of a plan gives the same weights after a step as the stage-1 run of the same plan, its
first step's loss and every gradient equal the single-process step's, and between steps each rank
holds only its shard of every parameter (float64, 4 gloo ranks, one launch for every case). Stage 2
and stage 3 keeping the weights through the step (its default under pipeline parallelism) run the
same checks on the cases of :data:`KEPT`.

Cases cover what a stage-3 plan can hold: pipeline x data parallelism, the replicated encoder of a
transpose plan (its shards summed over pipeline ranks), tensor parallelism (2-D shards) with and
without sequence parallelism and the encoder's own tp, frozen layers, expert parallelism with the
experts' own data-parallel group and without one, context parallelism, a zero-bubble plan's split
backward (the weight gradients computed on parameters all-gathered again), and encoder backwards moved
off their owners (a no-grad encode on the owner, the encode again with autograd on the other rank).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of,
)

from mpipe_tune.algebra import Candidate  # noqa: E402
from mpipe_tune.algebra import Degrees  # noqa: E402
from mpipe_tune.algebra import Bwd  # noqa: E402
from mpipe_tune.cost import CompiledPlan  # noqa: E402
from mpipe_tune.cost import CostOptions  # noqa: E402
from mpipe_tune.cost import predict  # noqa: E402
from mpipe_tune.cost import load_profile  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record  # noqa: E402
from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime import read_plan_file  # noqa: E402
from mpipe_tune.runtime import run_jobs  # noqa: E402

RANKS = 4
TRANSPOSE = dict(schedule="transpose,1f1b", cut=(FIRST_LLM,))
CASES = {  # name -> make_plan's arguments
    "pp2 x dp2, 1f1b": dict(schedule="1f1b", cut=(), num_ranks=2, dp=2),
    "pp2 x dp2, transpose,1f1b": dict(num_ranks=2, dp=2, **TRANSPOSE),
    "pp2 x dp2, zb1p": dict(schedule="zb1p", cut=(), num_ranks=2, dp=2),
    "tp2 x dp2, sp, frozen encoder": dict(schedule="1f1b", cut=(), num_ranks=1, tp=2, dp=2, sequence_parallel=True,
                                          frozen=("encoder", "projector")),
    "tp2 x dp2, encoder tp 1": dict(schedule="1f1b", cut=(), num_ranks=1, tp=2, dp=2, encoder_tp=1),
    "pp2 x cp2, transpose,1f1b": dict(num_ranks=2, cp=2, **TRANSPOSE),
    "dp4, ep2 (MLA, MoE)": dict(schedule="1f1b", cut=(), num_ranks=1, dp=4, ep=2, model_spec=MLA_MOE_MODEL),
    "tp2 x dp2, ep2 (MLA, MoE)": dict(schedule="1f1b", cut=(), num_ranks=1, tp=2, dp=2, ep=2,
                                      model_spec=MLA_MOE_MODEL),
    "pp2 x dp2, transpose,1f1b, encoder backwards moved": dict(num_ranks=2, dp=2, moved=True),
}


KEPT = ("pp2 x dp2, 1f1b", "pp2 x dp2, transpose,1f1b", "tp2 x dp2, sp, frozen encoder", "dp4, ep2 (MLA, MoE)")
"""The cases also run at stage 2 and at stage 3 keeping the weights."""
STAGES = {"3": dict(zero_stage=3), "2": dict(zero_stage=2), "3-keep": dict(zero_stage=3, reshard_after_forward=False)}
SHARDED = [(case, stage) for case in CASES for stage in STAGES if stage == "3" or case in KEPT]


def moved_encoder_backward_plan(folder, zero_stage: int):
    """A transpose plan whose encoder backwards run on the rank after their owner, in its cooldown (full
    recomputation: the owner's encode keeps no autograd, the other rank encodes again), at dp 2."""
    model, profile = load_model(TEST_MODEL), load_profile("ideal")
    options = CostOptions(dtype="fp32", degrees=Degrees(1, dp=2), shard_parameters=zero_stage >= 3)

    def candidate(slots=None, ranks=None):
        return Candidate("transpose,1f1b", (FIRST_LLM,), pp=2, tp=1, dp=2, num_microbatches=len(WORKLOAD),
                         owner_policy="round-robin", dtype="fp32", recompute="full", zero_stage=zero_stage,
                         encoder_backward="cooldown" if slots is None else "optimised", encoder_backward_slots=slots,
                         encoder_backward_ranks=ranks)

    cooldown = predict(candidate(), model, WORKLOAD, profile, options)
    compiled = CompiledPlan(cooldown.plan, model, profile, cooldown.options)
    ranks = tuple((owner + 1) % 2 for owner in compiled.owners)
    moved = predict(candidate(compiled.backbone_steps.cooldown_slots(ranks), ranks), model, WORKLOAD, profile, options)
    path = folder / f"moved-zero{zero_stage}.json"
    dump_plan(plan_record(moved, model, WORKLOAD, profile, PlanInputs(TEST_MODEL, (), "ideal")), path)
    view = read_plan_file(str(path))
    assert all(view.plan.index[Bwd(1, r, m)] in view.nodes[r] for m, r in enumerate(ranks))  # moved, as stored
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("full-shard")
    jobs = {}
    for name, case in CASES.items():
        for stage in ("1", *(s for c, s in SHARDED if c == name)):
            setting = STAGES.get(stage, dict(zero_stage=1))
            where = folder / f"case{len(jobs)}"
            (where / "grads").mkdir(parents=True)
            (where / "weights").mkdir()
            path = (moved_encoder_backward_plan(where, setting["zero_stage"]) if case.get("moved")
                    else make_plan(where, **setting, **case))
            jobs[(name, stage)] = RunJob(str(path), steps=1, dtype="fp64",
                                        lr=0.05, grads_dir=str(where / "grads"), weights_dir=str(where / "weights"))
    # 21 runs in one launch: a deadline that holds on a loaded 2-core host
    results = launch_local(run_jobs, (list(jobs.values()),), RANKS, timeout_s=300, deadline_s=600)
    return jobs, dict(zip(jobs, results))


def _weights(job: RunJob) -> list[dict]:
    return [torch.load(f"{job.weights_dir}/rank{r}.pt") for r in range(RANKS)]


@pytest.mark.parametrize("case,stage", SHARDED)
def test_stage_3_gives_the_stage_1_weights_after_a_step(runs, case, stage):
    jobs, _ = runs
    stage1, stage3 = _weights(jobs[(case, "1")]), _weights(jobs[(case, stage)])
    for rank in range(RANKS):
        assert stage3[rank].keys() == stage1[rank].keys()
        for name, held in stage1[rank].items():
            torch.testing.assert_close(stage3[rank][name]["weight"], held["weight"], rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("case,stage", SHARDED)
def test_stage_3_first_step_equals_the_single_process_step(runs, case, stage):
    jobs, results = runs
    spec = CASES[case]
    dp = spec.get("dp", 1)
    reference = reference_of(spec.get("frozen", ()), spec.get("model_spec", TEST_MODEL), WORKLOAD.microbatches * dp)
    assert_step_equals_reference(jobs[(case, stage)].grads_dir, RANKS, results[(case, stage)]["summary"], reference,
                                 dp * len(WORKLOAD), losses_shared=True, replica_atol=1e-12)


@pytest.mark.parametrize("case,stage", SHARDED)
def test_each_rank_holds_only_its_shard_between_steps(runs, case, stage):
    """What a data-parallel group (dp x cp ranks; a sharded routed expert's is dp x cp / ep) holds of a
    parameter at stage 3 is the rows of what each of its ranks holds at stage 1, cut into one even
    share per rank (dim 0; the last shares shorter or empty when it does not divide); a group of one
    (experts at ep = dp x cp) holds them whole."""
    jobs, _ = runs
    spec = CASES[case]
    stage1, stage3 = _weights(jobs[(case, "1")]), _weights(jobs[(case, stage)])
    tp, data, ep = spec.get("tp", 1), spec.get("dp", 1) * spec.get("cp", 1), spec.get("ep", 1)
    sharded = 0
    for pp_rank in range(spec["num_ranks"]):
        for tp_rank in range(tp):
            group = [(pp_rank * data + d) * tp + tp_rank for d in range(data)]  # tp innermost, then dp x cp
            for experts in [group[e::ep] for e in range(ep)]:  # the ranks holding the same routed experts
                for name, held in stage1[experts[0]].items():
                    routed = ep > 1 and ".mlp.experts." in name
                    if not routed and experts[0] != group[0]:
                        continue  # a parameter every rank of the group holds: once, over the whole group
                    members, whole = experts if routed else group, held["held_shape"]
                    shapes = [stage3[r][name]["held_shape"] for r in members]
                    if len(members) == 1 or not whole:
                        assert shapes == [whole], f"{name}: {shapes}, {whole}"
                        continue
                    share = -(-whole[0] // len(members))
                    rows = [max(0, min(share, whole[0] - k * share)) for k in range(len(members))]
                    assert shapes == [(n, *whole[1:]) for n in rows], f"{name}: {shapes} of {whole}"
                    sharded += 1
    assert sharded > 0
