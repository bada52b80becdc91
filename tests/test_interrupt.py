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

import pytest

from mpipe_tune.interrupt import held, stop_requests


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


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
        "--no-progress", "--trials", "40", "--study", "s"]


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
        assert trials == 40 and "the study 's' keeps its 40 finished trials" in err


def test_ctrl_c_while_writing_lets_the_files_be_written_whole_and_says_it_came_too_late(tmp_path):
    code, err, record, trials = plan_interrupted_at(tmp_path, "write")  # as the plan file is being written
    assert code == 130 and "interrupted too late to stop: the command finished" in err and "plan.json written" in err
    assert record is not None and not record["search"]["interrupted"] and trials == 40


def test_a_second_ctrl_c_while_writing_leaves_no_file_half_written(tmp_path):
    code, err, record, trials = plan_interrupted_at(tmp_path, "write,write")
    assert code == 130 and "interrupted" in err and record is None and trials == 40, err


def test_held_defers_ctrl_c_to_the_end_of_the_block():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held():
            ctrl_c()
            done.append("renamed")
    assert done == ["renamed"]
