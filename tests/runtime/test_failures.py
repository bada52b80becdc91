"""A failing rank ends the whole run quickly, naming the rank; bad inputs fail before any process starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, make_plan  # noqa: E402

from mpipe_tune.runtime.compute import RealCompute  # noqa: E402
from mpipe_tune.runtime.job import RunJob  # noqa: E402
from mpipe_tune.runtime.launch import RankFailed, launch_local  # noqa: E402
from mpipe_tune.runtime.worker import run_job  # noqa: E402


def raise_on_rank_1(ctx, plan_path):
    """Rank 1 fails in its first backward, while the others are inside the step waiting on it."""
    if ctx.rank == 1:
        def backward(self, index, event, grad):
            raise RuntimeError("injected failure")

        RealCompute.backward = backward  # this rank's process only
    run_job(ctx, RunJob(plan_path, steps=1, dtype="fp64"))


def die_on_rank_2(ctx, plan_path):
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    run_job(ctx, RunJob(plan_path, steps=1, dtype="fp64"))


def hang_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(3600)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return str(make_plan(tmp_path_factory.mktemp("failures"), "transpose,1f1b", (FIRST_LLM,), 4))


def test_a_rank_that_raises_ends_every_rank_quickly_and_is_named(plan):
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 1 failed: RuntimeError: injected failure") as info:
        launch_local(raise_on_rank_1, (plan,), 4, timeout_s=60, deadline_s=60)
    assert time.monotonic() - started < 20
    assert "raise_on_rank_1" in info.value.details  # the failing rank's traceback


def test_a_rank_that_dies_ends_every_rank_quickly_and_is_named(plan):
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 2 died: its process was killed by signal 9"):
        launch_local(die_on_rank_2, (plan,), 4, timeout_s=60, deadline_s=60)
    assert time.monotonic() - started < 20


def test_a_hung_rank_is_killed_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"deadline of 3 s; rank\(s\) \[0\]"):
        launch_local(hang_on_rank_0, (), 2, timeout_s=60, deadline_s=3)
    assert time.monotonic() - started < 15


# ----------------------------------------------------------------- pre-flight errors: exit 2, one line


def run_cli(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "run", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_exit_2(result, *words):
    code, stdout, stderr = result
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_a_plan_for_another_model_is_refused(plan):
    assert_one_line_exit_2(run_cli(plan, "--model", "tiny-vit-llm"), "was made for model 'tiny-mllm'", "hash mismatch")


def test_a_plan_for_the_same_model_frozen_differently_is_refused(tmp_path):
    path = make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 2, frozen=("encoder",))
    record = json.loads(path.read_text())
    record["inputs"]["model"]["frozen"] = []
    path.write_text(json.dumps(record))
    assert_one_line_exit_2(run_cli(str(path)), "hash mismatch")


def test_a_world_size_other_than_the_layout_is_refused_before_any_process_group(plan):
    # Nothing listens on this port: creating a process group would hang, not fail in one line.
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    started = time.monotonic()
    assert_one_line_exit_2(run_cli(plan, env=env), "laid out pp4 x dp1 x tp1 = 4 ranks but the world size is 3")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("damage,words", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: text.replace('"F2.', '"X2.', 1), "not an event"),
    (lambda text: json.dumps({**json.loads(text), "placement": [{"region": 1}]}), "corrupt"),
    (lambda text: json.dumps({**json.loads(text), "schema": "other"}), "not an mpipe-tune plan"),
    (lambda text: text.replace('"tp": 1', '"tp": 3'), "tp 3"),
])
def test_a_corrupt_or_unrunnable_plan_file_is_refused(plan, tmp_path, damage, words):
    bad = tmp_path / "bad.json"
    bad.write_text(damage(open(plan).read()))
    assert_one_line_exit_2(run_cli(str(bad)), words)


def test_missing_devices_are_one_line(plan):
    if not torch.cuda.is_available():
        assert_one_line_exit_2(run_cli(plan, "--device", "cuda"), "--device cuda: no CUDA GPU")
    try:
        import torch_npu  # noqa: F401
    except Exception:
        assert_one_line_exit_2(run_cli(plan, "--device", "npu"), "--device npu: torch_npu is not usable")


def test_a_model_the_runtime_cannot_build_is_refused(tmp_path):
    path = make_plan(tmp_path, "1f1b", (), 2, model_spec="example-mllm")
    assert_one_line_exit_2(run_cli(str(path)), "explicit per-token costs", "--compute emulated")
