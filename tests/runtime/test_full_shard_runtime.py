"""ZeRO-3 in the executor (FSDP2's ``fully_shard`` per layer on the data-parallel dimension): a
stage-3 run of a plan gives the same weights after a step as the stage-1 run of the same plan, its
first step's loss and every gradient equal the single-process step's, and between steps each rank
holds only its shard of every parameter (float64, 4 gloo ranks, one launch for every case).

Cases cover what a stage-3 plan can hold: pipeline x data parallelism, the replicated encoder of a
transpose plan (its shards summed over pipeline ranks), tensor parallelism (2-D shards) with and
without sequence parallelism and the encoder's own tp, frozen layers, expert parallelism with the
experts' own data-parallel group and without one, context parallelism, and a zero-bubble plan's split
backward (the weight gradients computed on parameters all-gathered again).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import (  # noqa: E402
    FIRST_LLM, MLA_MOE_MODEL, TEST_MODEL, WORKLOAD, assert_step_equals_reference, make_plan, reference_of,
)

from mpipe_tune.runtime.job import RunJob  # noqa: E402
from mpipe_tune.runtime.launch import launch_local  # noqa: E402
from mpipe_tune.runtime.worker import run_jobs  # noqa: E402

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
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("full-shard")
    jobs = {}
    for name, case in CASES.items():
        for zero in (1, 3):
            where = folder / f"case{len(jobs)}"
            (where / "grads").mkdir(parents=True)
            (where / "weights").mkdir()
            jobs[(name, zero)] = RunJob(str(make_plan(where, zero_stage=zero, **case)), steps=1, dtype="fp64",
                                        lr=0.05, grads_dir=str(where / "grads"), weights_dir=str(where / "weights"))
    results = launch_local(run_jobs, (list(jobs.values()),), RANKS, timeout_s=300, deadline_s=240)
    return jobs, dict(zip(jobs, results))


def _weights(job: RunJob) -> list[dict]:
    return [torch.load(f"{job.weights_dir}/rank{r}.pt") for r in range(RANKS)]


@pytest.mark.parametrize("case", list(CASES))
def test_stage_3_gives_the_stage_1_weights_after_a_step(runs, case):
    jobs, _ = runs
    stage1, stage3 = _weights(jobs[(case, 1)]), _weights(jobs[(case, 3)])
    for rank in range(RANKS):
        assert stage3[rank].keys() == stage1[rank].keys()
        for name, held in stage1[rank].items():
            torch.testing.assert_close(stage3[rank][name]["weight"], held["weight"], rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_stage_3_first_step_equals_the_single_process_step(runs, case):
    jobs, results = runs
    spec = CASES[case]
    dp = spec.get("dp", 1)
    reference = reference_of(spec.get("frozen", ()), spec.get("model_spec", TEST_MODEL), WORKLOAD.microbatches * dp)
    assert_step_equals_reference(jobs[(case, 3)].grads_dir, RANKS, results[(case, 3)]["summary"], reference,
                                 dp * len(WORKLOAD), losses_shared=True, replica_atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_holds_only_its_shard_between_steps(runs, case):
    """What a data-parallel group (dp x cp ranks; a sharded routed expert's is dp x cp / ep) holds of a
    parameter at stage 3 is the rows of what each of its ranks holds at stage 1, cut into one even
    share per rank (dim 0; the last shares shorter or empty when it does not divide); a group of one
    (experts at ep = dp x cp) holds them whole."""
    jobs, _ = runs
    spec = CASES[case]
    stage1, stage3 = _weights(jobs[(case, 1)]), _weights(jobs[(case, 3)])
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
