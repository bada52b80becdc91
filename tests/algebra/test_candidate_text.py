"""The candidate's one text form: ``Candidate.parse(str(c)) == c``, for what the search emits and for any candidate."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import DTYPE_BYTES, Candidate, Degrees, PLACEMENTS
from mpipe_tune.errors import MpipeError
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, baseline
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model


def test_every_candidate_the_search_emits_on_the_default_problem_parses_back():
    # plan's defaults (example-mllm, ideal, 4 devices, 16 sequences, balanced) with every searchable setting open
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 4, 16, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    options = SpaceOptions(recompute=(False, "selective", True), zero=(0, 1), sequence_parallel=(False, True),
                           encoder_tp=True, encoder_backward=PLACEMENTS)
    space = SearchSpace(problem, evaluator.reference_weights(), options)
    candidates = [c for _, c in space.enumerate()]
    assert len(candidates) > 100
    for c in candidates:
        assert Candidate.parse(str(c)) == c
    # What the plan command makes of them too: explicit slabs, owners and slots, and the baselines' labels.
    best = candidates[-1]
    prediction, _ = evaluator.prediction(replace(best, encoder_backward="optimised"))
    assert Candidate.parse(str(prediction.candidate)) == prediction.candidate
    for name in ("megatron", "gpipe", "mpipe-rr", "vpp"):
        c = baseline(name, problem.model, 2, 1, 2, 8)
        if c is not None:
            assert Candidate.parse(str(c)) == c


def test_the_text_form_reads_as_the_tables_print_it():
    c = Candidate("1f1b", (), pp=2, tp=1, dp=4, num_microbatches=8, recompute="selective", ep=4)
    assert str(c) == "<1f1b> cut -  pp2 tp1 dp4 ep4  M=8  recompute selective"
    assert Candidate.parse("<1f1b> cut -  pp2 dp4 ep4  M=8  recompute selective") == c  # tp1 by default
    assert c.degrees == Degrees(2, 1, 4, ep=4) and str(c.degrees) == "pp2 tp1 dp4 ep4"


def test_zero_stages_and_the_reshard_policy_read_and_print():
    for stage in (0, 2, 3):
        c = Candidate("1f1b", (), pp=2, dp=4, num_microbatches=8, zero_stage=stage)
        assert str(c) == f"<1f1b> cut -  pp2 tp1 dp4  M=8  zero{stage}" and Candidate.parse(str(c)) == c
    assert "zero" not in str(Candidate("1f1b", (), pp=2, dp=4, num_microbatches=8))  # stage 1: the default
    for policy, word in ((True, "reshard"), (False, "keep")):
        c = Candidate("1f1b", (), pp=2, dp=4, num_microbatches=8, zero_stage=3, reshard_after_forward=policy)
        assert str(c) == f"<1f1b> cut -  pp2 tp1 dp4  M=8  zero3 {word}"
        assert Candidate.parse(str(c)) == c and Candidate.from_dict(c.to_dict()) == c
        assert c.reshards_after_forward is policy
    with pytest.raises(MpipeError, match=r"the ZeRO stage is 4, but it must be one of 0, 1, 2, 3"):
        Candidate("1f1b", (), pp=2, dp=4, num_microbatches=8, zero_stage=4).validate()


@pytest.mark.parametrize("pp,default", [(1, True), (2, False), (8, False)])
def test_stage_3_reshards_after_forward_by_default_only_without_pipeline_parallelism(pp, default):
    c = Candidate("1f1b", (), pp=pp, dp=4, num_microbatches=8, zero_stage=3)
    assert c.reshard_after_forward is None and c.reshards_after_forward is default
    # the policy belongs to stage 3: another stage drops it (a stage-1 twin of a stage-3 plan)
    assert replace(c, zero_stage=1).reshard_after_forward is None
    assert not replace(c, zero_stage=2).reshards_after_forward


@pytest.mark.parametrize("text,words", [
    ("pp4 tp1 dp1  M=8", "does not start with its schedule"),
    ("<1f1b> cut -  pp2  M=8  zero4", "'zero4' is not a piece"),
    ("<1f1b> cut -  pp2  M=8  zero3 often", "reshard policy 'often'; use reshard or keep"),
    ("<1f1b> cut -  pp2  M=8  zero2 keep", "'zero2 keep' is not a piece"),
    ("<1f1b> cut -  pp2 tq1  M=8", "'tq1' is not a degree"),
    ("<1f1b> cut -  tp2  M=8", "pipeline degree is missing"),
    ("<1f1b> cut -  pp2  M=8  zero0  zero0", "repeats a setting"),
    ("<1f1b> cut -  pp2  M=8  recompute sometimes", "not a recomputation setting"),
    ("<1f1b> cut -  pp2  M=8  fast", "'fast' is not a piece"),
])
def test_a_text_that_does_not_parse_names_its_piece(text, words):
    with pytest.raises(MpipeError, match=words):
        Candidate.parse(text)


small = st.integers(1, 8)
int_lists = st.lists(st.integers(0, 9), min_size=1, max_size=5).map(tuple)


@given(schedule=st.sampled_from(["1f1b", "transpose,1f1b", "1f1b,1f1b", "transpose,zbv,zbv"]),
       cut=st.lists(st.integers(1, 60), max_size=3).map(lambda v: tuple(sorted(set(v)))),
       degrees=st.builds(Degrees, small, small, small, small, small, st.none() | small), m=small,
       owner_policy=st.sampled_from([None, "round-robin", "greedy", "optimal"]),
       slabs=st.none() | st.lists(st.lists(small, min_size=1, max_size=4).map(tuple), max_size=3).map(tuple),
       recompute=st.sampled_from([False, "selective", True]), label=st.sampled_from(["", "megatron", "current"]),
       zero=st.sampled_from([0, 1, 2, 3]), reshard=st.sampled_from([None, True, False]), sp=st.booleans(),
       owner_map=st.none() | int_lists,
       dtype=st.sampled_from(sorted(DTYPE_BYTES)), frozen=st.sampled_from([(), ("encoder",), ("encoder", "llm")]),
       placement=st.sampled_from(PLACEMENTS), slots=st.none() | int_lists, ranks=st.none() | int_lists)
def test_any_candidate_parses_back(schedule, cut, degrees, m, owner_policy, slabs, recompute, label, zero, reshard, sp,
                                   owner_map, dtype, frozen, placement, slots, ranks):
    c = Candidate(schedule, cut, num_microbatches=m, owner_policy=owner_policy, slab_counts=slabs, recompute=recompute,
                  label=label, zero_stage=zero, sequence_parallel=sp, owner_map=owner_map, dtype=dtype, frozen=frozen,
                  encoder_backward=placement, encoder_backward_slots=slots, encoder_backward_ranks=ranks,
                  reshard_after_forward=reshard, degrees=degrees)
    assert Candidate.parse(str(c)) == c
    if c.slab_counts != ():  # plan.json's form stores no Sharded region's slabs as null, as it always has
        assert Candidate.from_dict(c.to_dict()) == c


def test_the_degrees_keywords_and_the_record_build_the_same_candidate():
    by_keywords = Candidate("1f1b", (), pp=4, tp=2, dp=2, num_microbatches=8, ep=2, encoder_tp=1)
    by_record = Candidate("1f1b", (), num_microbatches=8, degrees=Degrees(4, 2, 2, ep=2, encoder_tp=1))
    assert by_keywords == by_record and hash(by_keywords) == hash(by_record)
    assert replace(by_keywords, tp=1).degrees == Degrees(4, 1, 2, ep=2, encoder_tp=1)
    assert replace(by_keywords, encoder_tp=2).encoder_tp is None  # equal to tp: stored as None
    assert (by_keywords.pp, by_keywords.tp, by_keywords.dp, by_keywords.ep, by_keywords.cp) == (4, 2, 2, 2, 1)
