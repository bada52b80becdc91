"""What a run does around its timed steps: the collector kept off what was built before them, and the
fidelity benchmark's speed probe before a run and after each of its steps."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, TEST_MODEL, make_plan  # noqa: E402

from mpipe_tune.profiler import probed_run_jobs  # noqa: E402
from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime import launch_local  # noqa: E402
from mpipe_tune.runtime._worker import frozen_heap  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402


def test_the_probe_runs_before_the_run_and_after_every_step(tmp_path):
    plan = make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 2)
    job = RunJob(str(plan), steps=3, compute="real", dtype="fp32")
    [result] = launch_local(probed_run_jobs, ([job], load_model(TEST_MODEL), "fp32", 16), 2,
                            timeout_s=300, deadline_s=150)
    probes = result["probe_steps_s"]
    assert len(probes) == 3 and all(p > 0 for p in probes) and result["probe_before_s"] > 0
    assert result["probe_after_s"] == probes[-1]
    assert result["summary"]["steps"] == 3 and len(result["summary"]["step_times_s"]) == 3


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_steps_run_with_what_was_built_before_them_out_of_the_collectors_passes():
    import weakref

    assert gc.get_freeze_count() == 0
    built = _Cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0  # ``built`` and everything else alive on entry
        made = weakref.ref(_Cycle())  # garbage made during the steps is still collected
        gc.collect()
        assert made() is None
    assert gc.get_freeze_count() == 0 and built.me is built
