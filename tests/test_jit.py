"""Kernels run as Python until compiling pays, then compiled; both tiers give the same results bit for bit."""

import numpy as np
import pytest

from mpipe_tune import jit
from mpipe_tune.algebra import Cut, parse_schedule
from mpipe_tune.cost import _owners as owners
from mpipe_tune.inputs import Microbatch, Workload

from conftest import make_model, predict_plan


def _predict(schedule, cut, P, owner_map, seed):
    rng = np.random.default_rng(seed)
    M = len(owner_map) if owner_map else 6
    workload = Workload(tuple(Microbatch(int(rng.integers(0, 40)), int(rng.integers(1, 40))) for _ in range(M)))
    model = make_model(["encoder"] * 3 + ["llm"] * 8, trainable=[False] + [True] * 10)
    return predict_plan(Cut(cut), parse_schedule(schedule), model, workload, _profile(), P,
                        microbatch_owners=owner_map)


def _profile():
    from mpipe_tune.cost import load_profile

    return load_profile("h100-sxm")


@pytest.mark.parametrize("schedule, cut, P, owner_map", [
    ("transpose,1f1b", (3,), 4, (0, 1, 2, 3, 3, 0, 1, 2)),
    ("transpose,gpipe", (3,), 2, (1, 1, 0, 0, 1)),
    ("1f1b,1f1b", (3,), 2, None),
    ("transpose,zb1p", (3,), 4, (3, 2, 1, 0, 0, 1)),
])
def test_a_prediction_is_the_same_from_python_and_compiled_kernels(schedule, cut, P, owner_map):
    with jit.tier("python"):
        slow = _predict(schedule, cut, P, owner_map, seed=P)
    with jit.tier("compiled"):
        fast = _predict(schedule, cut, P, owner_map, seed=P)
    assert slow.plan == fast.plan  # the topological sort
    assert np.array_equal(slow.timeline.durations_s, fast.timeline.durations_s)
    assert np.array_equal(slow.timeline.finish_s, fast.timeline.finish_s)
    assert slow.timeline.makespan_s == fast.timeline.makespan_s
    assert slow.memory.peak_bytes == fast.memory.peak_bytes


@pytest.mark.parametrize("seed", range(6))
def test_owner_policies_are_the_same_from_python_and_compiled_kernels(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    P, M = int(rng.integers(2, 6)), int(rng.integers(4, 12))
    encode = rng.integers(1, 9, size=M).astype(float).tolist()  # integers: many ties, a longer walk
    slack = rng.integers(0, 12, size=P).astype(float).tolist()
    with jit.tier("compiled"):
        expected = owners.greedy_owners(encode, slack), owners.optimal_owners(encode, slack)
    with jit.tier("python"):
        assert (owners.greedy_owners(encode, slack), owners.optimal_owners(encode, slack)) == expected
        monkeypatch.setattr(owners, "PYTHON_MAX_NODES", 1)  # the Python walk gives up: compiled, full budget
        assert owners.optimal_owners(encode, slack) == expected[1]


def total(values):
    """A kernel's loop: the sum of an array."""
    s = 0.0
    for k in range(values.shape[0]):
        s += values[k]
    return s


def test_a_kernel_is_python_until_its_python_time_or_a_large_input_pays_for_compiling(monkeypatch):
    monkeypatch.setattr(jit, "numba_cache_holds", lambda fn: False)  # an earlier run may have cached `total`
    k = jit.Kernel(total)
    assert k(np.ones(10)) == 10.0 and k._compiled is None and k.python_s > 0
    monkeypatch.setattr(jit, "COMPILE_FROM_SIZE", 50)
    assert k(np.ones(50)) == 50.0 and k._compiled is not None  # large: compiled, and from then on always
    assert k(np.ones(3)) == 3.0 and k.compiled.signatures
    cheap = jit.Kernel(total)
    monkeypatch.setattr(jit, "COMPILE_AFTER_S", 1e-12)
    cheap(np.ones(2))  # its first call had no Python time before it: Python
    assert cheap._compiled is None
    cheap(np.ones(2))
    assert cheap._compiled is not None


def test_a_kernel_numbas_cache_holds_is_compiled_after_the_shorter_wait(tmp_path, monkeypatch):
    """A kernel compiled by an earlier run (numba's index beside its source, newer than it) waits
    COMPILE_CACHED_AFTER_S as Python, not COMPILE_AFTER_S; an edited source is not held."""
    import importlib.util
    import os

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    source = tmp_path / "loops.py"
    source.write_text("def total(values):\n    s = 0.0\n    for k in range(values.shape[0]):\n"
                      "        s += values[k]\n    return s\n")
    spec = importlib.util.spec_from_file_location("loops", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not jit.numba_cache_holds(module.total)
    assert jit.Kernel(module.total).compile_after_s() == jit.COMPILE_AFTER_S
    jit.Kernel(module.total).compiled(np.ones(3))  # an earlier run: compiled, written to numba's cache
    assert jit.numba_cache_holds(module.total)
    k = jit.Kernel(module.total)
    assert k.compile_after_s() == jit.COMPILE_CACHED_AFTER_S < jit.COMPILE_AFTER_S
    monkeypatch.setattr(jit, "COMPILE_CACHED_AFTER_S", 1e-12)
    k(np.ones(2))
    assert k._compiled is None  # no Python time before its first call
    assert k(np.ones(2)) == 2.0 and k._compiled is not None
    later = os.stat(source).st_mtime + 10
    os.utime(source, (later, later))  # the source edited since
    assert not jit.numba_cache_holds(module.total)


def test_a_ctrl_c_during_a_compile_keeps_every_kernel_python_from_then_on(monkeypatch):
    def interrupted_compile(*args):  # what numba's import or first compile does when Ctrl-C lands in it
        raise KeyboardInterrupt

    monkeypatch.setattr(jit, "_compiling_stopped", False)
    monkeypatch.setattr(jit, "COMPILE_FROM_SIZE", 5)
    k, other = jit.Kernel(total), jit.Kernel(total)
    k._compiled = interrupted_compile
    with pytest.raises(KeyboardInterrupt):
        k(np.ones(8))
    assert jit.compiling_stopped()
    assert k(np.ones(8)) == 8.0 and other(np.ones(8)) == 8.0  # Python now, even for inputs large enough to compile
    assert other._compiled is None
    with jit.tier("compiled"):  # a pinned tier is the caller's choice, and is kept
        assert other.uses_compiled((np.ones(1),))


def test_an_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="tier 'fast' is unknown"):
        with jit.tier("fast"):
            pass
