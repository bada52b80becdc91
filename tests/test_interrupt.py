"""Ctrl-C inside a stop_requests block: the first asks the loop to stop, the second stops it at once; and
in each phase of ``plan`` (search, baseline and own-best evaluation, writing), sent at named points
(``MPIPE_TUNE_SIGINT_AT``) rather than after a sleep: exit 130, what was finished kept, nothing half-written."""

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ctrl_c_after, process_stats
from mpipe_tune.interrupt import held, interrupt_self as ctrl_c, stop_requests


def test_the_first_ctrl_c_is_a_request_and_the_second_raises():
    with stop_requests() as stop:
        ctrl_c()
        assert stop.requested and not stop.forced
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        assert stop.forced
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # outside the block Ctrl-C means what it always did
        ctrl_c()


def test_off_the_main_thread_ctrl_c_keeps_its_meaning():
    seen = {}

    def body():
        with stop_requests() as stop:
            seen["handler"] = signal.getsignal(signal.SIGINT)
            seen["requested"] = stop.requested

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == {"handler": signal.default_int_handler, "requested": False}


# --------------------------------------------------------------------------------------- Ctrl-C in each phase of plan

PLAN = [sys.executable, "-m", "mpipe_tune.cli", "plan", "--devices", "4", "--global-batch", "8", "--samples", "1",
        "--no-progress", "--trials", "40", "--study", "s", "--pp", "2"]
"""Pipelines only: at pp 1 a baseline is the example's best and the bounds settle its space with no trial, so no
trial-numbered safe point would come."""


def plan_interrupted_at(tmp_path, points: str):
    """``plan`` with SIGINT sent to itself at the named points (``MPIPE_TUNE_SIGINT_AT``): its exit code, its
    stderr, the plan file's record (None when none was written) and the study's finished trials."""
    db, out = tmp_path / "study.db", tmp_path / "plan.json"
    env = {**os.environ, "MPIPE_TUNE_SIGINT_AT": points}
    done = subprocess.run([*PLAN, "--storage", f"sqlite:///{db}", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert "Traceback" not in done.stderr, done.stderr
    record = json.loads(out.read_text()) if out.exists() else None
    assert not list(tmp_path.glob("*.tmp*")) and not list(tmp_path.glob(".*plan.json*")), list(tmp_path.iterdir())
    trials = 0
    if db.exists():
        with contextlib.closing(sqlite3.connect(db)) as c:
            trials = c.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    return done.returncode, done.stderr, record, trials


def test_ctrl_c_in_the_search_stops_it_at_the_next_trial_and_writes_the_plan_of_what_it_found(tmp_path):
    code, err, record, trials = plan_interrupted_at(tmp_path, "trial:5")
    assert code == 130 and "stopping at the next safe point" in err
    assert "rerun the same command to continue" in err, err
    assert record is not None and record["search"]["interrupted"] and 5 <= trials < 40
    assert record["search"]["trials"] == trials


def test_a_second_ctrl_c_in_the_search_stops_at_once_with_nothing_written_and_the_trials_kept(tmp_path):
    code, err, record, trials = plan_interrupted_at(tmp_path, "trial:5,trial:5")  # the second before the search reads the first
    assert code == 130 and "interrupted" in err and "rerun the same command to continue" in err, err
    assert record is None and trials == 4  # the four stored before; the fifth was being stored when it stopped


@pytest.mark.parametrize("phase", ["search", "baselines", "families", "writing"])
def test_ctrl_c_before_a_phase_stops_there_with_nothing_written(tmp_path, phase):
    code, err, record, trials = plan_interrupted_at(tmp_path, phase)
    assert code == 130 and "interrupted" in err and record is None, err
    if phase in ("families", "search"):  # the own-best families come first: they seed the search
        assert trials == 0 and "rerun the same command to continue" in err
    else:  # the search was done: its trials stay, a rerun goes straight to the comparison
        assert trials > 5 and f"the study 's' keeps its {trials} finished trials" in err  # all the search ran


@pytest.mark.parametrize("point", ["family:2", "baseline:2"])
def test_ctrl_c_inside_a_phase_stops_at_the_next_safe_point_with_nothing_written(tmp_path, point):
    """In the middle of the own-best families' evaluation (the next safe point: before the search) or of
    the baselines' (the next: before the writing)."""
    code, err, record, trials = plan_interrupted_at(tmp_path, point)
    assert code == 130 and "stopping at the next safe point" in err and record is None, err
    if point.startswith("family"):
        assert trials == 0 and "rerun the same command to continue" in err
    else:
        assert trials > 5 and f"the study 's' keeps its {trials} finished trials" in err


def test_ctrl_c_while_writing_lets_the_files_be_written_whole_and_says_it_came_too_late(tmp_path):
    code, err, record, trials = plan_interrupted_at(tmp_path, "write")  # as the plan file is being written
    assert code == 130 and "interrupted too late to stop: the command finished" in err and "plan.json written" in err
    assert record is not None and not record["search"]["interrupted"] and trials == record["search"]["trials"] > 5


def test_a_second_ctrl_c_while_writing_leaves_no_file_half_written(tmp_path):
    code, err, record, trials = plan_interrupted_at(tmp_path, "write,write")
    assert code == 130 and "interrupted" in err and record is None and trials > 5, err
    assert f"the study 's' keeps its {trials} finished trials" in err


def test_held_defers_ctrl_c_to_the_end_of_the_block():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            ctrl_c()
            done.append("renamed")
    assert done == ["renamed"]


def test_inside_a_command_a_second_ctrl_c_in_held_waits_for_the_end_of_the_block():
    """What renames a command's files into place (found by the planted-fault pass: only held() outside a command
    had a test)."""
    from mpipe_tune.interrupt import command_interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with command_interrupts("test") as stop:
            ctrl_c()  # the first: a request for the next safe point
            with held():
                ctrl_c()  # the second: at once, but after the block
                done.append("renamed")
    assert done == ["renamed"] and stop.forced


def test_sigint_blocked_hands_a_ctrl_c_that_came_inside_to_the_handler_after_the_block():
    from mpipe_tune.interrupt import sigint_blocked

    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_blocked():
            ctrl_c()  # as one arriving while a child process starts: it must not cut the start in the middle
            done.append("started")
    assert done == ["started"]
    with stop_requests() as stop, sigint_blocked():
        ctrl_c()
    assert stop.requested and not stop.forced  # inside a loop's block the first is still a request


# ------------------------------------------------------------------------------------- Ctrl-C in profile

def profile_interrupted_at(tmp_path, points: str, *extra: str):
    """A ``--quick`` CPU profile with SIGINT sent to itself at the named points: exit code, stderr, and
    whether the profile file exists (nothing else may be left in the folder)."""
    out = tmp_path / "p.json"
    env = {**os.environ, "MPIPE_TUNE_SIGINT_AT": points}
    done = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "profile", "--device", "cpu", "--nproc", "2", "--quick",
                           "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in done.stderr, done.stderr
    assert {p.name for p in tmp_path.iterdir()} <= {"p.json"}, list(tmp_path.iterdir())  # no temporary file
    return done.returncode, done.stderr, out.exists()


@pytest.mark.parametrize("point, at_once", [("measure:2", False),  # in the roofline: at its next step
                                            ("links", False),      # before the link workers start
                                            ("link:3", True),      # while they run: at once, with them
                                            ("write,write", False)])  # a second Ctrl-C as the file is written
def test_ctrl_c_in_profile_stops_with_no_profile_written(tmp_path, point, at_once):
    pytest.importorskip("torch")
    code, err, written = profile_interrupted_at(tmp_path, point)
    assert code == 130 and not written, err
    assert ("stopping at the next safe point" in err) != at_once, err
    assert err.strip().splitlines()[-1] == ("mpipe-tune profile: interrupted; no profile written (it needs every "
                                            "measurement); rerun the command to measure again"), err


@pytest.mark.parametrize("points", ["calibration", "calibration,calibration"])
def test_ctrl_c_before_profile_s_calibration_stops_there_with_no_profile_written(tmp_path, points):
    pytest.importorskip("torch")
    code, err, written = profile_interrupted_at(tmp_path, points, "--calibrate", "tiny-vit-llm")
    assert code == 130 and not written and "stopping at the next safe point" in err, err
    assert err.strip().splitlines()[-1].startswith("mpipe-tune profile: interrupted; no profile written"), err


def test_ctrl_c_as_profile_writes_lets_the_file_be_written_whole(tmp_path):
    pytest.importorskip("torch")
    from mpipe_tune.cost import load_profile

    code, err, written = profile_interrupted_at(tmp_path, "write")
    assert code == 130 and written and "interrupted too late to stop: the command finished" in err, err
    assert f"{tmp_path / 'p.json'} written" in err
    assert load_profile(tmp_path / "p.json").name == "p"


# ------------------------------------------------------------------ Ctrl-C in export, workload, report, run, bench

def cli_interrupted_at(monkeypatch, capsys, points: str, *args: str):
    """``main(args)`` in this process with SIGINT sent at the named points: exit code, stdout, stderr."""
    from mpipe_tune.cli import main

    monkeypatch.setenv("MPIPE_TUNE_SIGINT_AT", points)
    code = main(list(args))
    monkeypatch.delenv("MPIPE_TUNE_SIGINT_AT")
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from mpipe_tune.cli import main

    folder = tmp_path_factory.mktemp("interrupt-plan")
    assert main(["plan", "--devices", "4", "--global-batch", "8", "--samples", "1", "--trials", "6", "--no-progress",
                 "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(folder / "plan.json"),
                 "--pp", "2"]) == 0  # pipelines: a pp-1 plan exports to torchtitan as one file, no CSV beside it
    return folder / "plan.json"


def test_ctrl_c_in_export_writes_both_files_or_neither(plan_file, tmp_path, monkeypatch, capsys):
    args = ["export", str(plan_file), "--to", "torchtitan", "--plan", "megatron", "--out", str(tmp_path / "job.toml")]
    for points in ("writing", "write,write", "write:2,write:2"):  # before, at the first file, at the second
        code, _, err = cli_interrupted_at(monkeypatch, capsys, points, *args)
        assert code == 130 and err.strip().splitlines()[-1] == "mpipe-tune export: interrupted; nothing written", err
        assert not list(tmp_path.iterdir()), points
    code, out, err = cli_interrupted_at(monkeypatch, capsys, "write:2", *args)  # a first one as they are written
    written = sorted(p.name for p in tmp_path.iterdir())
    assert code == 130 and len(written) == 2 and "job.toml" in written, written
    assert "interrupted too late to stop: the command finished" in err and "job.toml" in err and "written" in out


def test_ctrl_c_in_workload_and_report_leaves_no_picture_or_page(plan_file, tmp_path, monkeypatch, capsys):
    llava = Path(__file__).parent / "fixtures" / "llava" / "llava-mini.json"
    code, _, err = cli_interrupted_at(monkeypatch, capsys, "writing", "workload", str(llava), "--model",
                                      "qwen2vl-vit-qwen2-7b", "--plot", str(tmp_path / "w.png"))
    assert code == 130 and "mpipe-tune workload: interrupted; nothing written" in err, err
    code, _, err = cli_interrupted_at(monkeypatch, capsys, "writing", "report", str(plan_file), "--html",
                                      str(tmp_path / "r.html"))
    assert code == 130 and "mpipe-tune report: interrupted; nothing written" in err, err
    assert not list(tmp_path.iterdir())


def test_ctrl_c_before_run_launches_starts_no_rank_and_one_after_it_keeps_the_result(plan_file, tmp_path,
                                                                                     monkeypatch, capsys):
    pytest.importorskip("torch")
    from mpipe_tune.runtime import _launch as launch

    started = []
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: started.append(a))
    trace = tmp_path / "trace.json"
    code, out, err = cli_interrupted_at(monkeypatch, capsys, "launch", "run", str(plan_file), "--compute", "emulated",
                                        "--steps", "1", "--trace", str(trace))
    assert code == 130 and not started and err.strip().splitlines()[-1] == "mpipe-tune run: interrupted; no rank was started"
    assert not trace.exists()
    monkeypatch.undo()
    code, out, err = cli_interrupted_at(monkeypatch, capsys, "trace", "run", str(plan_file), "--compute", "emulated",
                                        "--steps", "1", "--trace", str(trace), "--no-progress")
    assert code == 130 and "measured step time" in out and not trace.exists(), err
    assert "the run finished and its result is printed, the trace" in err


def test_ctrl_c_after_bench_s_rounds_prints_them_and_draws_no_timeline(plan_file, tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    code, out, err = cli_interrupted_at(monkeypatch, capsys, "timelines", "bench", str(plan_file), "--compute",
                                        "emulated", "--rounds", "1", "--steps", "1", "--plans", "best",
                                        "--gantt", str(tmp_path))
    assert code == 130 and "best" in out and not list(tmp_path.iterdir()), err
    assert "every round's result is printed, the measured timelines were not drawn" in err


# ----------------------------------------------------------- a second Ctrl-C stops run, bench and profile at once

def test_a_second_ctrl_c_in_run_stops_at_once_with_no_rank_started_or_no_trace_written(plan_file, tmp_path,
                                                                                        monkeypatch, capsys):
    pytest.importorskip("torch")
    from mpipe_tune.runtime import _launch as launch

    trace = tmp_path / "trace.json"
    args = ["run", str(plan_file), "--compute", "emulated", "--steps", "1", "--trace", str(trace), "--no-progress"]
    started = []
    with monkeypatch.context() as patch:
        patch.setattr(launch, "launch_local", lambda *a, **k: started.append(a))
        code, out, err = cli_interrupted_at(monkeypatch, capsys, "launch,launch", *args)  # as the checks end
    assert code == 130 and not started and "stopping at the next safe point" in err, err
    assert err.strip().splitlines()[-1] == "mpipe-tune run: interrupted; no rank was started" and not trace.exists()
    code, out, err = cli_interrupted_at(monkeypatch, capsys, "trace,trace", *args)  # the ranks done, the trace next
    assert code == 130 and not trace.exists() and not list(tmp_path.iterdir()), err
    assert "measured step time" not in out, out  # at once: not even the table a first Ctrl-C lets through
    assert err.strip().splitlines()[-1] == "mpipe-tune run: interrupted; the run finished", err


def test_a_second_ctrl_c_after_bench_s_rounds_stops_at_once_with_no_timeline_drawn(plan_file, tmp_path, monkeypatch,
                                                                                    capsys):
    pytest.importorskip("torch")
    code, out, err = cli_interrupted_at(monkeypatch, capsys, "timelines,timelines", "bench", str(plan_file),
                                        "--compute", "emulated", "--rounds", "1", "--steps", "1", "--plans", "best",
                                        "--gantt", str(tmp_path))
    assert code == 130 and not list(tmp_path.iterdir()) and not out, (out, err)
    assert "round 1/1  best " in err  # each round's line, printed as it ended, is what is kept
    assert err.strip().splitlines()[-1] == "mpipe-tune bench: interrupted", err


def test_a_second_ctrl_c_in_profile_s_roofline_stops_at_once_with_no_profile_written(tmp_path):
    pytest.importorskip("torch")
    code, err, written = profile_interrupted_at(tmp_path, "measure:2,measure:2")
    assert code == 130 and not written and "stopping at the next safe point" in err, err
    assert err.strip().splitlines()[-1].startswith("mpipe-tune profile: interrupted; no profile written"), err


def test_ctrl_c_while_run_s_ranks_work_stops_them_at_once_with_no_trace_written(plan_file, tmp_path):
    """A terminal's Ctrl-C reaches the ranks too: the run stops at once with them (there is no later safe
    point to wait for), sent once the first step has ended (its progress line), not after a sleep."""
    pytest.importorskip("torch")
    trace = tmp_path / "trace.json"
    args = [sys.executable, "-m", "mpipe_tune.cli", "run", str(plan_file), "--compute", "emulated", "--steps", "100000",
            "--trace", str(trace)]
    code, _, err, group = ctrl_c_after(args, "mpipe-tune run: step 1/100000 done")
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "mpipe-tune run: interrupted", err
    assert not trace.exists() and not list(tmp_path.iterdir())
    hang_guard = time.monotonic() + 300  # the fork server exits as it sees the run gone: a guard, not a timing goal
    while left := [p for p, state, _, pgid in process_stats() if pgid == group and state != "Z"]:
        assert time.monotonic() < hang_guard, f"processes {left} outlived the run"
        time.sleep(0.1)


# ---------------------------------------------------------------------- Ctrl-C in profile across nodes (torchrun)

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("points, measured", [("links", False),           # before the links: nothing measured
                                              ("links,links", False),     # a second one there
                                              ("", True)])                # one while they are measured: at once
def test_ctrl_c_in_profile_across_nodes_writes_no_profile(tmp_path, monkeypatch, capsys, points, measured):
    """Rank 0 of a torchrun world (the world itself stands in: joining it is what the Ctrl-C must not
    outlast); the Ctrl-C while the links are measured is sent by the stand-in, at a controlled point."""
    pytest.importorskip("torch")
    from mpipe_tune.profiler import _nodes as nodes

    calls = []

    def links_measured(*args, **kwargs):
        calls.append(args)
        ctrl_c()  # as a terminal's Ctrl-C reaches the ranks while they measure
        raise AssertionError("the Ctrl-C did not stop the measurement at once")

    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(nodes, "measure_link_classes", links_measured)
    out = tmp_path / "two-nodes.json"
    code, _, err = cli_interrupted_at(monkeypatch, capsys, points or "none", "profile", "--device", "cpu", "--compute",
                                      "ideal", "--quick", "--out", str(out))
    assert code == 130 and bool(calls) == measured and not list(tmp_path.iterdir()), err
    assert err.strip().splitlines()[-1] == ("mpipe-tune profile: interrupted; no profile written (it needs every "
                                            "measurement); rerun the command to measure again"), err


# ------------------------------------------------------------------------ Ctrl-C from the first line, the writer's start

CLI = [sys.executable, "-m", "mpipe_tune.cli"]


@pytest.mark.parametrize("point", ["entry", "imports"])
def test_ctrl_c_from_the_entry_point_s_first_line_exits_130_in_one_line(tmp_path, point):
    """At the entry point's first line and among the commands' imports (what the parser is built from)."""
    env = {**os.environ, "MPIPE_TUNE_SIGINT_AT": point}
    done = subprocess.run([*CLI, "predict", "--gantt", str(tmp_path / "g.png")], env=env, capture_output=True,
                          text=True, timeout=120)  # a hang guard
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["mpipe-tune: interrupted before the command started; nothing was written"]
    assert not list(tmp_path.iterdir())


def test_a_ctrl_c_a_tenth_of_a_second_after_start_exits_130_without_a_traceback(tmp_path):
    """A terminal's Ctrl-C 0.1 s after the command starts: idle, that is inside the commands' imports. "Starts" is
    counted from the moment the interpreter has started (it says so on stderr, then runs the console script's own
    lines), so that a loaded machine, whose interpreter start-up alone can take a second, still sends it there."""
    script = ("import sys; sys.stderr.write('started\\n'); sys.stderr.flush(); from mpipe_tune.cli import main; "
              f"sys.exit(main(['predict', '--gantt', {str(tmp_path / 'g.png')!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline() == "started\n"
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err and len(err.splitlines()) <= 2, err
    assert not list(tmp_path.iterdir())


WRITER_PLAN = [*CLI, "plan", "--devices", "8", "--global-batch", "32", "--no-progress", "--sampler", "tpe", "--trials",
               "5000", "--study", "w"]


@pytest.mark.parametrize("points,stopped_at_once", [("writer,writer-starting", True),
                                                    ("writer-starting,writer-starting", False)])
def test_ctrl_c_twice_while_the_trial_writer_starts_leaves_no_traceback(tmp_path, points, stopped_at_once):
    """A Ctrl-C just before the writer's child starts and a second while it starts (the parent's exit used to
    remove the semaphores the child was opening: a traceback from the child), and two while it starts (held back
    until it has started: one request, served at the next trial)."""
    db, out = tmp_path / "study.db", tmp_path / "plan.json"
    env = {**os.environ, "MPIPE_TUNE_SIGINT_AT": points}
    done = subprocess.run([*WRITER_PLAN, "--storage", f"sqlite:///{db}", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)  # a hang guard; the writer's exit included
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert "rerun the same command to continue" in done.stderr, done.stderr
    assert out.exists() != stopped_at_once  # stopped at once: nothing written; at the next trial: the plan of it
    assert not list(tmp_path.glob("*.tmp*")) and not list(tmp_path.glob(".*plan.json*"))
