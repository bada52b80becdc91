"""The Candidate value type (algebra/_candidate.py): its stored form round-trips, it derives what derive
gives, and its checks name quantities, not flags."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import make_model
from mpipe_tune.algebra import Candidate, default_cut, Owners, derive, Cut, parse_schedule
from mpipe_tune.errors import MpipeError

MODEL = make_model(["encoder"] * 2 + ["projector"] + ["llm"] * 6)


@st.composite
def candidates(draw):
    transpose = draw(st.booleans())
    pp = draw(st.integers(1, 4))
    M = draw(st.integers(1, 8))
    return Candidate(
        "transpose,1f1b" if transpose else draw(st.sampled_from(["1f1b", "gpipe"])), (3,) if transpose else (),
        pp=pp, tp=draw(st.sampled_from([1, 2, 4])), dp=draw(st.integers(1, 4)), num_microbatches=M,
        owner_policy=draw(st.sampled_from([None, "round-robin", "greedy"])) if transpose else None,
        owner_map=tuple(draw(st.integers(0, pp - 1)) for _ in range(M)) if transpose and draw(st.booleans()) else None,
        slab_counts=((6 // pp,) * pp,) if draw(st.booleans()) else None,
        recompute=draw(st.sampled_from([False, True, "selective"])), label=draw(st.sampled_from(["", "megatron"])),
        ep=draw(st.sampled_from([1, 2])), zero_stage=draw(st.sampled_from([0, 1, 3])),
        sequence_parallel=draw(st.booleans()), encoder_tp=draw(st.sampled_from([None, 1])),
        dtype=draw(st.sampled_from(["bf16", "fp32"])), frozen=draw(st.sampled_from([(), ("encoder",)])),
    )


@given(candidates())
def test_the_stored_form_round_trips(c):
    assert Candidate.from_dict(c.to_dict()) == c


def test_a_trial_record_from_before_the_plan_files_names_still_reads():
    old = {"schedule": "1f1b", "cut": [], "pp": 2, "tp": 1, "dp": 1, "microbatches": 4, "owner_policy": None,
           "slab_counts": [[4, 5]], "recompute": False, "label": ""}
    c = Candidate.from_dict(old)
    assert c.slab_counts == ((4, 5),) and c.dtype == "bf16" and c.frozen == () and c.owner_map is None


def test_derive_of_a_candidate_is_derive_of_its_parts_on_its_frozen_model():
    c = Candidate("transpose,1f1b", (3,), pp=2, tp=1, dp=1, num_microbatches=4, owner_map=(1, 1, 0, 0),
                  frozen=("encoder",))
    plan = c.derive(MODEL)
    again = derive(Cut((3,)), parse_schedule("transpose,1f1b"), MODEL.with_frozen(("encoder",)), 2, 4,
                   Owners(microbatch=(1, 1, 0, 0)))
    assert plan.order == again.order and plan.placement == again.placement
    assert plan.source is not None and plan.source.owner.owners == (1, 1, 0, 0)
    assert Candidate("1f1b", (), pp=2, tp=1, dp=1, num_microbatches=4).derive(MODEL).source is None


def test_the_default_cut_is_before_the_first_backbone_layer():
    assert MODEL.backbone_start == 3 and MODEL.encoder_end == 2
    assert default_cut(MODEL, 2) == Cut((3,)) and default_cut(MODEL, 1) == Cut(())
    with pytest.raises(MpipeError, match="a schedule of 3 regions needs a cut of 2 boundaries"):
        default_cut(MODEL, 3)


@pytest.mark.parametrize("fields,words", [
    (dict(pp=0), "the pipeline degree P is 0, but P must be an integer >= 1"),
    (dict(num_microbatches=0), "the microbatch count M is 0, but M must be an integer >= 1"),
    (dict(dtype="fp7"), "dtype 'fp7' is not a known dtype"),
    (dict(owner_map=(0, 1)), "has no transpose region"),
])
def test_a_bad_candidate_names_the_quantity_not_a_flag(fields, words):
    c = Candidate(**{**dict(schedule="1f1b", cut=(), pp=2, tp=1, dp=1, num_microbatches=2), **fields})
    with pytest.raises(MpipeError) as info:
        c.validate()
    assert words in str(info.value) and "--" not in str(info.value)
