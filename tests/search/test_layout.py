"""A layout given as text (``--current``) is a candidate of the same algebra; bad text is one line."""

from dataclasses import replace

import pytest

from mpipe_tune.errors import MpipeError
from mpipe_tune.search import Evaluator, Problem, SearchSpace, baseline
from mpipe_tune.search._layout import parse_layout, split_pairs
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

MODEL = load_model("example-mllm")  # 8 encoder layers, 1 projector, 16 backbone layers


@pytest.fixture(scope="module")
def space():
    problem = Problem(MODEL, load_profile("ideal"), 4, 16, mix="balanced", num_samples=1)
    return SearchSpace(problem, Evaluator(problem).reference_weights())


def test_1f1b_without_a_cut_is_the_megatron_layout(space):
    c = parse_layout("pp=4,tp=1,dp=1,schedule=1f1b,M=8,recompute=on", space)
    assert c == replace(baseline("megatron", MODEL, 4, 1, 1, 8), recompute=True, label="current")


def test_defaults_fill_the_devices_and_take_one_sequence_per_microbatch(space):
    c = parse_layout("pp=2,schedule=gpipe", space)
    assert (c.pp, c.tp, c.dp, c.num_microbatches, c.recompute) == (2, 1, 2, 8, False)
    assert c.slab_counts == baseline("gpipe", MODEL, 2, 1, 2, 8).slab_counts


def test_schedules_with_commas_take_their_baseline_layouts(space):
    vpp = parse_layout("pp=2,dp=2,schedule=1f1b,1f1b,1f1b,M=4", space)
    assert vpp == replace(baseline("vpp", MODEL, 2, 1, 2, 4, vpp_microbatches=(4,), num_chunks=3), label="current")
    rr = parse_layout("schedule=transpose,1f1b,pp=4,owners=greedy", space)
    assert (rr.schedule, rr.cut, rr.owner_policy, rr.num_microbatches) == ("transpose,1f1b", (9,), "greedy", 16)


def test_a_given_cut_balances_slabs_by_cost_as_the_search_does(space):
    c = parse_layout("pp=2,tp=2,dp=1,schedule=transpose,1f1b,1f1b,cut=8,17,M=16", space)
    assert (c.schedule, c.cut, c.slab_counts, c.owner_policy) == ("transpose,1f1b,1f1b", (8, 17), None, "round-robin")
    assert Evaluator(space.problem).evaluate(c).mean_s > 0


def test_split_pairs_keeps_commas_inside_lists():
    assert split_pairs("schedule=transpose,1f1b,cut=9,pp=2") == {"schedule": "transpose,1f1b", "cut": "9", "pp": "2"}


@pytest.mark.parametrize("text,words", [
    ("pp=4,tp=1,dp=2,schedule=1f1b", "pp*tp*dp = 4*1*2 = 8, but it must equal the 4 devices"),
    ("pp=3,schedule=1f1b", "pp*tp = 3 does not divide the 4 devices"),
    ("pp=4,schedule=1f1b,M=5", "M=5, but the microbatch count must divide the 16 sequences per replica"),
    ("pp=0,schedule=1f1b", "pp=0, but the pipeline degree must be an integer >= 1"),
    ("pp=four,schedule=1f1b", "pp=four"),
    ("pp=4,schedule=zigzag", "skeleton 1 is 'zigzag'"),
    ("pp=4,schedul=1f1b", "key 'schedul' is unknown"),
    ("pp=4,pp=2,schedule=1f1b", "key 'pp' is given twice"),
    ("schedule=1f1b", "key 'pp' is missing"),
    ("pp=4,tp=1,dp=1,8,schedule=1f1b", "'8' is not a key=value pair"),
    ("pp=4,schedule=1f1b,recompute=maybe", "recompute=maybe, but it must be on or off"),
    ("pp=4,schedule=1f1b,owners=greedy", "owners=greedy"),
    ("pp=4,schedule=transpose,1f1b,cut=30", "boundary 1 is 30"),
    ("pp=4,schedule=transpose,1f1b,cut=23", "region 2 holds 2 layer(s), but each of the pp=4 ranks"),
    ("pp=4,schedule=1f1b,gpipe", "has no default cut"),
])
def test_bad_layouts_are_one_line_errors_that_name_the_value(space, text, words):
    with pytest.raises(MpipeError) as info:
        parse_layout(text, space)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"current layout '{text}': ") and words in message, message


def test_tp_must_divide_a_node(space):
    two_per_node = replace(space.problem, profile=replace(space.problem.profile, devices_per_node=2))
    with pytest.raises(MpipeError, match="tp=4, but the tensor-parallel degree must divide the 2 devices per node"):
        parse_layout("pp=1,tp=4,schedule=1f1b", SearchSpace(two_per_node, space.weights))


def test_interleaving_needs_equal_rounds():
    problem = Problem(MODEL, load_profile("ideal"), 4, 18, mix="balanced", num_samples=1)
    space = SearchSpace(problem, Evaluator(problem).reference_weights())
    with pytest.raises(MpipeError, match="M=9, but the microbatch count must divide the 18 sequences per replica and, "
                                         "interleaved over pp=4, run in equal rounds of M // pp; use one of 1, 2, 3, 6$"):
        parse_layout("pp=4,schedule=1f1b,1f1b,M=9", space)
    assert parse_layout("pp=4,schedule=1f1b,1f1b,M=6", space).num_microbatches == 6



def test_a_layout_in_the_candidates_text_form_is_checked_as_the_keys_are(space):
    from mpipe_tune.algebra import Candidate

    keys = parse_layout("pp=2,tp=1,dp=2,schedule=transpose,1f1b,cut=9,M=8,owners=greedy,recompute=selective", space)
    text = parse_layout(str(replace(keys, label="")), space)
    assert text == keys and keys.recompute == "selective"
    # What plan prints as its best plan reads back whole, settings the keys do not name included.
    best = replace(keys, zero_stage=0, slab_counts=((5, 11),), label="")
    assert parse_layout(str(best), space) == replace(best, label="current")
    assert parse_layout(str(Candidate("1f1b", (), pp=4, tp=1, dp=1, num_microbatches=8)), space) == replace(
        baseline("megatron", MODEL, 4, 1, 1, 8), label="current")
    with pytest.raises(MpipeError, match=r"pp\*tp\*dp = 2\*1\*1 = 2, but it must equal the 4 devices"):
        parse_layout("<1f1b> cut -  pp2 tp1 dp1  M=8", space)
    with pytest.raises(MpipeError, match="current layout '<1f1b> cut -  pp2 tq1  M=8': .*'tq1' is not a degree"):
        parse_layout("<1f1b> cut -  pp2 tq1  M=8", space)
