"""Placement (algebra/_placement.py): balanced slabs are the best contiguous split, owners are checked
with messages that name the quantity."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra._placement import (
    ByMicrobatch, balanced_counts, round_robin, slabs_from_counts, validate_counts, validate_owners,
)
from mpipe_tune.errors import MpipeError


def brute_force_largest(weights, parts: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@given(st.lists(st.integers(1, 9), min_size=1, max_size=9), st.data())
def test_balanced_counts_minimise_the_largest_slab_exactly(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    counts = balanced_counts(weights, parts)
    assert len(counts) == parts and min(counts) >= 1 and sum(counts) == len(weights)
    slabs = slabs_from_counts(0, counts)
    assert max(sum(weights[a:b]) for a, b in slabs) == brute_force_largest(weights, parts)


def test_slabs_are_contiguous_from_the_region_start():
    assert slabs_from_counts(5, (2, 3, 1)) == ((5, 7), (7, 10), (10, 11))


def test_round_robin_owners_and_the_microbatches_of_a_rank():
    owners = round_robin(7, 3)
    assert owners == (0, 1, 2, 0, 1, 2, 0)
    assert ByMicrobatch(owners).microbatches_of(0) == (0, 3, 6)


@pytest.mark.parametrize("owners,words", [
    ((0, 1), "the owner map lists 2 rank(s) but there are 3 microbatches"),
    ((0, 1, 5), "microbatch 2 is owned by rank 5, but ranks are 0..1 for P=2"),
])
def test_a_bad_owner_map_names_the_quantity_not_a_flag(owners, words):
    with pytest.raises(MpipeError) as info:
        validate_owners(owners, 2, 3)
    assert words in str(info.value) and "--" not in str(info.value)


def test_bad_slab_counts_name_the_region_and_what_must_hold():
    with pytest.raises(MpipeError, match=r"slab counts for region 2: got \[3, 0\], but need 2 counts >= 1"):
        validate_counts((3, 0), 2, 3, 2)
