"""Expert and context parallelism, ZeRO stage, recompute granularity and sequence parallelism as search choices."""

from dataclasses import replace
from pathlib import Path

import pytest

from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions
from mpipe_tune.algebra import Candidate
from mpipe_tune.search._compare import evaluate_baselines, row
from mpipe_tune.search._families import family_candidates
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MOE = load_model(str(Path(__file__).parents[1] / "runtime" / "tiny-mllm-mla-moe.yaml"))  # 4 experts per MoE layer
IDEAL = load_profile("ideal")


def space(devices=8, **options):
    problem = Problem(MOE, IDEAL, devices, 16, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    return SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(max_microbatches=8, **options)), evaluator


def test_the_default_space_has_no_new_choices():
    s, _ = space()
    leaves = [c for _, c in s.enumerate()]
    assert {(c.ep, c.cp, c.zero_stage, c.sequence_parallel) for c in leaves} == {(1, 1, 1, False)}
    assert all(set(params) <= {"degrees", "schedule", "cut", "owners", "microbatch_size", "recompute"} | {
        p for p in params if p.split("[")[0] in ("schedule", "cut", "owners", "microbatch_size")}
        for params, _ in s.enumerate())


def test_expert_parallel_degrees_are_carved_from_dp_and_divide_the_experts():
    s, _ = space(ep=None)
    leaves = [c for _, c in s.enumerate()]
    assert {c.ep for c in leaves} == {1, 2, 4}
    for c in leaves:
        assert c.dp % c.ep == 0 and 4 % c.ep == 0
    assert {(c.dp, c.ep) for c in leaves} >= {(4, 4), (4, 2), (2, 2), (2, 1)}  # pp >= 2: dp <= 4
    assert s.expert_choices(8, 1) == [1, 2, 4]  # 8 does not divide the 4 experts


def test_context_parallel_layouts_fill_the_devices():
    s, _ = space(cp=(1, 2))
    assert {layout[3] for layout in s.layouts} == {1, 2}
    for pp, tp, dp, cp in s.layouts:
        assert pp * tp * dp * cp == 8
    leaves = [c for _, c in s.enumerate()]
    assert {c.cp for c in leaves} == {1, 2} and all(c.num_devices == 8 for c in leaves)


def test_memory_choices_are_searched_when_asked():
    s, _ = space(recompute=(False, "selective", True), zero=(0, 1), sequence_parallel=(False, True), tp=(2,))
    leaves = [c for _, c in s.enumerate()]
    assert {c.recompute for c in leaves} == {False, "selective", True}
    assert {c.zero_stage for c in leaves} == {0, 1} and {c.sequence_parallel for c in leaves} == {False, True}


def test_baselines_are_planned_at_the_best_plans_degrees_and_memory_policy():
    s, evaluator = space(ep=None, zero=(0, 1))
    best = evaluator.evaluate(next(c for _, c in s.enumerate() if c.ep == 2 and c.zero_stage == 0))
    for name, e in evaluate_baselines(evaluator, s, best):
        if e is not None:
            c = e.candidate
            assert (c.pp, c.tp, c.dp, c.ep, c.cp, c.zero_stage) == (best.candidate.pp, best.candidate.tp,
                                                                     best.candidate.dp, 2, 1, 0), name
            r = row(name, e, None, best)
            assert (r["ep"], r["cp"], r["zero_stage"]) == (2, 1, 0)
    own = family_candidates("megatron", s)
    assert {c.ep for c in own} == {1, 2, 4} and {c.zero_stage for c in own} == {0, 1}


def test_zero1_never_costs_time_and_saves_memory():
    s, evaluator = space(ep=None)
    c = next(c for _, c in s.enumerate() if c.dp >= 2)
    one, none = evaluator.evaluate(c), evaluator.evaluate(replace(c, zero_stage=0))
    # The same reduce bytes; each rank updates only its 1/dp shard of the optimizer state, so never slower.
    assert all(a <= b for a, b in zip(one.makespans_s, none.makespans_s)) and one.peak_bytes < none.peak_bytes


def test_old_candidate_records_read_as_what_they_meant():
    old = {"schedule": "1f1b", "cut": [], "pp": 2, "tp": 1, "dp": 4, "microbatches": 8, "recompute": True}
    c = Candidate.from_dict(old)
    assert (c.ep, c.cp, c.zero_stage, c.sequence_parallel, c.recompute) == (1, 1, 1, False, True)
    assert Candidate.from_dict(c.to_dict()) == c
    new = replace(c, ep=4, recompute="selective")
    assert Candidate.from_dict(new.to_dict()) == new
    assert str(new) == "<1f1b> cut -  pp2 tp1 dp4 ep4  M=8  recompute selective"


def test_a_space_of_invalid_expert_degrees_says_so():
    from mpipe_tune.errors import MpipeError

    with pytest.raises(MpipeError, match="ep pinned to 8"):
        space(ep=(8,))
