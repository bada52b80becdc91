"""Per-rank programs (algebra/_order.py): every (chunk, microbatch) runs once forward and once backward,
each forward before its backward, with the warmup depth of the schedule each program names."""

from __future__ import annotations

from itertools import product

from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra._derive import PROGRAMS, rank_program
from mpipe_tune.algebra._order import gpipe, interleaved_one_f_one_b, is_interleavable, num_rounds, one_f_one_b
from mpipe_tune.algebra import Layout, Skeleton


def assert_complete(program, num_chunks: int, num_microbatches: int) -> None:
    expected = sorted(product(range(num_chunks), range(num_microbatches)))
    assert sorted((c, m) for op, c, m in program if op == "F") == expected
    assert sorted((c, m) for op, c, m in program if op == "B") == expected
    position = {step: i for i, step in enumerate(program)}
    assert all(position[("F", c, m)] < position[("B", c, m)] for c, m in expected)


def first_backward(program) -> int:
    return next(i for i, (op, _, _) in enumerate(program) if op == "B")


def expected_first_backward(warmup: int, total: int) -> int:
    """After ``warmup`` forwards the steady state runs one more forward before its first backward,
    unless the warmup already ran every forward."""
    return warmup + 1 if warmup < total else total


@given(st.integers(1, 8), st.integers(1, 24))
def test_1f1b_runs_min_p_minus_r_minus_1_warmup_forwards_then_alternates(P, M):
    for rank in range(P):
        program = one_f_one_b(rank, P, M)
        assert_complete(program, 1, M)
        warmup = min(P - rank - 1, M)
        assert first_backward(program) == expected_first_backward(warmup, M)
        steady = program[warmup:len(program) - warmup]
        assert [op for op, _, _ in steady] == ["F", "B"] * (M - warmup)


@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 3))
def test_gpipe_runs_every_forward_before_any_backward(P, M, v):
    program = gpipe(M, v)
    assert_complete(program, v, M)
    assert first_backward(program) == M * v
    assert program == rank_program(Skeleton.GPIPE, P - 1, P, M, v)  # the same on every rank


@given(st.integers(1, 6), st.integers(1, 18), st.integers(2, 3))
def test_interleaved_1f1b_covers_every_chunk_in_equal_rounds(P, M, v):
    if not is_interleavable(P, M):
        assert M % num_rounds(P, M) != 0
        return
    g = M // num_rounds(P, M)
    for rank in range(P):
        program = interleaved_one_f_one_b(rank, P, M, v)
        assert_complete(program, v, M)
        assert first_backward(program) == expected_first_backward(min((v - 1) * g + 2 * (P - rank - 1), M * v), M * v)
        assert rank_program(Skeleton.ONE_F_ONE_B, rank, P, M, v) == program


def test_every_sharded_skeleton_has_one_program_function():
    sharded = {s for s in Skeleton if s.layout is Layout.SHARDED}
    assert set(PROGRAMS) == sharded
    assert rank_program(Skeleton.ONE_F_ONE_B, 0, 2, 3, 1) == one_f_one_b(0, 2, 3)
