"""predict, plan and run with expert and context parallelism, ZeRO and the recompute granularity."""

import json
from pathlib import Path

import pytest

from mpipe_tune.cli import main
from mpipe_tune.plan_file import load_plan

MOE = str(Path(__file__).parent / "runtime" / "tiny-mllm-mla-moe.yaml")
SMALL = ["--model", MOE, "--devices", "4", "--global-batch", "8", "--samples", "1", "--no-progress",
         "--max-microbatches", "4"]


def one_line_error(capsys, code, words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def test_predict_shows_the_degrees_and_memory_policy(capsys):
    args = ["predict", "--model", MOE, "--schedule", "1f1b", "--pp", "2", "--dp", "4", "--ep", "2",
            "--recompute", "selective", "--zero", "0", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["ep"], record["cp"], record["zero_stage"], record["recompute"]) == (2, 1, 0, "selective")
    full = ["predict", "--model", MOE, "--schedule", "1f1b", "--pp", "2", "--cp", "2", "--recompute", "--json"]
    assert main(full) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["ep"], record["cp"], record["recompute"]) == (1, 2, True)


def test_predict_zero_2_and_3_shard_what_they_say_and_a_bad_stage_is_refused(capsys):
    peaks, steps = {}, {}
    for setting in ("1", "2", "3", "3-reshard", "3-keep"):
        assert main(["predict", "--model", MOE, "--profile", "h100-sxm", "--schedule", "1f1b", "--pp", "2", "--dp", "4",
                     "--zero", setting, "--json"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["zero_stage"] == int(setting[0])
        peaks[setting] = max(r["memory"]["static_bytes"] for r in record["ranks"])
        steps[setting] = record["makespan_s"]
    assert max(peaks["3-reshard"], peaks["2"]) < peaks["1"] == peaks["3-keep"] == peaks["3"]  # pp 2: keep by default
    assert steps["1"] == steps["3-keep"] <= steps["2"] <= steps["3-reshard"] and steps["1"] < steps["3-reshard"]
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--model", MOE, "--schedule", "1f1b", "--pp", "2", "--zero", "4"])
    one_line_error(capsys, exit_.value.code, "invalid choice: '4' (choose from '0', '1', '2', '3', '3-reshard', '3-keep')")


def test_predict_refuses_an_expert_degree_that_does_not_divide_dp(capsys):
    code = main(["predict", "--model", MOE, "--schedule", "1f1b", "--pp", "2", "--dp", "4", "--ep", "3"])
    one_line_error(capsys, code, "expert-parallel degree 3 must divide the data-parallel degree 4")


def test_plan_lists_ep_and_cp_for_every_plan_and_the_runtime_runs_them(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", *SMALL, "--ep", "2", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(out),
                 "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["candidate"]["ep"] == 2 and summary["candidate"]["cp"] == 1
    for r in summary["comparison"] + summary["own_best"]:
        assert r["ep"] == 2 and r["cp"] == 1, r["plan"]
    record = load_plan(str(out))
    assert (record["candidate"]["ep"], record["candidate"]["cp"]) == (2, 1)
    assert main(["run", str(out), "--compute", "emulated", "--steps", "1", "--json", "--no-progress"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["world_size"] == 4 and ran["compute"] == "emulated" and len(ran["step_times_s"]) == 1
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ep"] == 2 and abs(shown["makespan_s"] - shown["recorded_makespan_s"]) <= 1e-12 * shown["makespan_s"]


def test_predict_takes_the_encoders_own_tp_and_refuses_a_non_divisor(capsys):
    base = ["predict", "--model", MOE, "--schedule", "transpose,1f1b", "--pp", "2", "--tp", "2", "--json"]
    assert main(base) == 0
    at_tp = json.loads(capsys.readouterr().out)
    assert main([*base, "--encoder-tp", "1"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert (at_tp["encoder_tp"], own["encoder_tp"]) == (2, 1)
    assert own["makespan_s"] != at_tp["makespan_s"]
    code = main([*base[:-1], "--tp", "4", "--encoder-tp", "3"])
    one_line_error(capsys, code, "must divide the tensor-parallel degree 4")


def test_plan_searches_encoder_tp_and_an_export_without_it_refuses_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", *SMALL, "--tp", "2", "--encoder-tp", "search", "--trials", "40", "--storage",
                 f"sqlite:///{tmp_path / 's.db'}", "--out", str(out), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    for r in summary["comparison"] + summary["own_best"]:
        assert r["encoder_tp"] in (1, 2), r["plan"]
        assert r["encoder_tp"] * r["encoder_dp"] == r["tp"] * r["dp"] * r["cp"], r  # the encoder's own tp x dp: the slab's ranks
    record = json.loads(out.read_text())
    record["candidate"]["encoder_tp"] = 1  # whichever the search chose, a plan with the encoder at tp 1
    out.write_text(json.dumps(record))
    code = main(["export", str(out), "--to", "hyper-parallel"])  # torch-csv has no degrees: it writes the order
    one_line_error(capsys, code, "encoder tp 1")


def test_predict_and_plan_take_how_the_trainer_reduces_gradients(tmp_path, capsys):
    base = ["predict", "--model", "llama3-8b", "--profile", "h100-sxm", "--schedule", "1f1b", "--pp", "2", "--dp", "4",
            "--microbatches", "4", "--json"]
    steps = {}
    for extra in ([], ["--dp-overlap", "off"], ["--dp-overlap", "off", "--grad-reduce-dtype", "bf16"]):
        assert main([*base, *extra]) == 0
        record = json.loads(capsys.readouterr().out)
        steps[tuple(extra)] = record["makespan_s"]
        assert record["overlap_dp_comm"] is ("off" not in extra)
        assert record["grad_reduce_dtype"] == ("bf16" if "bf16" in extra else "fp32")
    serial, serial_bf16 = steps[("--dp-overlap", "off")], steps[("--dp-overlap", "off", "--grad-reduce-dtype", "bf16")]
    assert steps[()] < serial and serial_bf16 < serial  # the exposed reduce shrinks with overlap (buckets of 40M
    # parameters: an 8B model has many) and with half the bytes
    out = tmp_path / "plan.json"
    assert main(["plan", *SMALL, "--profile", "h100-sxm", "--grad-reduce-dtype", "bf16", "--dp-overlap", "off",
                 "--trials", "10", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(out)]) == 0
    capsys.readouterr()
    inputs = load_plan(out)["inputs"]
    assert (inputs["grad_reduce_dtype"], inputs["overlap_dp_comm"]) == ("bf16", False)
    assert main(["show", str(out), "--json"]) == 0  # re-predicted with the stored options: the same step
    shown = json.loads(capsys.readouterr().out)
    assert abs(shown["makespan_s"] - shown["recorded_makespan_s"]) <= 1e-12 * shown["makespan_s"]
    record = json.loads(out.read_text())
    record["inputs"]["grad_reduce_dtype"] = "fp16"
    out.write_text(json.dumps(record))
    one_line_error(capsys, main(["show", str(out)]), "field 'grad_reduce_dtype' must be one of fp32, bf16")
