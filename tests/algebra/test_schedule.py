import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import Cut, Schedule, Skeleton, normalize, parse_cut, parse_schedule, validate_schedule
from mpipe_tune.errors import MpipeError

skeletons = st.sampled_from(list(Skeleton))


@st.composite
def cut_and_schedule(draw):
    num_layers = draw(st.integers(2, 30))
    k = draw(st.integers(1, min(6, num_layers)))
    boundaries = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=k - 1, max_size=k - 1)))
    sched = Schedule(tuple(draw(skeletons) for _ in range(len(boundaries) + 1)))
    return num_layers, Cut(tuple(boundaries)), sched


def test_transpose_transpose_normalises_to_transpose():
    cut, sched = normalize(Cut((3,)), parse_schedule("transpose,transpose"))
    assert cut == Cut(()) and str(sched) == "transpose"


def test_normalize_keeps_separated_transposes():
    cut, sched = normalize(Cut((2, 5)), parse_schedule("transpose,1f1b,transpose"))
    assert cut == Cut((2, 5)) and str(sched) == "transpose,1f1b,transpose"


@given(cut_and_schedule())
def test_normal_form_is_idempotent_valid_and_covers_the_same_layers(case):
    num_layers, cut, sched = case
    once = normalize(cut, sched)
    assert normalize(*once) == once
    validate_schedule(*once, num_layers)
    assert once[1].is_normal()
    # Every layer keeps its layout.
    def layout_of_layer(c, s):
        return [s.skeletons[j].layout for j, (a, b) in enumerate(c.regions(num_layers)) for _ in range(a, b)]
    assert layout_of_layer(*once) == layout_of_layer(cut, sched)


def test_schedule_text_round_trips():
    for text in ("transpose,1f1b", "1f1b", "gpipe,gpipe,gpipe", "transpose,1f1b,transpose"):
        assert str(parse_schedule(text)) == text


@pytest.mark.parametrize("cut,sched,match", [
    (Cut((0,)), "transpose,1f1b", r"boundary 1 is 0.*\(0, 10\)"),
    (Cut((10,)), "transpose,1f1b", r"boundary 1 is 10"),
    (Cut((5, 3)), "transpose,1f1b,1f1b", r"increase strictly"),
    (Cut((5, 5)), "transpose,1f1b,1f1b", r"increase strictly"),
    (Cut((5,)), "1f1b", r"1 skeleton\(s\) but cut '5' makes 2 region"),
    (Cut((5,)), "transpose,transpose", r"not normal form"),
])
def test_invalid_cuts_and_schedules_name_the_problem(cut, sched, match):
    with pytest.raises(MpipeError, match=match):
        validate_schedule(cut, parse_schedule(sched), 10)


def test_unknown_skeleton_is_named():
    with pytest.raises(MpipeError, match="skeleton 2 is 'zb'.*1f1b, gpipe, transpose"):
        parse_schedule("transpose,zb")


def test_cut_must_be_integers():
    with pytest.raises(MpipeError, match="integers"):
        parse_cut("a,3")
