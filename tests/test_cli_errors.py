"""Errors below the command line name quantities; the command line adds the flag that sets each."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import mpipe_tune
from mpipe_tune.cli import main
from mpipe_tune.cli._errors import FLAGS, error_line, flag_of
from mpipe_tune.errors import MpipeError


def test_the_flag_follows_the_quantity_s_first_mention_and_names_another_command_s_flag():
    exc = MpipeError("x: run it with owner mode fixed, or re-plan with owner policy greedy; owner mode again",
                     quantities=("owner mode", "owner policy"))
    assert error_line(exc, "run") == ("x: run it with owner mode (--owners) fixed, or re-plan with owner policy "
                                      "(plan --owners) greedy; owner mode again")
    assert flag_of("trial budget", "plan") == "--trials" and flag_of("trial budget", "show") == "plan --trials"
    assert flag_of("step count", "bench", {"--steps", "--rounds"}) == "--steps"  # bench has run's flag too
    assert flag_of("step count", "plan", {"--trials"}) == "run --steps"
    assert flag_of("no such quantity", "plan") is None


def test_a_quantity_is_matched_as_a_whole_word_and_one_not_named_is_skipped():
    exc = MpipeError("layers in model.json and in model 'm'", quantities=("model", "dtype"))
    assert error_line(exc, "plan") == "layers in model.json and in model (--model) 'm'"
    exc = MpipeError("context-parallel degrees '0': expected integers", quantities=("context-parallel degree",))
    assert error_line(exc, "plan") == str(exc)  # not inside "degrees"


def test_the_cli_prints_the_domain_error_with_its_flag_and_exits_2(capsys, tmp_path):
    code = main(["plan", "--trials", "0", "--no-progress", "--storage", f"sqlite:///{tmp_path / 's.db'}",
                 "--out", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "error: trial budget (--trials) is 0, but at least one trial is needed" in err
    assert not (tmp_path / "plan.json").exists()


def test_a_profile_without_the_plans_dtype_names_the_dtype_flag(capsys, tmp_path):
    from mpipe_tune.cost import dump_profile, load_profile

    profile = load_profile("ideal")
    fp32_only = tmp_path / "fp32.json"
    dump_profile(replace(profile, peak_flops_per_s={"fp32": profile.peak("fp32")}), fp32_only)
    code = main(["plan", "--profile", str(fp32_only), "--no-progress", "--storage", "none",
                 "--out", str(tmp_path / "plan.json")])  # plan's default dtype: bf16
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "has no peak_flops_per_s for 'bf16'; it has ['fp32']: pick one of those as the dtype (--dtype)" in err
    assert not (tmp_path / "plan.json").exists()


def test_every_quantity_the_package_names_has_a_flag_and_no_error_below_the_cli_names_one():
    """Each ``quantities=(...)`` literal of the package names a quantity of :data:`FLAGS`, and no error
    message below ``cli/`` spells one of this tool's flags (other tools' flags, quoted, are allowed)."""
    ours = {flag.rpartition(" ")[2] for flag in FLAGS.values()} | {"--owner", "--plan", "--to", "--out"}
    package = Path(mpipe_tune.__file__).parent
    unknown, flagged = [], []
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "").endswith("Error")):
                continue
            for kw in node.keywords:
                if kw.arg == "quantities" and isinstance(kw.value, ast.Tuple):
                    unknown += [c.value for c in kw.value.elts if isinstance(c, ast.Constant) and c.value not in FLAGS]
            text = "".join(c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str))
            text = re.sub(r"`[^`]*`|torchrun[^;)]*", "", text)  # a command quoted whole, another tool's flags
            flagged += [f"{path.name}:{node.lineno}" for f in re.findall(r"--[a-z][\w-]*", text) if f in ours]
    assert not unknown, unknown
    assert not flagged, flagged


def test_a_line_over_the_cap_keeps_its_start_and_its_fix_and_gives_up_its_middle():
    from mpipe_tune.cli._parser import MAX_ERROR_CHARS, _cut

    deep = "/tmp/" + "/".join(f"folder-number-{i}" for i in range(20)) + "/plan.json"
    line = f"mpipe-tune show: error: {deep}: the model file {deep}x is not there any more; give its new path"
    cut = _cut(line)
    assert len(line) > MAX_ERROR_CHARS >= len(cut) and " ... " in cut
    assert cut.startswith("mpipe-tune show: error: /tmp/folder-number-0/") and cut.endswith(" ... give its new path")

    long_fix = "mpipe-tune plan: error: no plan; " + " ".join(["add devices or freeze blocks"] * 20)
    cut = _cut(long_fix)
    assert len(cut) <= MAX_ERROR_CHARS and cut.startswith("mpipe-tune plan: error: no plan;")
    assert cut.endswith("add devices or freeze blocks")
    assert cut.split(" ... ")[1].split()[0] in ("add", "devices", "or", "freeze", "blocks")  # the fix's end, from a word

    no_fix = "mpipe-tune plan: error: --model '" + "x" * 500 + "' is neither a file nor a model name"
    cut = _cut(no_fix)
    assert len(cut) <= MAX_ERROR_CHARS and cut.endswith("x ... ") and "\n" not in cut
    assert _cut("short\nline") == "short\\nline"
