"""The CLI under random input: every command ends in exit 0 or 2, with no traceback, and a failed
command leaves no output file behind (not even a temporary one).

Files are random bytes, random JSON/YAML trees, and valid files with one field replaced or removed;
flags take random values around their limits. Commands run in-process (``mpipe_tune.cli.main``);
``run`` stops after its pre-flight checks (the launcher is replaced by a stub), and one subprocess
checks the console entry point on a random file. The example counts are fixed (not the CI
profile's) so that the whole file stays well under a minute; ``MPIPE_FUZZ_SCALE`` multiplies them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpipe_tune.cli import main

ROOT = Path(__file__).parents[1]
FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
SCALE = int(os.environ.get("MPIPE_FUZZ_SCALE", "1"))
"""Multiplies every example count: MPIPE_FUZZ_SCALE=20 for a longer hunt on a workstation."""

KEYS = ["name", "layers", "block", "trainable", "repeat", "fwd_s_per_token", "bwd_s_per_token", "kind", "hidden",
        "heads", "ffn", "compose", "microbatches", "image_tokens", "text_tokens", "images", "schema", "schema_version",
        "candidate", "order", "predicted", "inputs", "value", "source", "peak_flops_per_s", "links"]
leaves = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=12) | st.sampled_from(["encoder", "llm", "1f1b", "bf16", "1e-6", ".inf", "", "-1"]))
trees = st.recursive(leaves, lambda children: st.lists(children, max_size=4)
                     | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=5),
                     max_leaves=20)


def _mutated(data, draw):
    """``data`` with one randomly chosen field replaced by a random tree, or removed."""
    data = json.loads(json.dumps(data))
    node, path = data, []
    while isinstance(node, (dict, list)) and node and (not path or draw(st.booleans())):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append((node, key))
        node = node[key]
    if not path:
        return draw(trees)
    parent, key = path[-1]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[key]
    else:
        parent[key] = draw(trees)
    return data


def cli(*args: str) -> tuple[int, str, str]:
    """``main(args)`` in-process: exit code, stdout, stderr. argparse's own errors exit 2 too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def check(result: tuple[int, str, str], folder: Path, inputs: set[str]) -> int:
    """Exit 0 or 2, no traceback; on failure, nothing in ``folder`` but the inputs."""
    code, _out, err = result
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert err.strip(), "an error exit says why"
        left = {p.name for p in folder.iterdir()} - inputs
        assert not left, f"a failed command left {left}"
    return code


def write_input(folder: Path, name: str, content) -> str:
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif name.endswith(".json"):
        path.write_text(json.dumps(content))
    else:
        path.write_text(yaml.safe_dump(content))
    return str(path)


VALID_MODEL = yaml.safe_load((ROOT / "models" / "example-mllm.yaml").read_text())
VALID_PROFILE = json.loads((ROOT / "profiles" / "ideal.json").read_text())
VALID_WORKLOAD = {"microbatches": [{"image_tokens": 256 * (i % 3), "text_tokens": 1024,
                                    "images": [256] * (i % 3)} for i in range(4)]}


@st.composite
def mutated(draw, valid):
    return _mutated(valid, draw)


def file_contents(valid):
    return st.one_of(st.binary(max_size=300), trees, mutated(valid), mutated(valid))


# ----------------------------------------------------------------------------------- predict, derive

ints = st.one_of(st.integers(-3, 12), st.sampled_from([0, 10**10, -10**10, 2**63]))
texts = st.one_of(st.text(max_size=10), st.sampled_from(["", "1,2", "0,1,0,1", "9", "-1", "1,,2", "round-robin"]))


@settings(FAST, max_examples=100 * SCALE)
@given(command=st.sampled_from(["predict", "derive"]),
       model=st.sampled_from(["example-mllm", "tiny-vit-llm", "FILE"]), model_file=file_contents(VALID_MODEL),
       workload=st.sampled_from(["balanced", "smoke", "FILE"]), workload_file=file_contents(VALID_WORKLOAD),
       profile=st.sampled_from(["ideal", "h100-sxm", "FILE"]), profile_file=file_contents(VALID_PROFILE),
       pp=ints, microbatches=st.none() | ints, tp=ints, dp=ints, seed=ints,
       schedule=st.sampled_from(["transpose,1f1b", "1f1b", "1f1b,1f1b", "gpipe", "transpose", "zig", ""]),
       cut=st.none() | texts, slabs=st.none() | texts, owner=texts, frozen=st.sampled_from(["", "encoder", "vision"]),
       dtype=st.sampled_from(["bf16", "fp32", "fp7"]), gantt=st.sampled_from([None, "g.png", "g.xyz", "/proc/g.png"]))
def test_predict_and_derive_take_any_flags_and_files(command, model, model_file, workload, workload_file, profile,
                                                      profile_file, pp, microbatches, tp, dp, seed, schedule, cut,
                                                      slabs, owner, frozen, dtype, gantt):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = {"model": write_input(folder, "m.yaml", model_file), "workload": write_input(folder, "w.yaml", workload_file),
                 "profile": write_input(folder, "p.json", profile_file)}
        args = [command, "--model", files["model"] if model == "FILE" else model,
                "--workload", files["workload"] if workload == "FILE" else workload,
                "--profile", files["profile"] if profile == "FILE" else profile,
                "--pp", str(pp), "--tp", str(tp), "--dp", str(dp), "--seed", str(seed), "--schedule", schedule,
                "--owner", owner, "--frozen", frozen, "--dtype", dtype, "--json"]
        args += ["--microbatches", str(microbatches)] if microbatches is not None else []
        args += [f"--cut={cut}"] if cut is not None else []
        args += [f"--slabs={slabs}"] if slabs else []
        if command == "predict" and gantt is not None:
            args += ["--gantt", gantt if gantt.startswith("/") else str(folder / gantt)]
        check(cli(*args), folder, {"m.yaml", "w.yaml", "p.json"})


# --------------------------------------------------------------------------------------------- plan


@settings(FAST, max_examples=8 * SCALE)
@given(devices=st.sampled_from([1, 2, 4, 0, -1, 10**7]), global_batch=st.sampled_from([None, 0, 4, 7, 10**10]),
       samples=st.sampled_from([1, 0, 10**6]), cut_window=st.sampled_from([1, 0, -5]),
       max_microbatches=st.sampled_from([8, 0]), pp=st.sampled_from([None, "2", "0", "x", "3,5"]),
       recompute=st.sampled_from(["off", "search"]), owners=st.sampled_from(["round-robin", "greedy", "lottery"]),
       out=st.sampled_from(["plan.json", "plan.txt", "/proc/plan.json", "."]),
       gantt=st.sampled_from([None, "best.png", "best.jpg", "/proc/b.png"]))
def test_plan_takes_any_flags(devices, global_batch, samples, cut_window, max_microbatches, pp, recompute, owners,
                              out, gantt):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        args = ["plan", "--storage", f"sqlite:///{folder / 'study.db'}", "--trials", "4", "--no-progress", "--json",
                "--devices", str(devices), "--samples", str(samples), "--cut-window", str(cut_window),
                "--max-microbatches", str(max_microbatches), "--recompute", recompute, "--owners", owners,
                "--out", out if out.startswith("/") else str(folder / out)]
        args += ["--global-batch", str(global_batch)] if global_batch is not None else []
        args += ["--pp", pp] if pp is not None else []
        args += ["--gantt", gantt if gantt.startswith("/") else str(folder / gantt)] if gantt else []
        check(cli(*args), folder, {"study.db"})  # the study holds the trials of a search that ran


# ------------------------------------------------------------------- show, export, run's pre-flight


@pytest.fixture(scope="module")
def plan_record(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-plan")
    assert main(["plan", "--devices", "4", "--global-batch", "8", "--samples", "1", "--trials", "6", "--no-progress",
                 "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(folder / "plan.json")]) == 0
    return json.loads((folder / "plan.json").read_text())


class _Launched(Exception):
    """Raised by the stub launcher: the run's pre-flight checks all passed."""


def _no_launch(*args, **kwargs):
    raise _Launched


@settings(FAST, max_examples=100 * SCALE)
@given(data=st.data(), command=st.sampled_from(["show", "export", "run", "bench"]),
       content=st.sampled_from(["mutated", "mutated", "mutated", "tree", "bytes"]),
       out=st.sampled_from([None, "out.csv", "out.toml", "out.png", "/proc/x.json", "."]))
def test_show_export_and_run_take_any_plan_file(plan_record, monkeypatch_module, data, command, content, out):
    if content == "mutated":
        plan = _mutated(plan_record, data.draw)
    else:
        plan = data.draw(trees if content == "tree" else st.binary(max_size=300))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = write_input(folder, "plan.json", plan)
        target = None if out is None else (out if out.startswith("/") else str(folder / out))
        if command == "show":
            args = ["show", path, "--json"] + (["--gantt", target] if target else [])
        elif command == "export":
            fmt = data.draw(st.sampled_from(["torch-csv", "torchtitan", "torchtitan-0.3", "megatron", "hyper-parallel",
                                             "mindspeed-mm", "nope"]))
            args = ["export", path, "--to", fmt] + (["--out", target] if target else [])
            args += ["--plan", data.draw(st.sampled_from(["megatron", "vpp", "best", "megatron@own", "nope"]))] \
                if data.draw(st.booleans()) else []
        elif command == "run":
            args = ["run", path, "--compute", "emulated", "--steps", str(data.draw(st.sampled_from([1, 0, -1])))]
            args += ["--trace", target] if target else []
        else:
            args = ["bench", path, "--compute", "emulated", "--rounds", "1", "--steps", "1"]
            args += ["--plans", data.draw(st.sampled_from(["best,megatron", "nope", ","]))] if data.draw(st.booleans()) else []
        try:
            result = cli(*args)
        except _Launched:
            return  # every check passed: the ranks would start now
        check(result, folder, {"plan.json"})


@pytest.fixture(scope="module")
def monkeypatch_module():
    pytest.importorskip("torch")  # run and bench check for torch before they launch
    with pytest.MonkeyPatch.context() as patch:
        from mpipe_tune.runtime import launch

        patch.setattr(launch, "launch_local", _no_launch)
        patch.setattr(launch, "run_under_torchrun", _no_launch)
        yield patch


# ------------------------------------------------------------------------------- the console script


def test_the_console_script_on_a_random_file_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(b"\xff\xfe" + bytes(range(256)))
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "predict", "--model", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
