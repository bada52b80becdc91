"""FSDP2's host cost per sharded layer per call, per byte per collective, per collective and per tensor per
collective: the fit recovers planted figures from synthetic timings, and the measurement's entries are profile
figures the cost model reads."""

import doctest
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.cost import parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler import assemble_profile
from mpipe_tune.profiler import _fsdp_host
from mpipe_tune.profiler._fsdp_host import (
    LINEARS, UNITS, WIDTHS, FsdpHostPoint, fit_host_s, layer_bytes, priced_layer_comm_s, split_per_layer)
from mpipe_tune.profiler._fit import fit_nonnegative_line, nonnegative_fit

from test_profile_command import _measurements


def _synthetic(per_call_s: float, per_byte_s: float, fixed_s: float,
               noise: tuple[float, ...] = (0.0,) * len(UNITS), excess: tuple[float, float] | None = None,
               per_tensor_s: float = 0.0) -> FsdpHostPoint:
    """Timings of the stacks as FSDP2 would give them with ``per_call_s`` of hooks per layer call,
    ``per_byte_s`` per byte and ``per_tensor_s`` per tensor of each of a layer's three collectives and ``fixed_s``
    per step for the stack: a plain step and the collectives growing with the layers and their size too; with
    ``excess`` (seconds per collective, per byte per collective), the links priced the collectives that much below
    what they took back to back."""
    plain, comm, fsdp, priced = [], [], [], []
    for width, linears in zip(WIDTHS, LINEARS):
        size, tensors = layer_bytes(width, 2, linears), 2 * linears
        p = tuple(1e-4 * k * linears * width / 64 + 2e-4 for k in UNITS)
        c = tuple(3e-4 * k + 1e-9 * size * k for k in UNITS)
        plain.append(p)
        comm.append(c)
        fsdp.append(tuple(a + b + (2 * per_call_s + 3 * size * per_byte_s + 3 * tensors * per_tensor_s) * k
                          + fixed_s + e for a, b, k, e in zip(p, c, UNITS, noise)))
        if excess is not None:
            priced.append(3e-4 + 1e-9 * size - 3 * (excess[0] + excess[1] * size))
    return FsdpHostPoint(UNITS, tuple(plain), tuple(comm), tuple(fsdp), repeats=5, group_size=2,
                         priced_s=tuple(priced) if excess is not None else None)


@given(per_call=st.floats(1e-6, 1e-2), per_byte=st.floats(1e-12, 1e-8), fixed=st.floats(0.0, 1e-2),
       per_collective=st.floats(1e-6, 1e-3), excess_per_byte=st.floats(0.0, 1e-9), per_tensor=st.floats(0.0, 1e-3))
def test_the_fit_recovers_planted_per_call_per_byte_per_collective_and_per_tensor_figures(
        per_call, per_byte, fixed, per_collective, excess_per_byte, per_tensor):
    point = _synthetic(per_call, per_byte, fixed, per_tensor_s=per_tensor)
    assert point.figures == pytest.approx((per_call, per_byte, 0.0, per_tensor), rel=1e-5, abs=1e-15)
    assert fit_host_s(UNITS, point.extra_s(0))[1] == pytest.approx(fixed, rel=1e-6, abs=1e-12)
    # collectives back to back slower than the links price them: a fixed share and one per byte
    slower = _synthetic(per_call, per_byte, fixed, excess=(per_collective, excess_per_byte), per_tensor_s=per_tensor)
    assert slower.excess_s == pytest.approx([per_collective + excess_per_byte * b for b in slower.sizes])
    assert slower.figures == pytest.approx((per_call, per_byte + excess_per_byte, per_collective, per_tensor),
                                           rel=1e-4, abs=1e-15)


def test_layers_of_one_tensor_count_give_no_per_tensor_figure_and_the_fit_is_nonnegative_least_squares():
    # the two single-linear shapes alone: the per-call and per-byte split, nothing per tensor
    assert split_per_layer([100, 1100], [2, 2], [0.2 + 3e-4, 0.2 + 3.3e-3]) == pytest.approx((0.1, 1e-6, 0.0))
    # a per-tensor trend that would need a negative per-byte figure: that one held at 0, the others refitted
    per_call, per_byte, per_tensor = split_per_layer([100, 1100, 800], [2, 2, 16], [0.2, 0.2, 0.2 + 0.042])
    assert per_byte == 0.0 and per_call > 0 and per_tensor == pytest.approx(1e-3, rel=1e-6)
    # the constrained optimum: no feasible subset fits better than the one chosen
    columns, y = [[1.0, 1.0, 1.0], [1.0, 2.0, 3.0], [3.0, 1.0, 0.0]], [2.0, 1.0, 3.0]
    coef = nonnegative_fit(columns, y)
    assert min(coef) >= 0.0
    best = sum((sum(c * col[i] for c, col in zip(coef, columns)) - y[i]) ** 2 for i in range(3))
    grid = [(a / 10, b / 10, c / 10) for a in range(31) for b in range(31) for c in range(31)]
    assert best <= min(sum((sum(c * col[i] for c, col in zip(g, columns)) - y[i]) ** 2 for i in range(3))
                       for g in grid) + 1e-12


def test_noise_without_a_trend_leaves_the_figures_and_a_negative_part_reads_as_zero():
    noise = (1e-4, -1e-4, -1e-4, 1e-4)  # symmetric about the middle: no slope of its own
    assert _synthetic(5e-4, 1e-9, 0.0, noise).figures == pytest.approx((5e-4, 1e-9, 0.0, 0.0), rel=0.05, abs=1e-9)
    # wide layers adding less than narrow ones: no per-byte cost, the hooks the mean
    assert split_per_layer([100, 1000], [2, 2], [0.4, 0.2]) == (pytest.approx(0.15), 0.0, 0.0)
    # a line through below the origin: no per-call cost, the bytes alone through the origin
    per_call, per_byte, _ = split_per_layer([100, 1000], [2, 2], [0.0, 0.3])
    assert per_call == 0.0 and per_byte == pytest.approx(0.3 * 3000 / (300**2 + 3000**2))
    shrinking = _synthetic(0.0, 0.0, 0.0, tuple(-1e-3 * k for k in UNITS))
    assert shrinking.figures == (0.0, 0.0, 0.0, 0.0)


def test_one_stack_size_or_one_width_cannot_be_fitted():
    with pytest.raises(MpipeError, match="two or more stack sizes"):
        fit_host_s([4, 4], [0.1, 0.2])
    with pytest.raises(MpipeError, match="two or more widths"):
        split_per_layer([100, 100], [2, 16], [0.1, 0.2])


def test_the_measurement_is_profile_figures_with_their_provenance():
    m = _measurements()
    data = assemble_profile(type(m)(**{**m.__dict__, "fsdp_host": _synthetic(2e-4, 3e-10, 1e-3, per_tensor_s=4e-5)}),
                            name="t", date="2026-01-01")
    entry = data["fsdp_host_s"]
    assert entry["source"] == "measured" and "fully_shard" in entry["ref"] and entry["units"] == list(UNITS)
    assert entry["widths"] == list(WIDTHS) and entry["linears"] == list(LINEARS) and len(entry["fsdp_s"]) == len(WIDTHS)
    assert data["fsdp_bytes_s"]["source"] == "measured" and "fsdp_host_s" in data["fsdp_bytes_s"]["ref"]
    # the collectives' excess is read against the profile's own links, as the cost model prices them
    sizes = [layer_bytes(w, 2, n) for w, n in zip(WIDTHS, LINEARS)]
    priced = priced_layer_comm_s(parse_profile(data, where="test"), sizes, 2)
    assert entry["priced_comm_s"] == pytest.approx(list(priced))
    excess = _synthetic(2e-4, 3e-10, 1e-3, excess=(0.0, 0.0)).comm_s
    expected = fit_nonnegative_line(np.array(sizes, dtype=float),
                                    np.array([(fit_host_s(UNITS, c)[0] - p) / 3 for c, p in zip(excess, priced)]),
                                    np.ones(len(sizes)))
    assert data["fsdp_collective_s"]["value"] == pytest.approx(expected[0])
    profile = parse_profile(json.loads(json.dumps(data)), where="test")
    assert (profile.fsdp_host_s, profile.fsdp_bytes_s, profile.fsdp_tensor_s) == pytest.approx(
        (2e-4, 3e-10 + expected[1], 4e-5), rel=1e-6)
    assert parse_profile(profile.to_dict(), where="again") == profile


def test_the_closed_forms_in_the_docstrings():
    assert doctest.testmod(_fsdp_host).failed == 0
