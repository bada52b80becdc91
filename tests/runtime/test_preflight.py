"""Checks a run makes on this host before any rank starts: memory and dtype."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime_plans import FIRST_LLM, make_plan

from mpipe_tune.errors import MpipeError
from mpipe_tune.runtime._job import RunJob, validate_memory
from mpipe_tune.runtime._launch import available_memory, dtype_note
from mpipe_tune.runtime import read_plan_file


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return make_plan(tmp_path_factory.mktemp("preflight"), "transpose,1f1b", (FIRST_LLM,), 2, dp=2)


def _peaks(view):
    return list(view.section.peak_bytes)


def test_host_memory_is_shared_by_every_local_rank(plan):
    view = read_plan_file(str(plan))
    need = 2 * sum(_peaks(view))  # pp 2 x dp 2 ranks, each replica of a pipeline rank needs the same
    job = RunJob(str(plan))
    validate_memory(view, job, range(4), need, shared=True, where="this host")
    with pytest.raises(MpipeError, match=r"needs .* GiB of predicted memory \(4 local ranks together, fp32\) but this host has"):
        validate_memory(view, job, range(4), need * 0.99, shared=True, where="this host")
    # One device per rank: only the busiest rank counts.
    validate_memory(view, job, range(4), max(_peaks(view)), shared=False, where="cuda device 0")
    # In fp64 the same plan needs twice its fp32 prediction.
    with pytest.raises(MpipeError, match="fp64"):
        validate_memory(view, RunJob(str(plan), dtype="fp64"), range(4), need * 1.5, shared=True, where="this host")
    # Emulated compute builds no model.
    validate_memory(view, RunJob(str(plan), compute="emulated"), range(4), 0.0, shared=True, where="this host")


def test_a_plan_larger_than_the_host_is_refused_in_one_line_before_any_rank(plan, tmp_path):
    record = json.loads(plan.read_text())
    for r in record["predicted"]["ranks"]:
        r["memory"]["peak_bytes"] = 2.0**50
    big = tmp_path / "big.json"
    big.write_text(json.dumps(record))
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "run", str(big)], capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "GiB of predicted memory" in lines[0] and "this host has" in lines[0] and "compute mode (--compute) emulated" in lines[0]
    host_bytes, shared, _ = available_memory("cpu")
    assert shared and host_bytes > 0


def test_dtype_notes_follow_the_cpu_flags():
    assert dtype_note("cpu", "fp32") is None and dtype_note("cpu", "fp64") is None
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    note = dtype_note("cpu", "bf16")
    assert (note is None) == native
    if note:
        assert note.startswith("bf16 on this CPU") and "dtype fp32" in note  # the domain names the quantity; the CLI adds its flag


def test_run_takes_the_plan_dtype_by_default(plan):
    view = read_plan_file(str(plan))
    assert RunJob(str(plan)).dtype_for(view) == "fp32" == view.dtype
    assert RunJob(str(plan), dtype="fp64").dtype_for(view) == "fp64"


def test_running_without_torch_is_one_line(plan):
    code = ("import sys; sys.modules['torch'] = None; import importlib.util; importlib.util.find_spec = lambda name, *a: None; "
            f"from mpipe_tune.cli import main; sys.exit(main(['run', {str(plan)!r}, '--compute', 'emulated']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs torch, which is not installed" in proc.stderr and "Traceback" not in proc.stderr


def test_a_plan_predicted_on_a_built_in_profile_gets_a_note_that_names_it(plan, tmp_path):
    from mpipe_tune.cost import dump_profile, load_profile
    from mpipe_tune.runtime._job import builtin_profile_note

    note = builtin_profile_note(read_plan_file(str(plan)), RunJob(str(plan)), "cpu")
    assert "built-in profile 'ideal'" in note and "mpipe-tune profile --device cpu" in note
    measured = tmp_path / "host.json"
    dump_profile(load_profile("ideal"), measured)  # a profile file, as `mpipe-tune profile` writes one
    own = make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 2, profile=str(measured))
    assert builtin_profile_note(read_plan_file(str(own)), RunJob(str(own)), "cpu") is None
    assert builtin_profile_note(read_plan_file(str(plan)), RunJob(str(plan), profile_spec=str(measured)), "cpu") is None


def test_more_cpu_ranks_than_cores_get_a_note_that_says_the_timings_carry_their_turns(plan, monkeypatch):
    from mpipe_tune.runtime import _launch
    from mpipe_tune.runtime._job import check_host

    view, job = read_plan_file(str(plan)), RunJob(str(plan))  # pp 2 x dp 2: four local ranks
    monkeypatch.setattr(_launch, "usable_cores", lambda: 2)
    [note] = [n for n in check_host(view, job, "cpu") if "cores" in n]
    assert note.startswith("4 CPU ranks on 2 cores") and "time-slicing" in note and "at most 2 ranks" in note
    assert _launch.shared_cores_note("cuda", 4, "fix") is None  # a device per rank: nothing shared
    assert check_host(view, RunJob(str(plan), compute="emulated"), "cpu") == []  # emulated: nothing timed by compute
    monkeypatch.setattr(_launch, "usable_cores", lambda: 4)
    assert not [n for n in check_host(view, job, "cpu") if "cores" in n]
