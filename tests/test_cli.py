import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpipe_tune.cli import main
from conftest import cli, predict_plan


def test_predict_json_reports_makespan_and_per_rank_figures(capsys):
    assert main(["predict", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["makespan_s"] > 0
    assert [r["rank"] for r in record["ranks"]] == [0, 1, 2, 3]
    for r in record["ranks"]:
        assert {"busy_s", "bubble_s", "spill_s"} <= set(r)
        assert r["busy_s"] + r["bubble_s"] == pytest.approx(record["makespan_s"])


def test_transpose_beats_encoder_in_first_stage_on_the_example(capsys):
    main(["predict", "--json"])
    mpipe = json.loads(capsys.readouterr().out)["makespan_s"]
    main(["predict", "--schedule", "1f1b", "--cut", "", "--json"])
    baseline = json.loads(capsys.readouterr().out)["makespan_s"]
    assert mpipe < baseline


def test_derive_json_lists_placement_collectives_and_orders(capsys):
    assert main(["derive", "--pp", "2", "--microbatches", "4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["collectives"]["seams"] == [{"seam": [1, 2], "fwd": "gather", "bwd": "scatter"}]
    assert record["placement"][0]["owners"] == [0, 1, 0, 1]
    assert record["nodes"][0][0] == "F1.0#0" and record["nodes"][1][-1] == "barrier"


def test_frozen_encoder_has_no_scatter(capsys):
    main(["derive", "--pp", "2", "--microbatches", "4", "--frozen", "encoder,projector", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["collectives"]["seams"][0]["bwd"] is None
    assert not any(e.startswith("B1.") for nodes in record["nodes"] for e in nodes)


def test_gantt_picture_is_written(tmp_path):
    out = tmp_path / "g.png"
    code, stdout, _ = cli("predict", "--gantt", str(out))
    assert code == 0 and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,words", [
    (["--cut", "99"], "boundary 1 is 99"),
    (["--cut", "5,3", "--schedule", "transpose,1f1b,1f1b"], "increase strictly"),
    (["--schedule", "transpose,zigzag"], "'zigzag', which is not a skeleton"),
    (["--pp", "0"], "P must be an integer >= 1"),
    (["--microbatches", "0", "--workload", "balanced"], "microbatch"),
    (["--owner", "0,1,2,9,0,1,2,3"], "owned by rank 9"),
    (["--model", "nope"], "neither a file nor a built-in model"),
    (["--profile", "nope"], "nope"),
    (["--workload", "nope"], "nope"),
    (["--frozen", "vision"], "no such block"),
    (["--slabs", "1,2,3"], "multiple of --pp"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    code, stdout, stderr = cli("predict", *args)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr
    assert words in lines[0]


@pytest.mark.parametrize("content,words", [
    ("name: x\nlayers: 5\n", "'layers' must be a list"),
    ("name: x\nlayers:\n  - {name: a, block: llm}\n", "needs costs"),
    ("name: x\nlayers:\n  - {name: a, block: llm, fwd_s_per_token: -1, bwd_s_per_token: 1}\n", "'fwd_s_per_token' = -1 must be >= 0"),
    ("name: x\nlayers:\n  - {name: a, block: llm, fwd_s_per_token: .inf, bwd_s_per_token: 1}\n", "must be a finite number"),
    ("name: x\nlayers:\n  - {name: a, block: llm, fwd_s_per_token: 1.0e+300, bwd_s_per_token: 1}\n", "<= 1"),
    ("name: x\nlayers:\n  - {name: a, block: llm, fwd_s_per_token: 1e-6, bwd_s_per_token: 1}\n", "write it as 1.0e-6"),
    ("name: x\nlayers: [\n", "not valid YAML"),
    ("name: x\nlayers:\n  - {name: a, block: llm, kind: warp_block, hidden: 4}\n", "warp_block"),
    ("name: x\nlayers:\n  - {name: a, block: llm, kind: dense_block, hidden: -64, heads: 4, ffn: 128}\n", "hidden"),
])
def test_malformed_model_file_is_one_line_and_exit_2(tmp_path, content, words):
    path = tmp_path / "m.yaml"
    path.write_text(content)
    code, _, stderr = cli("predict", "--model", str(path))
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and words in stderr


def test_profile_with_units_in_a_number_is_one_line_and_exit_2(tmp_path):
    data = json.loads((Path(__file__).parents[1] / "profiles" / "ideal.json").read_text())
    data["memory_capacity_bytes"]["value"] = "80 GB"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code, _, stderr = cli("predict", "--profile", str(path))
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "memory_capacity_bytes" in stderr


def test_malformed_profile_and_workload_files_are_one_line_and_exit_2(tmp_path):
    bad_profile = tmp_path / "p.json"
    bad_profile.write_text("{not json")
    code, _, stderr = cli("predict", "--profile", str(bad_profile))
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    workload = tmp_path / "w.yaml"
    workload.write_text("microbatches:\n  - {image_tokens: 10, text_tokens: 20}\n  - {image_tokens: -1, text_tokens: 20}\n")
    code, _, stderr = cli("predict", "--workload", str(workload))
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "image_tokens" in stderr
    good = tmp_path / "g.yaml"
    good.write_text("microbatches:\n" + "  - {image_tokens: 10, text_tokens: 20}\n" * 3)
    code, _, stderr = cli("predict", "--workload", str(good), "--microbatches", "4")
    assert code == 2 and "3 microbatches" in stderr


@pytest.mark.parametrize("flag,suffix", [("--model", ".yaml"), ("--workload", ".yaml"), ("--profile", ".json")])
def test_a_file_that_is_not_text_is_one_line_and_exit_2(tmp_path, flag, suffix):
    path = tmp_path / f"g{suffix}"
    path.write_bytes(bytes(range(128, 256)) * 8)
    code, _, stderr = cli("predict", flag, str(path))
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is not UTF-8 text" in lines[0] and str(path) in lines[0], stderr


def test_a_folder_given_as_a_file_is_one_line_and_exit_2(tmp_path):
    folder = tmp_path / "w.yaml"
    folder.mkdir()
    code, _, stderr = cli("predict", "--workload", str(folder))
    assert code == 2 and "is a folder" in stderr and len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.parametrize("args,words", [
    (["--seed", "-1"], "workload seed -1 must be an integer from 0"),
    (["--microbatches", "10000000000"], "microbatch count 10000000000 is above 65536"),
    (["--schedule", "1f1b", "--cut", "", "--owner", "0,1"], "has no transpose region"),
    (["--model", "qwen2vl-vit-qwen2-7b", "--profile", "h100-sxm", "--pp", "2", "--tp", "8"],
     "tensor-parallel degree 8 must divide heads 28 of layer"),
])
def test_out_of_range_candidates_are_one_line_and_exit_2(args, words):
    code, _, stderr = cli("predict", *args)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], stderr


def test_a_model_that_composes_itself_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "self.yaml"
    path.write_text(f"name: self\ncompose: [{path}]\n")
    code, _, stderr = cli("predict", "--model", str(path))
    assert code == 2 and "composes itself" in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_version():
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "--version"], capture_output=True, text=True,
                          timeout=300)  # a hang guard
    assert proc.returncode == 0 and proc.stdout.strip().startswith("mpipe-tune ")


@pytest.mark.parametrize("path,words", [
    ("/proc/x.png", "--gantt /proc/x.png: cannot write in /proc"),
    ("{tmp}/g.xyz", "must end in .png"),
    ("{tmp}", "is a folder"),
])
def test_a_bad_picture_path_is_one_line_before_any_work(tmp_path, capsys, path, words):
    code = main(["predict", "--gantt", path.format(tmp=tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err
    assert list(tmp_path.iterdir()) == []


def test_export_checks_its_outputs_and_writes_all_of_them_or_none(tmp_path, capsys):
    from mpipe_tune.plan_file import dump_plan, plan_record, PlanInputs
    from mpipe_tune.algebra import Cut, parse_schedule
    from mpipe_tune.cost import load_profile
    from mpipe_tune.inputs import load_model, load_workload

    model, profile = load_model("tiny-vit-llm"), load_profile("ideal")
    workload = load_workload("balanced", num_microbatches=4)
    prediction = predict_plan(Cut(()), parse_schedule("1f1b"), model, workload, profile, 2)
    dump_plan(plan_record(prediction, model, workload, profile, PlanInputs("tiny-vit-llm", (), "ideal")),
              tmp_path / "plan.json")
    for out, words in (("/proc/x.csv", "--out /proc/x.csv: cannot write in /proc"), (str(tmp_path), "is a folder"),
                       (str(tmp_path / "job.csv"), "must end in .toml")):
        code = main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--out", out])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    (tmp_path / "job.csv").mkdir()  # the CSV beside the TOML cannot be written: neither file is
    code = main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--out", str(tmp_path / "job.toml")])
    err = capsys.readouterr().err
    assert code == 2 and f"the file beside --out, {tmp_path / 'job.csv'}, is a folder" in err  # not "a path in it"
    assert "move it aside or give --out another name" in err and "job.csv/NAME" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.csv", "plan.json"]


def test_predict_takes_plans_recompute_words_too(capsys):
    steps = {}
    for word in ("none", "off", "full", "on"):
        assert main(["predict", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--recompute", word,
                     "--json"]) == 0
        steps[word] = json.loads(capsys.readouterr().out)["makespan_s"]
    assert steps["off"] == steps["none"] and steps["on"] == steps["full"] and steps["full"] > steps["none"]


@pytest.mark.parametrize("args,words", [
    (["run", "plan.json", "--device", "tpu"], "mpipe-tune run: error: argument --device: invalid choice: 'tpu'"),
    (["profile", "--device", "cpu"], "mpipe-tune profile: error: the following arguments are required: --out"),
    (["plan", "--devices", "four"], "mpipe-tune plan: error: argument --devices: invalid int value: 'four'"),
    (["plan", "--no-such-flag"], "mpipe-tune plan: error: unrecognized arguments: --no-such-flag"),
    ([], "mpipe-tune: error: the following arguments are required: COMMAND"),
])
def test_a_flag_the_parser_refuses_is_one_line_too(args, words):
    """argparse's own errors (an unknown flag or choice, a missing one) end as the domain's do: one line,
    exit 2, pointing to --help rather than printing the usage block above it."""
    code, stdout, stderr = cli(*args)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0] and "--help" in lines[0], stderr


@pytest.mark.parametrize("command", ["plan", "predict", "derive", "workload", "run", "bench"])
def test_the_help_of_every_command_that_reads_a_model_names_hugging_face_configs(command, capsys):
    """docs/inputs.md: a model is a built-in name, a YAML spec or a Hugging Face config.json (or its folder)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Hugging Face" in text.split("--model MODEL built-in model", 1)[1][:100]


def test_profile_help_suggests_an_out_path_that_profile_flags_read_back(capsys):
    """'profiles/NAME.json' in the working folder is no built-in: --profile NAME would not find it there."""
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "profiles/NAME.json" not in text and "--profile my-host.json" in text


def test_every_flag_with_a_default_says_it_in_its_help():
    """A user compares commands by their --help: each flag that has a default value names it."""
    import argparse

    from mpipe_tune.cli import build_parser

    silent = [f"{name} {action.option_strings[0]}" for name, command in build_parser().commands.items()
              for action in command._actions
              if action.option_strings and not action.required and action.default not in (None, False, "", argparse.SUPPRESS)
              and "default" not in (action.help or "")]
    assert not silent, silent


def test_every_flag_s_stated_default_is_its_value():
    """The value a flag's help states as its default is the one the flag takes (1 for 1.0; 'all' where the default
    is every policy), so that two commands' helps compare."""
    import argparse

    from mpipe_tune.cli import build_parser

    wrong = []
    for name, command in build_parser().commands.items():
        for action in command._actions:
            value = action.default
            if not action.option_strings or action.required or value in (None, False, "", argparse.SUPPRESS):
                continue
            forms = {str(value)} | ({f"{value:g}"} if isinstance(value, float) else set())
            text = (action.help or "").replace("%%", "%")
            if not any(re.search(r"(?<![\w.])" + re.escape(form) + r"(?!\w)", text) for form in forms) \
                    and not ("," in str(value) and "all " in text):
                wrong.append(f"{name} {action.option_strings[0]}: {value!r} not in {text!r}")
    assert not wrong, wrong


HF_FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.mark.parametrize("folder", ["Qwen3-8B", "Meta-Llama-3-8B", "Mixtral-8x7B-v0.1"])
def test_predict_on_a_text_only_model_says_how_to_give_the_cut(folder):
    """The default schedule transpose,1f1b has no encoder boundary to cut at on a text-only model: the error
    names the fix (--cut or a one-region schedule) in one line under 300 characters."""
    code, _, stderr = cli("predict", "--model", str(HF_FIXTURES / folder))
    assert code == 2 and "Traceback" not in stderr
    line, = stderr.strip().splitlines()
    assert "--schedule 1f1b" in line and "--cut" in line and len(line) < 300, line
    assert cli("predict", "--model", str(HF_FIXTURES / folder), "--schedule", "1f1b")[0] == 0


def test_a_model_file_that_is_neither_yaml_nor_a_hf_config_is_named_as_a_file():
    readme = HF_FIXTURES / "README.md"
    code, _, stderr = cli("predict", "--model", str(readme))
    assert code == 2 and "Traceback" not in stderr
    line, = stderr.strip().splitlines()
    assert "neither a YAML model file" in line and "neither a file nor" not in line and len(line) < 300, line
    line, = cli("predict", "--model", "nope")[2].strip().splitlines()
    assert "'mpipe-tune models'" in line and len(line) < 300, line
