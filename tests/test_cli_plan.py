import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import process_stats
from mpipe_tune.cli import main
from mpipe_tune.cost import dump_profile
from mpipe_tune.plan_file import all_plan_names, load_plan, plan_names, select_plan
from mpipe_tune.cost import load_profile

SMALL = ["--devices", "2", "--global-batch", "4", "--samples", "1", "--no-progress"]


def plan(tmp_path, *args):
    """Run ``plan`` in-process with the study and plan file under tmp_path."""
    return main(["plan", "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--out", str(tmp_path / "plan.json"), *args])


def one_line_error(capsys, code, words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def test_default_plan_and_show(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--no-progress"]) == 0  # the built-in example, default storage in the working folder
    out = capsys.readouterr().out
    assert (tmp_path / "mpipe-tune.db").exists() and (tmp_path / "plan.json").exists()
    for name in ("best", "megatron", "disttrain", "vpp", "gpipe", "mpipe-rr"):
        assert f"\n{name} " in out
    assert main(["show", "plan.json", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["makespan_s"] == pytest.approx(shown["recorded_makespan_s"], rel=1e-12)
    assert shown["search"]["comparison"][0]["plan"] == "best"


def test_plan_json_compares_the_best_with_every_baseline(tmp_path, capsys):
    assert plan(tmp_path, "--devices", "4", "--global-batch", "8", "--samples", "2", "--no-progress", "--json",
                "--pp", "2,4") == 0  # pipelines: at pp 1 only megatron exists (tests/search/test_compare.py)
    record = json.loads(capsys.readouterr().out)
    rows = {r["plan"]: r for r in record["comparison"]}
    assert set(rows) == {"best", "megatron", "disttrain", "vpp", "gpipe", "mpipe-rr"}
    assert rows["megatron"]["speedup"] == 1.0
    assert rows["best"]["step_s"] <= min(r["step_s"] for r in rows.values())
    best = rows["best"]
    assert all((r["pp"], r["tp"], r["dp"]) == (best["pp"], best["tp"], best["dp"]) for r in rows.values())
    assert best["p90_s"] >= min(best["step_samples_s"]) and len(best["step_samples_s"]) == 2
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["search"]["candidate"]["schedule"] == best["schedule"]
    assert written["candidate"]["slabs"] == best["slabs"]


def test_every_baseline_at_its_own_best_and_the_current_layout_in_json_and_plan_file(tmp_path, capsys):
    current = "pp=4,tp=1,dp=1,schedule=1f1b,M=8"
    assert plan(tmp_path, "--devices", "4", "--global-batch", "8", "--samples", "2", "--no-progress",
                "--current", current, "--json", "--pp", "2,4") == 0
    out = json.loads(capsys.readouterr().out)
    best = out["comparison"][0]
    at_best = {r["plan"]: r for r in out["comparison"][1:]}
    own = {r["plan"]: r for r in out["own_best"]}
    assert set(own) == {f"{name}@own" for name in at_best} and set(out["families"]) == set(at_best)
    speedups = out["speedups"]
    for name, r in at_best.items():
        assert speedups["at_best_degrees"][name] == r["best_speedup"] == pytest.approx(r["step_s"] / best["step_s"])
        mine = own[f"{name}@own"]
        assert speedups["at_own_best"][name] == mine["best_speedup"] == pytest.approx(mine["step_s"] / best["step_s"])
        assert mine["pp"] * mine["tp"] * mine["dp"] == 4 and mine["fits_memory"]
        if r["fits_memory"]:  # the baseline at the best plan's degrees is one plan of its family
            assert mine["step_s"] <= r["step_s"]
    row = out["current"]
    assert (row["plan"], row["schedule"], row["pp"], row["tp"], row["dp"], row["microbatches"]) == (
        "current", "1f1b", 4, 1, 1, 8)
    assert row["slabs"] == [[13, 4, 4, 4]]  # the Megatron-style layout: encoder and projector in stage 0
    assert speedups["over_current"] == row["best_speedup"] == pytest.approx(row["step_s"] / best["step_s"])
    record = load_plan(tmp_path / "plan.json")
    assert record["search"] == {k: v for k, v in out.items() if k != "plan_file"}
    assert all_plan_names(record) == (*plan_names(record), *own, "current")
    for name, r in [*own.items(), ("current", row)]:  # each a runnable section of its own degrees
        c = select_plan(record, name)["candidate"]
        assert (c["schedule"], c["pp"], c["tp"], c["dp"], c["microbatches"], c["slabs"]) == (
            r["schedule"], r["pp"], r["tp"], r["dp"], r["microbatches"], r["slabs"])
        assert select_plan(record, name)["predicted"]["makespan_s"] == pytest.approx(r["step_samples_s"][0], rel=1e-12)


def test_the_table_shows_both_speedups_and_the_current_row(tmp_path, capsys):
    assert plan(tmp_path, *SMALL, "--current", "pp=2,schedule=transpose,1f1b,owners=greedy") == 0
    out = capsys.readouterr().out
    assert "best over" in out.splitlines()[3] and "\nbest over  the best plan's speedup over the row" in out
    lines = [line.split()[0] for line in out.splitlines() if line.split()[:1] and "@own" in line.split()[0]]
    assert lines == [f"{name}@own" for name in ("megatron", "disttrain", "vpp", "gpipe", "mpipe-rr")]
    (current,) = [line for line in out.splitlines() if line.startswith("current ")]
    assert "transpose,1f1b" in current and "greedy" in current
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    assert "\nmegatron@own " in capsys.readouterr().out


@pytest.mark.parametrize("current,words", [
    ("pp=4,tp=1,dp=1,schedule=1f1b", "current layout 'pp=4,tp=1,dp=1,schedule=1f1b': pp*tp*dp = 4*1*1 = 4, but it must "
                                     "equal the 2 devices"),
    ("pp=2,schedule=1f1b,M=3", "M=3, but the microbatch count must divide the 4 sequences per replica"),
    ("pp=2,schedule=transpose,gpipe,1f1b,cut=9,17", "mixing 1f1b and gpipe in one wavefront is not supported"),
    ("pp=2,schedule", "'schedule' is not a key=value pair"),
])
def test_a_bad_current_layout_exits_2_with_one_line_before_the_search(tmp_path, capsys, current, words):
    one_line_error(capsys, plan(tmp_path, *SMALL, "--current", current), words)
    assert not (tmp_path / "study.db").exists() and not (tmp_path / "plan.json").exists()


def test_bench_runs_the_own_best_and_current_plans_beside_the_best(tmp_path, capsys):
    pytest.importorskip("torch")
    workload = tmp_path / "tiny.yaml"  # short sequences: emulated steps of milliseconds
    workload.write_text("microbatches:\n" + "".join(f"  - {{image_tokens: {60 + 40 * i}, text_tokens: 300}}\n"
                                                    for i in range(4)))
    assert plan(tmp_path, "--devices", "4", "--workload", str(workload), "--trials", "10", "--no-progress",
                "--pp", "2", "--current", "pp=4,schedule=1f1b") == 0
    capsys.readouterr()
    plans = "best,megatron,disttrain@own,current"
    assert main(["bench", str(tmp_path / "plan.json"), "--plans", plans, "--compute", "emulated", "--rounds", "1",
                 "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ran = {p["name"]: p for p in out["plans"]}
    assert list(ran) == plans.split(",") and out["reference"] == "megatron" and out["complete"]
    assert (ran["current"]["pp"], ran["best"]["pp"]) == (4, 2)  # other degrees, the same four ranks
    assert ran["megatron"]["speedup_predicted"] == 1.0
    assert ran["current"]["speedup_predicted"] == pytest.approx(
        ran["megatron"]["predicted_step_s"] / ran["current"]["predicted_step_s"])


def test_gantt_pictures_of_the_best_plan_and_the_baseline(tmp_path, capsys):
    best, baseline = tmp_path / "best.png", tmp_path / "megatron.png"
    assert plan(tmp_path, *SMALL, "--gantt", str(best), "--gantt-baseline", str(baseline)) == 0
    for path in (best, baseline):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["show", str(tmp_path / "plan.json"), "--gantt", str(tmp_path / "shown.png")]) == 0
    assert "recorded step time" in capsys.readouterr().out and (tmp_path / "shown.png").exists()


def tiny_capacity_profile(tmp_path):
    data = load_profile("ideal").to_dict()
    data["name"] = "tiny-memory"
    data["memory_capacity_bytes"]["value"] = 1e6
    path = tmp_path / "tiny-memory.json"
    dump_profile(data, path)
    return str(path)


@pytest.mark.parametrize("args,words", [
    (["--devices", "29"], "no (pp, tp, dp) with pp*tp*dp = 29 devices gives a plan"),  # pp 29 or dp 29 of 4
    (["--devices", "29"], "has 25 layers"),
    (["--devices", "4", "--pp", "3"], "--pp 3 does not divide the 4 devices (pp*tp*dp = 4): pin a divisor of 4 (1, 2, 4)"),
    (["--devices", "8", "--tp", "3,5"], "--tp 3,5 does not divide the 8 devices"),
    (["--devices", "4", "--pp", "2", "--tp", "4"], "pp pinned to 2, tp pinned to 4"),  # each divides, no product does
    (["--owners", "lottery"], "owner policies (--owners) 'lottery'"),
    (["--skeletons", "zigzag"], "skeletons (--skeletons) 'zigzag'"),
    (["--sampler", "annealing"], "sampler (--sampler) 'annealing' is unknown"),
    (["--trials", "0"], "trial budget (--trials) is 0"),
    (["--storage", "nosuchdb://x"], "study storage (--storage) nosuchdb://x: cannot open"),
    (["--model", "nope"], "neither a file nor a built-in model"),
    (["--workload", "nope"], "unknown workload 'nope'"),
])
def test_impossible_or_malformed_requests_exit_2_with_one_line(tmp_path, capsys, args, words):
    one_line_error(capsys, plan(tmp_path, *SMALL, *args), words)


@pytest.mark.parametrize("args,words", [
    (["--tolerance", "-0.1"], "tolerance (--tolerance) is -0.1, but it must be a share >= 0 and < 1"),
    (["--tolerance", "nan"], "tolerance (--tolerance) is nan"),
    (["--timeout", "-5"], "search time limit (--timeout) is -5.0 s, but it must be a positive number of seconds"),
    (["--timeout", "0"], "search time limit (--timeout) is 0.0 s"),
    (["--ep", "2"], "expert-parallel degrees (--ep) 2: model 'example-mllm' has no MoE layers, so only 1 applies"),
])
def test_a_bad_search_setting_exits_2_before_the_study_is_opened(tmp_path, capsys, args, words):
    """Nothing is left behind: the study's SQLite file is created only once the settings are good."""
    one_line_error(capsys, plan(tmp_path, *SMALL, *args), words)
    assert not (tmp_path / "study.db").exists() and not (tmp_path / "plan.json").exists()


def test_zero_bubble_skeletons_are_planned_on_request_and_export_as_split_backwards(tmp_path, capsys):
    assert plan(tmp_path, *SMALL, "--skeletons", "zb1p,zbv", "--pp", "2") == 0  # at pp 1 megatron@own's 1f1b ties
    best = json.loads((tmp_path / "plan.json").read_text())["candidate"]["schedule"]
    assert {s for s in best.split(",") if s != "transpose"} <= {"zb1p", "zbv"}, best
    assert '"W' in (tmp_path / "plan.json").read_text()  # its order holds the weight-gradient events
    capsys.readouterr()
    out = tmp_path / "best.csv"
    code = main(["export", str(tmp_path / "plan.json"), "--to", "torch-csv", "--out", str(out)])
    if "transpose" in best:  # the CSV has no replicated stage: refused in one line, nothing written
        one_line_error(capsys, code, "is a transpose")
        assert not out.exists()
    else:  # the split backward goes out as torch's I and W actions
        assert code == 0
        actions = {re.sub(r"\d", "", cell.strip()) for line in out.read_text().splitlines() for cell in line.split(",")}
        assert {"I", "W"} <= actions, out.read_text()


def test_interior_transposes_join_the_space_on_request_and_a_model_without_a_projector_is_told(tmp_path, capsys):
    sizes = {}
    for extra in ([], ["--interior-transpose"]):
        assert plan(tmp_path, *SMALL, "--exhaustive", "--json", *extra) == 0
        summary = json.loads(capsys.readouterr().out)
        sizes[bool(extra)] = (summary["space_size"], summary["study"])
    assert sizes[True][0] > sizes[False][0] and sizes[True][1] != sizes[False][1]  # its own, larger study
    assert plan(tmp_path, *SMALL, "--model", "small-vit-llm", "--interior-transpose", "--trials", "2") == 0
    assert "has no projector layers between its encoder and its backbone" in capsys.readouterr().err


def test_a_model_that_fits_no_plan_exits_2(tmp_path, capsys):
    code = plan(tmp_path, *SMALL, "--model", "tiny-vit-llm", "--profile", tiny_capacity_profile(tmp_path))
    one_line_error(capsys, code, "no plan fits memory (after widening recomputation (--recompute), ZeRO stage (--zero), "
                                 "sequence parallelism (--sequence-parallel)): of the plans tried the smallest static memory")


def test_show_refuses_a_plan_whose_inputs_changed(tmp_path, capsys):
    model = tmp_path / "m.yaml"
    model.write_text((Path(__file__).parents[1] / "models" / "tiny-vit-llm.yaml").read_text())
    assert plan(tmp_path, *SMALL, "--model", str(model)) == 0
    capsys.readouterr()
    plan_file = tmp_path / "plan.json"
    assert main(["show", str(plan_file)]) == 0
    capsys.readouterr()
    model.write_text(model.read_text().replace("ffn: 128", "ffn: 192"))
    one_line_error(capsys, main(["show", str(plan_file)]), "the model")
    model.write_text(model.read_text().replace("ffn: 192", "ffn: 128"))
    record = json.loads(plan_file.read_text())
    record["inputs"]["workload"]["microbatches"][0]["text_tokens"] += 1
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(record))
    one_line_error(capsys, main(["show", str(tampered)]), "the workload")
    record["inputs"]["workload"]["microbatches"][0]["text_tokens"] -= 1
    record["inputs"]["profile"]["hash"] = "0" * 64
    tampered.write_text(json.dumps(record))
    one_line_error(capsys, main(["show", str(tampered)]), "the profile 'ideal' has changed")


def complete_trials(db):
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db, timeout=5) as con:
            return con.execute("SELECT number, value FROM trials JOIN trial_values USING (trial_id) "
                               "WHERE state = 'COMPLETE' ORDER BY number").fetchall()
    except sqlite3.OperationalError:  # tables not created yet
        return []


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return [child for child, _, parent, _ in process_stats() if parent == pid]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], hang_guard_s: float = 600) -> None:
    """Until every one of ``pids`` has exited (a hang guard, far above a loaded machine, not a timing goal)."""
    deadline = time.monotonic() + hang_guard_s
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} still running"
        time.sleep(0.2)


@pytest.mark.parametrize("sig,times", [(signal.SIGKILL, 1), (signal.SIGINT, 1), (signal.SIGINT, 2)])
def test_a_killed_plan_resumes_with_every_finished_trial_kept(tmp_path, sig, times):
    db = tmp_path / "study.db"
    args = [sys.executable, "-m", "mpipe_tune.cli", "plan", "--devices", "8", "--global-batch", "32",
            "--storage", f"sqlite:///{db}", "--study", "resume", "--out", str(tmp_path / "plan.json"), "--no-progress",
            "--sampler", "tpe", "--pp", "2,4,8"]  # pipelines: at pp 1 the bounds settle the space in a few trials
    # Unbuffered: a line read before communicate() leaves nothing behind in a buffer that it would not see.
    proc = subprocess.Popen([*args, "--trials", "5000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, bufsize=0)
    try:
        hang_guard = time.monotonic() + 600  # far above a loaded machine: a guard against a hang, not a timing goal
        while len(complete_trials(db)) < 8:  # the trials are written by a child process (5000 trials)
            assert proc.poll() is None and time.monotonic() < hang_guard, "the search did not get going"
            time.sleep(0.2)
        writers = _children(proc.pid)
        proc.send_signal(sig)
        said = b""
        if times == 2:  # a second Ctrl-C, once the first was seen (two at once would merge into one signal)
            for line in proc.stderr:  # until the first is seen (a note may come before it), or the command ended
                said += line
                if b"stopping at the next safe point" in line:
                    break
            proc.send_signal(sig)  # stops at once, wherever the search is (or finds the command ended)
        _, err = proc.communicate(timeout=300)  # a hang guard
        err = (said + err).decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "rerun the same command to continue" in err, err
        assert "Traceback" not in err, err
    else:
        assert proc.returncode == -signal.SIGKILL
    _wait_gone(writers)  # the trial writer drains what the killed search had handed over, then exits
    before = complete_trials(db)
    target = len(before) + 4
    rerun = subprocess.run([*args, "--trials", str(target), "--json"], capture_output=True, text=True,
                           timeout=600)  # a hang guard
    assert rerun.returncode == 0, rerun.stderr
    after = complete_trials(db)
    assert after[:len(before)] == before and len(after) == target
    record = json.loads(rerun.stdout)
    assert record["trials"] == target and record["new_trials"] == 4


def _csv_rows(path):
    """A --csv table read back with pandas: one dict per plan, list cells decoded from JSON, missing as None."""
    import pandas as pd

    frame = pd.read_csv(path, keep_default_na=False, na_values=[""])
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    for r in rows:
        for key in ("cut", "slabs", "step_samples_s"):
            r[key] = json.loads(r[key])
    return rows


def _table_order(search):
    """The summary's rows in the printed table's order: best, each baseline and its @own row, current."""
    rows = {r["plan"]: r for r in [*search["comparison"], *search["own_best"], search["current"] or {"plan": None}]}
    order = ["best", *(n for name in ("megatron", "disttrain", "vpp", "gpipe", "mpipe-rr") for n in (name, f"{name}@own"))]
    return [rows[n] for n in [*order, "current"] if n in rows]


def test_csv_of_plan_and_show_is_the_comparison_table_in_si_units(tmp_path, capsys):
    table = tmp_path / "plan.csv"
    assert plan(tmp_path, *SMALL, "--current", "pp=2,schedule=1f1b", "--json", "--csv", str(table)) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = _csv_rows(table)
    expected = _table_order(summary)
    assert [r["plan"] for r in rows] == [r["plan"] for r in expected] and rows[-1]["plan"] == "current"
    for got, want in zip(rows, expected):  # every column, the values the JSON's (seconds, bytes, ratios)
        assert set(got) == set(want), got["plan"]
        for key, value in want.items():
            assert got[key] == (pytest.approx(value, rel=1e-15) if isinstance(value, float) else value), (got["plan"], key)
    shown = tmp_path / "shown.csv"
    assert main(["show", str(tmp_path / "plan.json"), "--csv", str(shown)]) == 0
    assert shown.read_text() == table.read_text()
    assert f"table written to {shown}" in capsys.readouterr().out


@pytest.mark.parametrize("name,words", [("nodir/plan.csv", "does not exist"), ("plan.txt", "must end in .csv"),
                                        (".", "is a folder")])
def test_a_bad_csv_path_exits_2_before_the_search(tmp_path, capsys, name, words):
    one_line_error(capsys, plan(tmp_path, *SMALL, "--csv", str(tmp_path / name)), words)
    assert not (tmp_path / "study.db").exists() and not (tmp_path / "plan.json").exists()
    one_line_error(capsys, main(["show", str(tmp_path / "plan.json"), "--csv", str(tmp_path / name)]), words)


def test_the_table_says_which_step_time_it_shows_and_show_says_which_it_predicts(tmp_path, capsys):
    assert plan(tmp_path, "--devices", "2", "--global-batch", "4", "--samples", "2", "--no-progress") == 0
    out = capsys.readouterr().out
    assert "\nstep ms    the mean predicted step time over the 2 sampled steps" in out
    assert "'mpipe-tune show' and the Gantt picture hold each plan's first sampled step only" in out
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    shown = capsys.readouterr().out
    assert "(the plan file's one stored step: the first of the search's 2 sampled steps" in shown


# ------------------------------------------------------------- outputs, sizes, plan-file integrity, workers


@pytest.mark.parametrize("flag,path,words", [
    ("--out", "/proc/x.json", "--out /proc/x.json: cannot write in /proc"),
    ("--out", "{tmp}", "is a folder"),
    ("--out", "{tmp}/plan.txt", "must end in .json"),
    ("--gantt", "/proc/x.png", "--gantt /proc/x.png: cannot write in /proc"),
    ("--gantt", "{tmp}/x.xyz", "must end in .png"),
    ("--gantt", "/nodir/x.png", "folder /nodir does not exist"),
    ("--gantt-baseline", "/nodir/x.png", "--gantt-baseline /nodir/x.png: folder /nodir does not exist"),
    ("--gantt-baseline", "{tmp}/x.jpg", "--gantt-baseline"),
])
def test_a_bad_output_path_exits_2_before_the_search_and_writes_nothing(tmp_path, capsys, flag, path, words):
    args = ["plan", "--storage", f"sqlite:///{tmp_path / 'study.db'}", *SMALL]
    if flag != "--out":
        args += ["--out", str(tmp_path / "plan.json")]
    one_line_error(capsys, main([*args, flag, path.format(tmp=tmp_path)]), words)
    assert list(tmp_path.iterdir()) == []  # no study, no plan file, no scratch file


def test_a_picture_that_fails_leaves_no_plan_file(tmp_path, capsys, monkeypatch):
    from mpipe_tune.errors import MpipeError
    from mpipe_tune.report import _gantt as gantt

    def fail(*args, **kwargs):
        raise MpipeError("drawing failed")

    monkeypatch.setattr(gantt, "draw_gantt", fail)
    one_line_error(capsys, plan(tmp_path, *SMALL, "--gantt", str(tmp_path / "best.png")), "drawing failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.db"]  # the search ran; nothing was written


@pytest.mark.parametrize("args,words", [
    (["--devices", "1000000"], "the device count 1000000 is above 65536, a limit no real plan reaches"),
    (["--global-batch", "1000000000"], "global batch (sequences per step over all replicas) 1000000000 is above 262144"),
    (["--samples", "100000"], "the number of sampled steps 100000 is above 64"),
    (["--global-batch", "0"], "global batch (sequences per step over all replicas) is 0, but it must be an integer >= 1"),
    (["--devices", "2", "--global-batch", "131072", "--samples", "8"], "above 524288, a limit no real plan reaches"),
    (["--cut-window", "-5"], "the cut window is -5 layers, but it must be an integer >= 0"),
])
def test_sizes_no_real_plan_reaches_exit_2_at_once(tmp_path, capsys, args, words):
    one_line_error(capsys, plan(tmp_path, *SMALL, *args), words)
    assert not list(tmp_path.iterdir())  # "at once": refused before the search opened its study (not timed: CI is loaded)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("integrity")
    assert main(["plan", "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(folder / "plan.json"),
                 *SMALL, "--pp", "2"]) == 0  # two ranks, whose orders the damage below swaps
    return folder / "plan.json"


def _reorder(record):
    nodes = record["order"]["nodes"][1]
    nodes[0], nodes[1] = nodes[1], nodes[0]


@pytest.mark.parametrize("damage,words", [
    (lambda r: r["candidate"].pop("cut"), "candidate field 'cut' = None must be a list of integers"),
    (lambda r: r["candidate"].update(tp=0), "candidate field 'tp' = 0 must be an integer from 1 to 65536"),
    (lambda r: r["candidate"].update(pp="2"), "candidate field 'pp' = '2' must be an integer"),
    (lambda r: r["candidate"].update(owners=[0] * 3), "candidate field 'owners' lists 3 entries"),
    (lambda r: r["candidate"].update(dtype="fp7"), "candidate field 'dtype' = 'fp7' must be one of"),
    (lambda r: r["candidate"].update(zero_stage=4), "candidate field 'zero_stage' = 4 must be one of 0, 1, 2, 3"),
    (lambda r: r["candidate"].update(reshard_after_forward="yes"),
     "candidate field 'reshard_after_forward' = 'yes' must be true, false or null"),
    (lambda r: r["predicted"].update(makespan_s="fast"), "field 'makespan_s' must be a number, got 'fast'"),
    (lambda r: r["predicted"].update(makespan_s=-1.0), "field 'makespan_s' = -1.0 must be >= 0"),
    (lambda r: r["predicted"]["durations_s"].__setitem__(0, float("inf")), "must be a finite number"),
    (lambda r: r["search"].update(samples="four"), "field 'search.samples' = 'four' must be int"),
    (lambda r: r["inputs"]["model"].update(hash=None), "field 'inputs.model' must hold its 'spec', 'name' and 'hash'"),
    (lambda r: r["candidate"].update(cut=[99]), "its stored candidate does not predict"),
    (_reorder, "rank 1's stored order differs from derive's for its candidate: step 0 runs"),
])
def test_show_refuses_a_damaged_plan_file_in_one_line_before_any_output(plan_file, tmp_path, capsys, damage, words):
    record = json.loads(plan_file.read_text())
    damage(record)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(record))
    code = main(["show", str(bad), "--gantt", str(tmp_path / "shown.png")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err
    assert "re-create it with 'mpipe-tune plan'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_relative_inputs_are_stored_resolved_and_a_moved_one_is_named(tmp_path, capsys, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "m.yaml").write_text((Path(__file__).parents[1] / "models" / "tiny-vit-llm.yaml").read_text())
    dump_profile(load_profile("ideal").to_dict(), work / "my.json")
    monkeypatch.chdir(work)
    assert main(["plan", "--storage", "sqlite:///study.db", "--model", "m.yaml", "--profile", "my.json", *SMALL]) == 0
    inputs = json.loads((work / "plan.json").read_text())["inputs"]
    assert (inputs["model"]["spec"], inputs["profile"]["spec"]) == (str(work / "m.yaml"), str(work / "my.json"))
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["show", str(work / "plan.json")]) == 0  # from another folder
    capsys.readouterr()
    (work / "m.yaml").rename(elsewhere / "moved.yaml")
    one_line_error(capsys, main(["show", str(work / "plan.json")]),
                   f"its model (--model) file {work / 'm.yaml'} is not there any more (moved or deleted); "
                   f"give its new path")
    assert main(["show", str(work / "plan.json"), "--model", "moved.yaml"]) == 0


def test_two_workers_on_one_study_stop_at_the_requested_total(tmp_path):
    """Each worker alone would add 80 trials; together they stop at 80 (before the fix: 80 plus the overlap)."""
    db = tmp_path / "study.db"
    args = [sys.executable, "-m", "mpipe_tune.cli", "plan", "--devices", "8", "--global-batch", "32", "--storage",
            f"sqlite:///{db}", "--study", "shared", "--trials", "80", "--no-progress", "--json", "--sampler", "tpe",
            "--pp", "2,4,8"]  # pipelines: at pp 1 the bounds settle the space before 80 trials
    workers = []
    try:
        for k in range(2):
            workers.append(subprocess.Popen([*args, "--out", str(tmp_path / f"plan{k}.json")], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True))
            hang_guard = time.monotonic() + 600  # far above a loaded machine: a guard, not a timing goal
            while k == 0 and len(complete_trials(db)) < 5:  # the second worker joins a study the first is filling
                assert time.monotonic() < hang_guard, "the first worker did not get going"
                if workers[0].poll() is not None:
                    break  # it ended (its failure is asserted below)
                time.sleep(0.05)
        outputs = [w.communicate(timeout=300) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert [w.returncode for w in workers] == [0, 0], [err for _, err in outputs]
    records = [json.loads(out) for out, _ in outputs]
    # the study holds exactly the total; each worker reports the trials it saw stored when it finished, which
    # leaves out a trial the other was still writing at that moment (79 under load), never one past the total
    assert len(complete_trials(db)) == 80 and all(r["trials"] <= 80 and r["mode"] == "optuna" for r in records)
    assert sum(r["new_trials"] for r in records) == 80


def test_plan_zero_3_writes_a_fully_sharded_plan_that_show_re_predicts(tmp_path, capsys):
    assert plan(tmp_path, "--devices", "4", "--global-batch", "8", "--samples", "1", "--no-progress", "--zero", "3") == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["candidate"]["zero_stage"] == 3 and record["candidate"]["dp"] * record["candidate"]["pp"] == 4
    assert {row["zero_stage"] for row in record["search"]["comparison"]} == {3}  # the baselines too
    assert "zero3" in out
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    recorded, repredicted = re.search(r"recorded step time ([\d.]+) ms; re-predicted ([\d.]+) ms",
                                      capsys.readouterr().out).groups()
    assert recorded == repredicted
