"""The owner policies (mpipe_tune.cost._owners): greedy, exact optimal, and the runtime's bounded optimal."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import round_robin
from mpipe_tune.errors import MpipeError
from mpipe_tune.cost._owners import (
    RUNTIME_OPTIMAL_MAX_NODES, choose_owners, greedy_owners, max_spill, optimal_owners, owners_for, rank_excess,
)

CONSTRUCTED = {
    # Pipeline-like slack (rank r idles ~r stage times before its first backbone forward).
    "uniform encodes, linear slack": ([1.0] * 8, [0.0, 1.0, 2.0, 3.0]),
    "one heavy encode": ([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 4.0]),
    "heavy encodes on early microbatches": ([4.0, 4.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5], [0.0, 1.5, 3.0, 4.5]),
    "heavy encodes on late microbatches": ([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 4.0, 4.0], [0.0, 1.5, 3.0, 4.5]),
    "text-only microbatches (no encode)": ([3.0, 0.0, 0.0, 2.0, 0.0, 0.0], [0.0, 1.0, 2.0]),
    "no slack at all": ([3.0, 1.0, 2.0, 2.0, 1.0, 3.0], [0.0, 0.0, 0.0]),
    "slack exceeds all work": ([1.0, 1.0, 1.0, 1.0], [10.0, 10.0]),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCTED))
def test_greedy_is_never_worse_than_round_robin_on_constructed_cases(case):
    encode, slack = CONSTRUCTED[case]
    rr = round_robin(len(encode), len(slack))
    greedy = greedy_owners(encode, slack)
    assert max_spill(greedy, encode, slack) <= max_spill(rr, encode, slack) + 1e-12


def test_greedy_moves_work_off_the_rank_without_slack():
    # Rank 0 has no warmup slack; round-robin still gives it every other encode.
    encode, slack = [1.0] * 4, [0.0, 4.0]
    assert max_spill(round_robin(4, 2), encode, slack) == 2.0
    assert greedy_owners(encode, slack) == (1, 1, 1, 1)
    assert max_spill(greedy_owners(encode, slack), encode, slack) == 0.0


def brute_force(encode, slack):
    return min(max(rank_excess(a, encode, slack)) for a in itertools.product(range(len(slack)), repeat=len(encode)))


instances = st.integers(2, 3).flatmap(lambda P: st.tuples(
    st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=7),
    st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=P, max_size=P),
))


@given(instances)
def test_optimal_is_exact_and_never_worse_than_greedy(instance):
    encode, slack = instance
    optimal = optimal_owners(encode, slack)
    assert len(optimal) == len(encode) and set(optimal) <= set(range(len(slack)))
    best = max(rank_excess(optimal, encode, slack))
    assert best == pytest.approx(brute_force(encode, slack), abs=1e-9)
    assert max_spill(optimal, encode, slack) <= max_spill(greedy_owners(encode, slack), encode, slack) + 1e-9


@given(st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=8, max_size=14),
       st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=4, max_size=8))
def test_optimal_never_worse_than_greedy_or_round_robin_on_larger_instances(encode, slack):
    optimal = optimal_owners(encode, slack)
    for other in (greedy_owners(encode, slack), round_robin(len(encode), len(slack))):
        assert max_spill(optimal, encode, slack) <= max_spill(other, encode, slack) + 1e-9


def test_optimal_gives_up_with_a_clear_message_when_the_instance_is_too_big():
    with pytest.raises(MpipeError, match="use the 'greedy' owner policy"):
        optimal_owners([1.0 + 1e-3 * i for i in range(12)], [0.0, 0.1, 0.2, 0.3], max_nodes=10)


def test_policies_by_name():
    encode, slack = [3.0, 1.0, 2.0], [0.0, 1.0]
    assert owners_for("round-robin", encode, slack) == (0, 1, 0)
    assert owners_for("greedy", encode, slack) == greedy_owners(encode, slack)
    assert owners_for("optimal", encode, slack) == optimal_owners(encode, slack)
    with pytest.raises(MpipeError, match="unknown"):
        owners_for("lottery", encode, slack)


def greedy_by_scan(encode, slack):
    """The greedy rule written out plainly (a scan of every rank per microbatch): the reference the
    heap implementation must equal, ties included."""
    remaining = [float(w) for w in slack]
    owners = [0] * len(encode)
    for m in sorted(range(len(encode)), key=lambda m: (-encode[m], m)):
        rank = max(range(len(remaining)), key=lambda r: (remaining[r], -r))
        owners[m] = rank
        remaining[rank] -= float(encode[m])
    return tuple(owners)


@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.25]), min_size=1, max_size=40),
       st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]), min_size=1, max_size=9))
def test_greedy_equals_the_plain_scan_ties_included(encode, slack):
    # Few distinct values: equal encodes and equal slack are common, so the tie rules are exercised.
    assert greedy_owners(encode, slack) == greedy_by_scan(encode, slack)


def test_greedy_equals_the_plain_scan_at_the_runtime_sizes():
    rng = np.random.default_rng(3)
    for P, M in ((8, 32), (64, 512)):
        encode = (rng.lognormal(0.0, 0.8, size=M) * (rng.random(M) > 0.2)).tolist()
        slack = (np.arange(P) * rng.uniform(0.1, 1.5)).tolist()
        assert greedy_owners(encode, slack) == greedy_by_scan(encode, slack)


def test_runtime_optimal_is_exact_within_its_budget_and_greedy_past_it():
    small = ([4.0, 4.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5], [0.0, 1.5, 3.0, 4.5])
    exact = choose_owners("optimal", *small, fallback=True)
    assert exact == choose_owners("optimal", *small) and exact.policy == "optimal"
    # An instance the exact search cannot finish within the runtime's budget (the search test's one).
    big = ([1.0 + 1e-3 * i for i in range(12)], [0.0, 0.1, 0.2, 0.3])
    with pytest.raises(MpipeError):
        optimal_owners(*big, max_nodes=RUNTIME_OPTIMAL_MAX_NODES)
    fallen = choose_owners("optimal", *big, fallback=True)
    assert fallen.owners == greedy_owners(*big) and fallen.policy == "greedy"


def test_round_robin_and_greedy_choices_name_their_policy():
    encode, slack = [3.0, 1.0, 2.0], [0.0, 1.0]
    assert choose_owners("round-robin", encode, slack, fallback=True).policy == "round-robin"
    assert choose_owners("greedy", encode, slack, fallback=True) == choose_owners("greedy", encode, slack)
    with pytest.raises(MpipeError, match="owner policy 'lottery' is unknown; use one of round-robin, greedy, optimal"):
        choose_owners("lottery", encode, slack, fallback=True)
