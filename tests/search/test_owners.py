import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra import round_robin
from mpipe_tune.errors import MpipeError
from mpipe_tune.search.owners import greedy_owners, max_spill, optimal_owners, owners_for, rank_excess

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
