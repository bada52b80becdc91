"""FSDP2's host cost per sharded layer per call: the fit recovers a planted figure from synthetic timings, and
the measurement's entry is a profile figure the cost model reads."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.cost import parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler import assemble_profile
from mpipe_tune.profiler._fsdp_host import UNITS, FsdpHostPoint, fit_host_s

from test_profile_command import _measurements


def _synthetic(per_call_s: float, fixed_s: float, noise: tuple[float, ...] = (0.0,) * len(UNITS)) -> FsdpHostPoint:
    """Timings of the stacks as FSDP2 would give them with ``per_call_s`` of host work per layer call and
    ``fixed_s`` per step for the stack: a plain step and the collectives growing with the layers too."""
    plain = tuple(1e-4 * k + 2e-4 for k in UNITS)
    comm = tuple(3e-4 * k for k in UNITS)
    fsdp = tuple(p + c + per_call_s * 2 * k + fixed_s + e for p, c, k, e in zip(plain, comm, UNITS, noise))
    return FsdpHostPoint(UNITS, plain, comm, fsdp, repeats=5, group_size=2)


@given(per_call=st.floats(1e-6, 1e-2), fixed=st.floats(0.0, 1e-2))
def test_the_fit_recovers_a_planted_per_call_figure(per_call, fixed):
    point = _synthetic(per_call, fixed)
    assert point.value == pytest.approx(per_call, rel=1e-6, abs=1e-12)
    assert fit_host_s([2 * k for k in UNITS], point.extra_s)[1] == pytest.approx(fixed, rel=1e-6, abs=1e-12)


def test_noise_that_sums_to_no_trend_leaves_the_figure_and_a_negative_trend_reads_as_zero():
    noise = (1e-4, -1e-4, -1e-4, 1e-4)  # symmetric about the middle: no slope of its own
    assert _synthetic(5e-4, 0.0, noise).value == pytest.approx(5e-4, rel=0.05)
    shrinking = FsdpHostPoint(UNITS, (0.0,) * 4, (0.0,) * 4, tuple(1.0 / k for k in UNITS), 5, 2)
    assert shrinking.value == 0.0


def test_one_stack_size_cannot_be_fitted():
    with pytest.raises(MpipeError, match="two or more stack sizes"):
        fit_host_s([4, 4], [0.1, 0.2])


def test_the_measurement_is_a_profile_figure_with_its_provenance():
    m = _measurements()
    data = assemble_profile(type(m)(**{**m.__dict__, "fsdp_host": _synthetic(2e-4, 1e-3)}), name="t", date="2026-01-01")
    entry = data["fsdp_host_s"]
    assert entry["source"] == "measured" and "fully_shard" in entry["ref"] and entry["units"] == list(UNITS)
    profile = parse_profile(json.loads(json.dumps(data)), where="test")
    assert profile.fsdp_host_s == pytest.approx(2e-4)
    assert parse_profile(profile.to_dict(), where="again") == profile
