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

from conftest import process_stats  # noqa: E402
from runtime_plans import FIRST_LLM, make_plan  # noqa: E402

from mpipe_tune.runtime._compute import RealCompute  # noqa: E402
from mpipe_tune.runtime import RunJob  # noqa: E402
from mpipe_tune.runtime._launch import RankFailed, launch_local  # noqa: E402
from mpipe_tune.runtime import run_job  # noqa: E402


def _ended(ctx, folder, work) -> None:
    """``work()`` on this rank, leaving in ``folder`` how it ended when it raised (a rank the launcher kills
    leaves nothing): the tests read them to tell an end by the failure from an end by a collective timeout."""
    try:
        work()
    except BaseException as exc:
        with open(os.path.join(folder, f"rank{ctx.rank}.ended"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise


def raise_on_rank_1(ctx, plan_path, folder):
    """Rank 1 fails in its first backward, while the others are inside the step waiting on it."""
    if ctx.rank == 1:
        def backward(self, index, event, grad):
            raise RuntimeError("injected failure")

        RealCompute.backward = backward  # this rank's process only
    _ended(ctx, folder, lambda: run_job(ctx, RunJob(plan_path, steps=1, dtype="fp64")))


def die_on_rank_2(ctx, plan_path, folder):
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    _ended(ctx, folder, lambda: run_job(ctx, RunJob(plan_path, steps=1, dtype="fp64")))


def hang_on_rank_0(ctx, folder):
    """Rank 0 hangs in its work; rank 1 returns at once. Each leaves its process id in ``folder``."""
    with open(os.path.join(folder, f"rank{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if ctx.rank == 0:
        time.sleep(3600)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return str(make_plan(tmp_path_factory.mktemp("failures"), "transpose,1f1b", (FIRST_LLM,), 4))


# "Quickly": ended by the failure, not by the collective timeout the others would otherwise wait out. A
# rank that ended by the timeout says so in its error (left in the test's folder); one the launcher killed
# left none. The timeout itself is far from any load (starting 4 ranks took up to 25 s on the loaded
# 2-core machine): it is what the test tells apart, not a timing goal.
COLLECTIVE_TIMEOUT_S = 300


def not_by_a_timeout(folder) -> None:
    ended = {f.name: f.read_text() for f in folder.glob("rank*.ended")}
    assert not [e for e in ended.values() if "timed out" in e.lower() or "timeout" in e.lower()], ended


def test_a_rank_that_raises_ends_every_rank_quickly_and_is_named(plan, tmp_path):
    with pytest.raises(RankFailed, match=r"^rank 1 failed: RuntimeError: injected failure") as info:
        launch_local(raise_on_rank_1, (plan, str(tmp_path)), 4, timeout_s=COLLECTIVE_TIMEOUT_S)
    assert "raise_on_rank_1" in info.value.details  # the failing rank's traceback
    assert (tmp_path / "rank1.ended").read_text() == "RuntimeError: injected failure"
    not_by_a_timeout(tmp_path)


def test_a_rank_that_dies_ends_every_rank_quickly_and_is_named(plan, tmp_path):
    with pytest.raises(RankFailed, match=r"^rank 2 died: its process was killed by signal 9"):
        launch_local(die_on_rank_2, (plan, str(tmp_path)), 4, timeout_s=COLLECTIVE_TIMEOUT_S)
    assert not (tmp_path / "rank2.ended").exists()
    not_by_a_timeout(tmp_path)


def test_a_hung_rank_is_killed_at_the_deadline(tmp_path):
    # The deadline counts from the moment both ranks joined (a slow start on a loaded host is not the
    # hang), so rank 1, which returns at once, is never named, and rank 0's hour-long sleep is cut.
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"deadline of 3 s; rank\(s\) \[0\] were still running and were killed"):
        launch_local(hang_on_rank_0, (str(tmp_path),), 2, timeout_s=300, deadline_s=3)
    assert time.monotonic() - started >= 3  # not before the deadline (a lower bound: a loaded machine only adds)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in (0, 1)]
    assert not [pid for pid in pids if _state(pid) not in ("gone", "Z")], "a rank is still running"


# ----------------------------------------------------------------- pre-flight errors: exit 2, one line


def run_cli(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "run", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})
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
    # Nothing listens on this port: creating a process group would hang (past run_cli's guard), not
    # fail in one line.
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    assert_one_line_exit_2(run_cli(plan, env=env), "laid out pp4 tp1 dp1 = 4 ranks but the world size is 3")


@pytest.mark.parametrize("damage,words", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: text.replace('"F2.', '"X2.', 1), "not an event"),
    (lambda text: json.dumps({**json.loads(text), "placement": [{"region": 1}]}), "corrupt"),
    (lambda text: json.dumps({**json.loads(text), "schema": "other"}), "not an mpipe-tune plan"),
    (lambda text: text.replace('"tp": 1', '"tp": 3'), "tp 3"),
    (lambda text: text.replace('"tp": 1', '"tp": 0'), "candidate field 'tp' = 0 must be an integer from 1"),
    (lambda text: _edit(text, lambda r: r["candidate"].pop("cut")), "candidate field 'cut' = None"),
    (lambda text: _edit(text, lambda r: r["predicted"].update(makespan_s="slow")), "'makespan_s' must be a number"),
    (lambda text: _edit(text, _swap_two_events_of_rank_1), "rank 1's stored order differs from derive's"),
])
def test_a_corrupt_or_unrunnable_plan_file_is_refused(plan, tmp_path, damage, words):
    bad = tmp_path / "bad.json"
    bad.write_text(damage(open(plan).read()))
    assert_one_line_exit_2(run_cli(str(bad)), words)


def _edit(text, change):
    record = json.loads(text)
    change(record)
    return json.dumps(record)


def _swap_two_events_of_rank_1(record):
    nodes = record["order"]["nodes"][1]
    nodes[0], nodes[1] = nodes[1], nodes[0]


@pytest.mark.parametrize("trace,words", [
    ("/proc/t.json", "--trace /proc/t.json: cannot write in /proc"),
    ("{tmp}", "is a folder"),
    ("{tmp}/t.txt", "must end in .json"),
])
def test_a_trace_that_cannot_be_written_is_refused_before_the_run(plan, tmp_path, trace, words):
    assert_one_line_exit_2(run_cli(plan, "--compute", "emulated", "--trace", trace.format(tmp=tmp_path)), words)
    assert list(tmp_path.iterdir()) == []


def test_missing_devices_are_one_line(plan):
    if not torch.cuda.is_available():
        assert_one_line_exit_2(run_cli(plan, "--device", "cuda"), "device kind (--device) cuda: no CUDA GPU")
    try:
        import torch_npu  # noqa: F401
    except Exception:
        assert_one_line_exit_2(run_cli(plan, "--device", "npu"), "device kind (--device) npu: torch_npu is not usable")


def test_a_model_the_runtime_cannot_build_is_refused(tmp_path):
    path = make_plan(tmp_path, "1f1b", (), 2, model_spec="example-mllm")
    assert_one_line_exit_2(run_cli(str(path)), "explicit per-token costs", "compute mode (--compute) emulated")


# ------------------------------------------------------------ a rank killed from outside, mid-step


def _children(pid: int) -> list[int]:
    return sorted(child for child, state, parent, _ in process_stats() if parent == pid and state != "Z")


def _rank_processes(cli_pid: int) -> list[int]:
    """The ranks: the children of the fork server the run's process started (in rank order)."""
    for child in _children(cli_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"forkserver" in f.read():
                    return _children(child)
        except OSError:
            continue
    return []


@pytest.fixture(scope="module")
def slow_plan(tmp_path_factory):
    """example-mllm's explicit costs on a sampled mix: emulated steps of seconds, on 4 ranks."""
    from mpipe_tune.inputs import load_workload

    workload = load_workload("balanced", num_microbatches=8)
    return str(make_plan(tmp_path_factory.mktemp("slow"), "1f1b", (), 4, model_spec="example-mllm",
                         workload=workload, dtype="bf16"))


RUN_TIMEOUT_S = 600
"""``mpipe-tune run``'s collective timeout: what the other ranks would wait if the death went unnoticed."""


def test_killing_a_rank_mid_step_ends_the_run_quickly_naming_it(slow_plan, tmp_path):
    # The run's scratch folder (where each rank marks that it joined the process group) goes under tmp_path.
    proc = subprocess.Popen([sys.executable, "-m", "mpipe_tune.cli", "run", slow_plan, "--compute", "emulated",
                             "--steps", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        # A hang guard only: the four ranks joined the process group (so the first step is under way).
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(list(tmp_path.glob("mpipe-run-*/rank*.joined"))) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        ranks = _rank_processes(proc.pid)
        assert proc.poll() is None and len(ranks) == 4
        os.kill(ranks[2], signal.SIGKILL)
        # Ended by the death, not by the collective timeout: communicate raises past it.
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "Traceback" not in err
    assert "mpipe-tune run: error: rank 2 died: its process was killed by signal 9" in err, err
    hang_guard = time.monotonic() + 300  # the run joined its ranks before it exited: a guard, not a timing goal
    while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in ranks) and time.monotonic() < hang_guard:
        time.sleep(0.1)
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"], "a rank is still running"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


RANK_WITH_A_LOCK = '''
import multiprocessing, sys


def make_a_lock(ctx):
    """What tqdm does in a rank that reads a dataset (its write lock is a multiprocessing RLock)."""
    global LOCK
    LOCK = multiprocessing.RLock()
    return ctx.rank


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    from mpipe_tune.runtime import launch_local
    import rank_with_a_lock
    print(launch_local(rank_with_a_lock.make_a_lock, (), 2))
'''


def test_a_rank_that_made_a_semaphore_leaves_none_behind(tmp_path):
    """Ranks end with os._exit: multiprocessing's exit handlers, which release a rank's semaphores, must
    run first, or the resource tracker warns of 'leaked semaphore objects' when a run ends (a run of a plan
    sampled from a dataset did)."""
    (tmp_path / "rank_with_a_lock.py").write_text(RANK_WITH_A_LOCK)
    done = subprocess.run([sys.executable, str(tmp_path / "rank_with_a_lock.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-800:]
    assert "leaked" not in done.stderr, done.stderr[-800:]
