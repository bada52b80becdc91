"""``mpipe-tune bench``: a plan file's best plan and its baselines run in rounds on emulated compute."""

import json
import os
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import ctrl_c_after  # noqa: E402
from mpipe_tune.cli import main  # noqa: E402
from mpipe_tune.plan_file import load_plan, plan_names, select_plan  # noqa: E402
from mpipe_tune.runtime import _launch as launch  # noqa: E402

# Short sequences: the example's emulated step takes tens of milliseconds on 2 ranks.
TINY = "microbatches:\n" + "".join(f"  - {{image_tokens: {60 + 40 * i}, text_tokens: 300}}\n" for i in range(4))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    (folder / "tiny.yaml").write_text(TINY)
    path = folder / "plan.json"
    assert main(["plan", "--devices", "2", "--dp", "1", "--tp", "1", "--workload", str(folder / "tiny.yaml"),
                 "--trials", "10", "--no-progress", "--storage", f"sqlite:///{folder / 'study.db'}",
                 "--out", str(path)]) == 0
    return path


def one_line_error(capsys, code, words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def test_json_holds_every_stored_plan_measured_beside_predicted(plan_file, capsys):
    assert main(["bench", str(plan_file), "--compute", "emulated", "--rounds", "2", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out[k] for k in ("plan_file", "compute", "device", "rounds", "steps")} == {
        "plan_file": str(plan_file), "compute": "emulated", "device": "cpu", "rounds": 2, "steps": 1}
    record = load_plan(plan_file)
    assert [p["name"] for p in out["plans"]] == list(plan_names(record)) and len(out["plans"]) == 6
    for p in out["plans"]:  # each ran its own section, at the file's one set of degrees
        section = select_plan(record, p["name"])
        c = section["candidate"]
        assert (p["schedule"], p["pp"], p["tp"], p["dp"], p["microbatches"]) == (
            c["schedule"], c["pp"], c["tp"], c["dp"], c["microbatches"])
        assert p["predicted_step_s"] == section["predicted"]["makespan_s"]
        assert len(p["step_times_s"]) == 2 and len(p["round_measured_s"]) == 2
        assert min(p["step_times_s"]) >= p["predicted_step_s"]  # emulation waits at least each predicted event
        assert p["ratio"] == pytest.approx(p["measured_step_s"] / p["predicted_step_s"])
    plans = {p["name"]: p for p in out["plans"]}
    megatron, best = plans["megatron"], plans["best"]
    assert megatron["speedup_predicted"] == megatron["speedup_measured"] == 1.0
    assert out["speedup"] == {"predicted": best["speedup_predicted"], "measured": best["speedup_measured"]}
    assert out["speedup"]["predicted"] == pytest.approx(megatron["predicted_step_s"] / best["predicted_step_s"])
    assert out["speedup"]["measured"] == pytest.approx(megatron["measured_step_s"] / best["measured_step_s"])
    assert out["complete"] is True


def test_selected_plans_table_progress_and_measured_timelines(plan_file, tmp_path, capsys):
    assert main(["bench", str(plan_file), "--compute", "emulated", "--rounds", "1", "--steps", "2",
                 "--plans", "megatron,best", "--gantt", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    rows = [line.split()[0] for line in captured.out.splitlines() if line.split()[:1] in (["best"], ["megatron"])]
    assert rows == ["megatron", "best"] and "speedup meas" in captured.out
    progress = captured.err.strip().splitlines()
    assert [line.split()[:3] for line in progress] == [["round", "1/1", "megatron"], ["round", "1/1", "best"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.png", "megatron.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.iterdir())


def test_no_progress_leaves_stderr_quiet_as_run_s_does(plan_file, capsys):
    """bench takes run's --no-progress: the table on stdout, no line per finished run on stderr."""
    assert main(["bench", str(plan_file), "--compute", "emulated", "--rounds", "1", "--steps", "1",
                 "--plans", "best", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "speedup meas" in captured.out


@pytest.fixture
def no_launch(monkeypatch):
    """Bad input must be refused before any rank starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "launch_local", refuse)


@pytest.mark.parametrize("args,words", [
    (["--plans", "best,zigzag"], "holds no plan named 'zigzag'; it holds best, megatron, disttrain, vpp, gpipe, mpipe-rr"),
    (["--plans", ","], "the list of plans to run is empty; name one or more of best, megatron"),
    (["--rounds", "0"], "round count (--rounds) is 0"),
    (["--steps", "0"], "step count (--steps) is 0"),
    (["--compute", "emulated", "--gantt", "/no/such/folder"], "--gantt /no/such/folder: no such folder"),
])
def test_bad_input_exits_2_with_one_line(plan_file, capsys, no_launch, args, words):
    one_line_error(capsys, main(["bench", str(plan_file), "--compute", "emulated", *args]), words)


def test_a_plan_file_without_baselines_exits_2(plan_file, tmp_path, capsys, no_launch):
    record = json.loads(plan_file.read_text())
    del record["baselines"]  # as files written from one prediction are
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(record))
    one_line_error(capsys, main(["bench", str(alone), "--compute", "emulated"]), "holds no baselines")


def test_a_missing_plan_file_exits_2(tmp_path, capsys, no_launch):
    one_line_error(capsys, main(["bench", str(tmp_path / "nope.json")]), "cannot read plan file")


def test_ctrl_c_prints_the_rounds_that_finished(plan_file):
    code, out, err, _ = ctrl_c_after([sys.executable, "-m", "mpipe_tune.cli", "bench", str(plan_file), "--compute",
                                   "emulated", "--rounds", "1000", "--steps", "1"], "round 1/1000  best ")
    assert code == 130 and err.strip().splitlines()[-1] == "mpipe-tune bench: interrupted", err
    assert "\nbest " in out and "(cut short: the rows hold the rounds that finished)" in out


def test_a_moved_model_file_is_named_and_found_again_with_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    (tmp_path / "m.yaml").write_text((Path(str(resources.files("mpipe_tune.models"))) / "example-mllm.yaml").read_text())
    assert main(["plan", "--model", "m.yaml", "--devices", "2", "--workload", "tiny.yaml", "--trials", "5",
                 "--no-progress", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", "plan.json"]) == 0
    capsys.readouterr()
    (tmp_path / "m.yaml").rename(tmp_path / "moved.yaml")
    args = ["bench", "plan.json", "--compute", "emulated", "--rounds", "1", "--steps", "1", "--plans", "best", "--json"]
    one_line_error(capsys, main(args), "is not there any more (moved or deleted); give its new path")
    assert main([*args, "--model", "moved.yaml"]) == 0
    assert [p["name"] for p in json.loads(capsys.readouterr().out)["plans"]] == ["best"]
