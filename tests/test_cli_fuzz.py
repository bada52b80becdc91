"""The CLI under random input: every command ends in exit 0 or 2, with no traceback, and a failed
command leaves no output file behind (not even a temporary one). Inputs of each wave are in: dataset
workloads (conversations, manifests, tokenizers, image folders), MindSpeed-MM layouts as ``--current``,
plans with ep, cp and zero-bubble skeletons (and their exports), and ``profile`` under torchrun's
multi-node environment; and issue 41's hostile classes: sizes far past every bound (1e9 repeats, 1e12 tokens, 1e8
microbatches, 100,000-stage lists, 600-factor arithmetic), nesting 100,000 deep, paths that are FIFOs, devices,
symlink loops or hold a NUL byte, text parts and counts of every JSON type, duplicate manifest columns, and
torchrun environments whose node rank cannot fit the world. Every error is one line under 400 characters.

Files are random bytes, random JSON/YAML trees, and valid files with one field replaced or removed;
flags take random values around their limits. Commands run in-process (``mpipe_tune.cli.main``);
``run`` stops after its pre-flight checks (the launcher is replaced by a stub), and one subprocess
checks the console entry point on a random file. The example counts are fixed (not the CI
profile's) so that the whole file stays well under a minute; ``MPIPE_FUZZ_SCALE`` multiplies them.
"""

from __future__ import annotations

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
from mpipe_tune.cli._parser import MAX_ERROR_CHARS
from conftest import cli

ROOT = Path(__file__).parents[1]
FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
SCALE = int(os.environ.get("MPIPE_FUZZ_SCALE", "1"))
"""Multiplies every example count: MPIPE_FUZZ_SCALE=20 for a longer hunt on a workstation."""

KEYS = ["name", "layers", "block", "trainable", "repeat", "fwd_s_per_token", "bwd_s_per_token", "kind", "hidden",
        "heads", "ffn", "compose", "microbatches", "image_tokens", "text_tokens", "images", "schema", "schema_version",
        "candidate", "order", "predicted", "inputs", "value", "source", "peak_flops_per_s", "links"]
leaves = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=12) | st.sampled_from(["encoder", "llm", "1f1b", "bf16", "1e-6", ".inf", "", "-1", "\x00",
                                                   10**9, 10**12, 2**31, [1] * 5000]))
DEEP = {".json": b"[" * 100000 + b"]" * 100000, ".yaml": b"a: " + b"[" * 100000 + b"]" * 100000}
"""A file nesting 100,000 levels deep (past every parser's recursion limit)."""
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


def check(result: tuple[int, str, str], folder: Path, inputs: set[str]) -> int:
    """Exit 0 or 2, no traceback; on failure, one error line under 400 characters, and nothing in ``folder`` but
    the inputs."""
    code, _out, err = result
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert err.strip(), "an error exit says why"
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1 and len(errors[0]) <= MAX_ERROR_CHARS, errors
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


TINY_MOE = ROOT / "tests" / "runtime" / "tiny-mllm-mla-moe.yaml"
"""A small MoE MLLM (MLA attention, routed experts): plans with ep and cp."""
VALID_MODEL = yaml.safe_load((ROOT / "models" / "example-mllm.yaml").read_text())
VALID_PROFILE = json.loads((ROOT / "profiles" / "ideal.json").read_text())
VALID_WORKLOAD = {"microbatches": [{"image_tokens": 256 * (i % 3), "text_tokens": 1024,
                                    "images": [256] * (i % 3)} for i in range(4)]}


@st.composite
def mutated(draw, valid):
    return _mutated(valid, draw)


def file_contents(valid):
    return st.one_of(st.binary(max_size=300), trees, mutated(valid), mutated(valid), st.sampled_from(list(DEEP.values())))


# ----------------------------------------------------------------------------------- predict, derive

ints = st.one_of(st.integers(-3, 12), st.sampled_from([0, 10**10, -10**10, 2**63]))
texts = st.one_of(st.text(max_size=10), st.sampled_from(["", "1,2", "0,1,0,1", "9", "-1", "1,,2", "round-robin"]))


@settings(FAST, max_examples=100 * SCALE)
@given(command=st.sampled_from(["predict", "derive"]),
       model=st.sampled_from(["example-mllm", "tiny-vit-llm", "FILE"]), model_file=file_contents(VALID_MODEL),
       workload=st.sampled_from(["balanced", "smoke", "FILE"]), workload_file=file_contents(VALID_WORKLOAD),
       profile=st.sampled_from(["ideal", "h100-sxm", "FILE"]), profile_file=file_contents(VALID_PROFILE),
       pp=ints, microbatches=st.none() | ints, tp=ints, dp=ints, seed=ints, ep=st.none() | ints, cp=st.none() | ints,
       schedule=st.sampled_from(["transpose,1f1b", "1f1b", "1f1b,1f1b", "gpipe", "transpose", "zig", ""]),
       cut=st.none() | texts, slabs=st.none() | texts, owner=texts, frozen=st.sampled_from(["", "encoder", "vision"]),
       dtype=st.sampled_from(["bf16", "fp32", "fp7"]), gantt=st.sampled_from([None, "g.png", "g.xyz", "/proc/g.png"]))
def test_predict_and_derive_take_any_flags_and_files(command, model, model_file, workload, workload_file, profile,
                                                      profile_file, pp, microbatches, tp, dp, seed, ep, cp, schedule,
                                                      cut, slabs, owner, frozen, dtype, gantt):
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
        args += ["--ep", str(ep)] if ep is not None else []
        args += ["--cp", str(cp)] if cp is not None else []
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
       gantt=st.sampled_from([None, "best.png", "best.jpg", "/proc/b.png"]),
       model=st.sampled_from([None, None, "MOE"]), ep=st.sampled_from([None, "1", "2", "1,2", "search", "0", "x", "3"]),
       cp=st.sampled_from([None, "1", "2", "1,2", "0", "-2", "x"]),
       skeletons=st.sampled_from([None, "zb1p", "zbv", "1f1b,zb1p,zbv", "zbx", ""]),
       zero=st.sampled_from([None, "0", "search"]), sp=st.sampled_from([None, "on", "search"]))
def test_plan_takes_any_flags(devices, global_batch, samples, cut_window, max_microbatches, pp, recompute, owners,
                              out, gantt, model, ep, cp, skeletons, zero, sp):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        args = ["plan", "--storage", f"sqlite:///{folder / 'study.db'}", "--trials", "4", "--no-progress", "--json",
                "--devices", str(devices), "--samples", str(samples), "--cut-window", str(cut_window),
                "--max-microbatches", str(max_microbatches), "--recompute", recompute, "--owners", owners,
                "--out", out if out.startswith("/") else str(folder / out)]
        args += ["--global-batch", str(global_batch)] if global_batch is not None else []
        args += ["--pp", pp] if pp is not None else []
        args += ["--gantt", gantt if gantt.startswith("/") else str(folder / gantt)] if gantt else []
        args += ["--model", str(TINY_MOE)] if model else []
        for flag, value in (("--ep", ep), ("--cp", cp), ("--skeletons", skeletons), ("--zero", zero),
                            ("--sequence-parallel", sp)):
            args += [flag, value] if value is not None else []
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
        from mpipe_tune.runtime import _launch as launch

        patch.setattr(launch, "launch_local", _no_launch)
        patch.setattr(launch, "run_under_torchrun", _no_launch)
        yield patch


# ------------------------------------------------------------------------------- the console script


def test_the_console_script_on_a_random_file_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(b"\xff\xfe" + bytes(range(256)))
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "predict", "--model", str(path)],
                          capture_output=True, text=True, timeout=300)  # a hang guard
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- datasets as workloads

LLAVA = ROOT / "tests" / "fixtures" / "llava"
VALID_RECORDS = json.loads((LLAVA / "llava-mini.json").read_text())
VALID_TOKENIZER = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                   "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
                   "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "cat": 2, "the": 3},
                             "unk_token": "[UNK]"}}
MANIFEST_COLUMNS = ["text_tokens", "num_images", "image_tokens", "image_width", "image_height", "caption"]
cells = st.one_of(st.integers(-3, 5000), st.sampled_from([0, 2**40, -1, 10**12, 2**31, 16385, 2**24 + 1]),
                  st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=5), st.none())


@st.composite
def manifests(draw):
    """A manifest table: some of its columns (most often text_tokens, sometimes one twice), each cell a random
    value; a list of (column, cells) pairs."""
    columns = draw(st.lists(st.sampled_from(MANIFEST_COLUMNS), unique=True, max_size=5))
    if draw(st.booleans()) and "text_tokens" not in columns:
        columns.append("text_tokens")
    if columns and draw(st.integers(0, 4)) == 0:
        columns.append(draw(st.sampled_from(columns)))  # a duplicate column
    rows = draw(st.integers(0, 4))
    return [(c, [draw(cells) for _ in range(rows)]) for c in columns]


def write_dataset(folder: Path, form: str, data) -> str:
    """The dataset file of ``form`` (its content a mutated record list, a manifest table, or raw bytes)."""
    import pandas as pd

    name = {"conversations": "d.json", "conversations-jsonl": "d.jsonl", "csv": "d.csv", "parquet": "d.parquet",
            "manifest-jsonl": "d.jsonl"}[form]
    path = folder / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif form == "conversations":
        path.write_text(json.dumps(data))
    elif form == "conversations-jsonl":
        path.write_text("\n".join(json.dumps(r) for r in (data if isinstance(data, list) else [data])))
    elif form == "manifest-jsonl":  # a duplicate column is a repeated key
        rows = len(data[0][1]) if data else 0
        path.write_text("\n".join("{" + ", ".join(f"{json.dumps(c)}: {json.dumps(v[i])}" for c, v in data) + "}"
                                  for i in range(rows)))
    elif form == "csv":
        import csv

        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([c for c, _ in data])
            writer.writerows(zip(*(v for _, v in data)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrays = []
        for _, values in data:
            try:
                arrays.append(pa.array(values))
            except (pa.ArrowException, OverflowError):  # mixed types: as strings, as a writer would
                arrays.append(pa.array([str(v) for v in values]))
        pq.write_table(pa.Table.from_arrays(arrays, names=[c for c, _ in data]), path)
    return str(path)


@settings(FAST, max_examples=60 * SCALE)
@given(data=st.data(), form=st.sampled_from(["conversations", "conversations-jsonl", "csv", "parquet", "manifest-jsonl"]),
       command=st.sampled_from(["workload", "predict", "workload", "predict", "plan"]),
       content=st.sampled_from(["valid", "mutated", "mutated", "bytes"]),
       images=st.sampled_from(["all", "one missing", "one damaged", "folder missing", "one a FIFO", "one a loop",
                               "one a device", "folder a loop", "a NUL name", "one huge"]),
       microbatches=st.sampled_from([None, None, 10**8]),
       tokenizer=st.sampled_from([None, None, "valid", "mutated", "bytes", "missing"]),
       seq_len=st.sampled_from([None, 0, -4, 64, 4096, 10**12]), chars=st.sampled_from([None, 0.0, 3.5, -1.0, 1e300]),
       plot=st.booleans())
def test_dataset_workloads_take_any_file(data, form, command, content, images, microbatches, tokenizer, seq_len, chars,
                                         plot):
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copytree(LLAVA / "images", folder / "images")
        if images == "one missing":
            (folder / "images" / "cat-640x480.jpg").unlink()
        elif images == "one damaged":
            (folder / "images" / "chart-1024x768.png").write_bytes(data.draw(st.binary(max_size=64)))
        elif images in ("one a FIFO", "one a loop", "one a device", "one huge"):
            image = folder / "images" / "cat-640x480.jpg"
            image.unlink()
            {"one a FIFO": lambda: os.mkfifo(image), "one a loop": lambda: os.symlink(image, image),
             "one a device": lambda: os.symlink("/dev/zero", image),
             "one huge": lambda: _png_header(image, 100000, 100000)}[images]()
        elif images == "folder a loop":
            os.symlink(folder / "loop", folder / "loop")
        if content == "bytes":
            dataset = data.draw(st.binary(max_size=300) | st.sampled_from([DEEP[".json"]]))
        elif form.startswith("conversations"):
            records = VALID_RECORDS if images != "a NUL name" else [{**VALID_RECORDS[0], "image": "a\x00b.jpg"}]
            dataset = records if content == "valid" else _mutated(records, data.draw)
        else:
            valid = [("text_tokens", [100, 300]), ("image_tokens", [64, 256])]
            dataset = valid if content == "valid" else data.draw(manifests())
        path = write_dataset(folder, form, dataset)
        inputs = {p.name for p in folder.iterdir()}
        if command == "workload":
            args = [command, path]
        elif command == "predict":
            args = [command, "--workload", path, "--pp", "2", "--json"]
        else:  # a one-trial plan on the dataset: its study may stay, as a search that ran leaves it
            args = [command, "--workload", path, "--devices", "2", "--global-batch", "4", "--samples", "1", "--trials",
                    "1", "--no-progress", "--storage", f"sqlite:///{folder / 'study.db'}", "--out",
                    str(folder / "plan.json")]
            inputs.add("study.db")
        args += ["--model", "qwen2vl-vit-qwen2-7b"]
        if images == "folder missing":
            args += ["--image-folder", str(folder / "nowhere")]
        elif images == "folder a loop":
            args += ["--image-folder", str(folder / "loop")]
            inputs.add("loop")
        if microbatches is not None and command == "predict":
            args += ["--microbatches", str(microbatches)]
        if tokenizer == "missing":
            args += ["--tokenizer", str(folder / "tokenizer.json")]
        elif tokenizer is not None:
            content_ = {"valid": VALID_TOKENIZER, "mutated": _mutated(VALID_TOKENIZER, data.draw),
                        "bytes": data.draw(st.binary(max_size=200))}[tokenizer]
            args += ["--tokenizer", write_input(folder, "tokenizer.json", content_)]
            inputs.add("tokenizer.json")
        args += ["--seq-len", str(seq_len)] if seq_len is not None else []
        args += ["--chars-per-token", str(chars)] if chars is not None else []
        if plot and command == "workload":
            args += ["--plot", str(folder / "w.png")]
        check(cli(*args), folder, inputs)


def _png_header(path: Path, width: int, height: int) -> None:
    """A PNG of that size, its header only (what a reader of sizes opens)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IEND", b""))


# ----------------------------------------------------------------- a MindSpeed-MM layout as --current

VALID_MINDSPEED = {"image_encoder": {"vision_encoder": {"pipeline_num_layers": [8, 0], "num_layers": 8}},
                   "text_decoder": {"pipeline_num_layers": [4, 12], "num_layers": 16}}
"""example-mllm's layers (8 ViT, 16 decoder) as MindSpeed-MM splits them over two stages."""
LAUNCH_ARGS = ["--tensor-model-parallel-size 1 --global-batch-size 4", "--pipeline-model-parallel-size 3",
               "--virtual-pipeline-model-parallel-size 2", "--context-parallel-size 0", "--micro-batch-size x",
               "--tensor-model-parallel-size $TP", "--global-batch-size 10000000000", "", "--recompute-granularity odd",
               "--tensor-model-parallel-size \u00b2", "--pipeline-model-parallel-size \u0663", "SCRIPT", "SCRIPT"]
SCRIPT_LINES = st.sampled_from(["TP=$((" + "*".join(["99999999"] * 600) + "))", "TP=$((" + "+".join(["1"] * 100000) + "))",
                                "TP=$((" + "(" * 5000 + "1" + ")" * 5000 + "))", "GBS=$((2**4))", "TP=$((8/0))",
                                "TP=\u00b2", "GBS=$((99999999999999999999*9))"])


@settings(FAST, max_examples=10 * SCALE)
@given(data=st.data(), content=st.sampled_from(["valid", "mutated", "mutated", "mutated", "tree", "bytes", "stages"]),
       args=st.sampled_from(LAUNCH_ARGS), script=st.text(max_size=80) | SCRIPT_LINES)
def test_plan_takes_any_mindspeed_layout_as_current(data, content, args, script):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        layout = {"valid": lambda: VALID_MINDSPEED, "mutated": lambda: _mutated(VALID_MINDSPEED, data.draw),
                  "tree": lambda: data.draw(trees), "stages": lambda: {"text_decoder": {"pipeline_num_layers": (
                      [1] * data.draw(st.sampled_from([4097, 100000])))}},
                  "bytes": lambda: data.draw(st.binary(max_size=200) | st.sampled_from([DEEP[".json"]]))}[content]()
        path = write_input(folder, "model.json", layout)
        inputs = {"model.json", "study.db"}
        if args == "SCRIPT":
            (folder / "run.sh").write_text("TP=1\nGBS=4\n" + script + "\nGPT_ARGS=\"--tensor-model-parallel-size ${TP} "
                                           "--global-batch-size ${GBS}\"\n")
            args, inputs = str(folder / "run.sh"), inputs | {"run.sh"}
        check(cli("plan", "--devices", "2", "--global-batch", "4", "--samples", "1", "--pp", "2", "--trials", "1",
                  "--max-microbatches", "4", "--no-progress", "--json", "--storage", f"sqlite:///{folder / 'study.db'}",
                  "--out", str(folder / "plan.json"), "--current", path, "--current-args", args), folder, inputs)


# ----------------------------------------------------- exports of expert-, context-parallel and zero-bubble plans

FORMATS = {"torch-csv": ".csv", "torchtitan": ".toml", "torchtitan-0.3": ".args", "megatron": ".sh",
           "hyper-parallel": ".yaml", "mindspeed-mm": ".json"}


@pytest.fixture(scope="module")
def moe_plans(tmp_path_factory):
    """Plan files of a MoE MLLM at ep 2 x cp 2, one searching zb1p and one zbv (each best is a zero-bubble plan)."""
    folder = tmp_path_factory.mktemp("fuzz-moe")
    plans = {}
    for skeleton in ("zb1p", "zbv"):
        path = folder / f"{skeleton}.json"
        assert main(["plan", "--model", str(TINY_MOE), "--devices", "8", "--global-batch", "16", "--samples", "1",
                     "--pp", "2", "--tp", "1", "--cp", "2", "--ep", "2", "--skeletons", skeleton, "--trials", "8",
                     "--no-progress", "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(path)]) == 0
        plans[skeleton] = json.loads(path.read_text())
        candidate = plans[skeleton]["candidate"]
        assert skeleton in candidate["schedule"] and (candidate["ep"], candidate["cp"]) == (2, 2)
    return plans


def test_every_format_takes_every_plan_of_an_ep_cp_zero_bubble_plan_file(moe_plans, tmp_path):
    for skeleton, record in moe_plans.items():
        path = write_input(tmp_path, "plan.json", record)
        names = ["best", *(r["plan"] for r in record["search"]["comparison"] + record["search"]["own_best"])]
        for fmt, suffix in FORMATS.items():
            for name in dict.fromkeys(names):
                inputs = {p.name for p in tmp_path.iterdir()}
                code = check(cli("export", path, "--to", fmt, "--plan", name, "--out", str(tmp_path / f"x{suffix}")),
                             tmp_path, inputs)
                for written in tmp_path.glob("x*"):
                    assert code == 0, written
                    written.unlink()


@settings(FAST, max_examples=40 * SCALE)
@given(data=st.data(), skeleton=st.sampled_from(["zb1p", "zbv"]), fmt=st.sampled_from(sorted(FORMATS)),
       name=st.sampled_from(["best", "megatron", "vpp", "mpipe-rr@own", "gpipe"]))
def test_export_takes_any_damaged_ep_cp_zero_bubble_plan(moe_plans, data, skeleton, fmt, name):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = write_input(folder, "plan.json", _mutated(moe_plans[skeleton], data.draw))
        check(cli("export", path, "--to", fmt, "--plan", name, "--out", str(folder / f"x{FORMATS[fmt]}")), folder,
              {"plan.json"})


# ------------------------------------------------------------------- profile across nodes: torchrun's variables

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
env_values = st.one_of(st.sampled_from(["0", "1", "2", "-1", "", "x", "1.5", " 1", "99999999999999999999", "65536",
                                        "127.0.0.1", "localhost"]), st.text(max_size=6))


@settings(FAST, max_examples=60 * SCALE)
@given(env=st.dictionaries(st.sampled_from(TORCHRUN_ENV), st.none() | env_values, max_size=3),
       device=st.sampled_from(["cpu", "cpu", "cuda", "tpu"]),
       compute=st.sampled_from(["ideal", "ideal", "ideal", None, "nope", "FILE"]),
       calibrate=st.sampled_from([None, None, None, "tiny-vit-llm"]), out=st.sampled_from(["c.json", "c.json", "c.txt", "."]))
def test_profile_under_torchrun_takes_any_environment(monkeypatch_nodes, env, device, compute, calibrate, out):
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        folder = Path(tmp)
        for name in TORCHRUN_ENV:
            patch.delenv(name, raising=False)
        full = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        for name, value in {**full, **env}.items():  # torchrun's set with one or two replaced or left out
            if value is not None and "\x00" not in value:
                patch.setenv(name, value)
        args = ["profile", "--device", device, "--out", out if out == "." else str(folder / out)]
        if compute == "FILE":
            args += ["--compute", write_input(folder, "one-node.json", b"{")]
        elif compute is not None:
            args += ["--compute", compute]
        args += ["--calibrate", calibrate] if calibrate else []
        try:
            result = cli(*args)
        except _Launched:
            return  # every check passed: the ranks would join torchrun's world now
        check(result, folder, {"one-node.json"} if compute == "FILE" else set())


def _join_world(device, place, *args, **kwargs):
    """Stands for joining torchrun's world (env://), which the checks before it must have made safe: the address,
    and a node whose block of ranks fits the world with one rank at least on every other node."""
    port, addr = os.environ.get("MASTER_PORT", ""), os.environ.get("MASTER_ADDR", "")
    assert port.isdigit() and 1 <= int(port) <= 65535 and addr.strip() == addr != "", (addr, port)
    first = place.rank - place.local_rank
    assert place.node_rank <= first and first + place.local_world_size <= place.world_size, place
    nodes = os.environ.get("GROUP_WORLD_SIZE")
    assert nodes is None or place.node_rank < int(nodes) <= place.node_rank + 1 + place.world_size - first - place.local_world_size
    raise _Launched


@pytest.fixture(scope="module")
def monkeypatch_nodes():
    with pytest.MonkeyPatch.context() as patch:
        from mpipe_tune.profiler import _build as build, _nodes as nodes

        patch.setattr(nodes, "measure_link_classes", _join_world)
        patch.setattr(build, "profile_device", _no_launch)  # outside torchrun: the one-host sweep would start
        yield patch
