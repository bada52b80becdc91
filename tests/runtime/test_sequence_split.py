"""The load-balanced context-parallel split: every token on exactly one rank, shares within a token of
each other, and each rank's causal attention work close to 1/cp of the whole (what the cost model charges)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.runtime._sequence_split import ContextSplit


@given(st.integers(1, 8), st.integers(0, 300))
def test_the_ranks_hold_every_position_once_in_two_chunks_each(degree, tokens):
    splits = [ContextSplit(degree, r) for r in range(degree)]
    held = [p for s in splits for p in s.positions(tokens)]
    assert sorted(held) == list(range(tokens))
    rows = [s.rows(tokens) for s in splits]
    assert max(rows) - min(rows) <= 2 and sum(rows) == tokens
    for s in splits:
        assert list(s.positions(tokens)) == sorted(s.positions(tokens))  # early chunk first, each ascending


@given(st.integers(2, 8), st.integers(64, 4096))
def test_causal_work_is_balanced_unlike_a_contiguous_split(degree, tokens):
    work = [sum(p + 1 for p in ContextSplit(degree, r).positions(tokens)) for r in range(degree)]
    total = tokens * (tokens + 1) / 2
    assert max(work) <= total / degree * 1.05 + tokens  # a contiguous split's last rank does ~(2 - 1/cp)/cp
