"""Issue 41's classes of hostile input, one case or more each, through the console entry point: exit 2, one line
on stderr of under 400 characters naming what is wrong, no traceback, nothing written, within 10 s (a subprocess
timeout: a guard against a hang, not a timing goal). The classes: sizes nothing bounded, nesting, files that are
not files, JSON types and duplicate columns, torchrun's environment, and error lines of unbounded length.

The 10 s are CPU seconds (``RLIMIT_CPU``: the kernel stops a command that computes longer), so that they hold on a
machine whose load stretches wall time five-fold; a wall-clock timeout of :data:`WALL_GUARD_S` catches a command
that blocks without computing (a FIFO opened for reading)."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from mpipe_tune.cli._parser import MAX_ERROR_CHARS
from mpipe_tune.inputs._workload import image_tokens_for

ROOT = Path(__file__).parents[1]
CLI = [sys.executable, "-m", "mpipe_tune.cli"]
CPU_LIMIT_S = 10
WALL_GUARD_S = 120
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def png(path: Path, width: int, height: int) -> None:
    """A PNG of that size, header only (what a reader of sizes opens)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def conversations(*images: str) -> list:
    return [{"images": list(images), "conversations": [{"from": "human", "value": "hi"}]}]


MINDSPEED = {"text_decoder": {"pipeline_num_layers": [14, 14]}}


def _case(name: str, folder: Path) -> tuple[list[str], dict[str, str], str]:
    """(arguments, extra environment, what the line must say) of case ``name``, its files written in ``folder``."""
    f = folder
    plan = ["plan", "--devices", "4", "--global-batch", "8", "--out", str(f / "plan.json")]
    predict = ["predict", "--gantt", str(f / "g.png")]
    if name == "manifest num_images 1e12":
        (f / "d.csv").write_text("text_tokens,num_images,image_tokens\n10,1000000000000,5\n")
        return [*predict, "--workload", str(f / "d.csv")], {}, "num_images"
    if name == "manifest 1e12 tokens":
        (f / "d.csv").write_text("text_tokens,image_tokens\n1000000000000,5\n")
        return [*predict, "--workload", str(f / "d.csv")], {}, "text_tokens"
    if name == "workload file 1e12 tokens":
        (f / "w.json").write_text(json.dumps({"microbatches": [{"image_tokens": 0, "text_tokens": 10**12}]}))
        return [*predict, "--workload", str(f / "w.json")], {}, "text_tokens"
    if name == "1e8 microbatches from a dataset":
        (f / "d.csv").write_text("text_tokens,image_tokens\n100,50\n200,60\n")
        return [*predict, "--workload", str(f / "d.csv"), "--microbatches", "100000000"], {}, "microbatch count"
    if name == "repeat 1e9":
        (f / "m.yaml").write_text("name: m\nlayers:\n  - {name: l, block: llm, repeat: 1000000000, "
                                  "fwd_s_per_token: 1.0e-6, bwd_s_per_token: 2.0e-6}\n")
        return [*predict, "--model", str(f / "m.yaml")], {}, "repeat"
    if name == "100,000 stages":
        (f / "model.json").write_text(json.dumps({"text_decoder": {"pipeline_num_layers": [1] * 100000}}))
        return [*plan, "--current", str(f / "model.json")], {}, "(100000 items)"
    if name == "100,000 stages, one negative":
        (f / "model.json").write_text(json.dumps({"text_decoder": {"pipeline_num_layers": [1] * 4000 + [-1]}}))
        return [*plan, "--current", str(f / "model.json")], {}, "(4001 items)"
    if name == "600 factors in $((...))":
        (f / "model.json").write_text(json.dumps(MINDSPEED))
        (f / "run.sh").write_text("TP=$((" + "*".join(["99999999"] * 600) + "))\nA=\"--tensor-model-parallel-size $TP "
                                  "--pipeline-model-parallel-size 2\"\n")
        return [*plan, "--current", str(f / "model.json"), "--current-args", str(f / "run.sh")], {}, "$TP"
    if name == "100,000-deep JSON dataset":
        (f / "d.json").write_text("[" * 100000 + "]" * 100000)
        return [*predict, "--workload", str(f / "d.json")], {}, "nests deeper"
    if name == "100,000-deep model.json":
        (f / "model.json").write_text('{"text_decoder": ' + "[" * 100000 + "]" * 100000 + "}")
        return [*plan, "--current", str(f / "model.json")], {}, "nests deeper"
    if name == "100,000-deep JSON model":
        (f / "m.json").write_text('{"name": "m", "layers": ' + "[" * 100000 + "]" * 100000 + "}")
        return [*predict, "--workload", str(f / "m.json")], {}, "nests deeper"
    if name == "100,000-deep HF config.json":
        config = json.loads((ROOT / "tests" / "fixtures" / "hf" / "Qwen2-VL-7B-Instruct" / "config.json").read_text())
        text = json.dumps({**config, "vision_config": None}).replace('"vision_config": null', '"vision_config": '
                                                                     + "[" * 100000 + "]" * 100000)
        (f / "config.json").write_text(text)
        return [*predict, "--model", str(f / "config.json")], {}, "nests deeper"
    if name == "$((1+1+...)) 100,000 terms":
        (f / "model.json").write_text(json.dumps(MINDSPEED))
        (f / "run.sh").write_text("TP=$((" + "+".join(["1"] * 100000) + "))\nA=\"--tensor-model-parallel-size $TP\"\n")
        return [*plan, "--current", str(f / "model.json"), "--current-args", str(f / "run.sh")], {}, "$TP"
    if name == "image a FIFO":
        os.mkfifo(f / "fifo.png")
        (f / "d.json").write_text(json.dumps(conversations("fifo.png")))
        return [*predict, "--workload", str(f / "d.json")], {}, "is a FIFO"
    if name == "image path with a NUL byte":
        (f / "d.json").write_text(json.dumps(conversations("a\x00b.png")))
        return [*predict, "--workload", str(f / "d.json")], {}, "NUL byte"
    if name == "dataset a symlink loop":
        os.symlink(f / "d.jsonl", f / "d.jsonl")
        return [*predict, "--workload", str(f / "d.jsonl")], {}, "symlink loop"
    if name == "image folder a symlink loop":
        png(f / "i.png", 64, 64)
        (f / "d.json").write_text(json.dumps(conversations("i.png")))
        os.symlink(f / "loop", f / "loop")
        return [*predict, "--workload", str(f / "d.json"), "--image-folder", str(f / "loop")], {}, "symlink loop"
    if name == "model file a device":
        os.symlink("/dev/zero", f / "m.yaml")
        return [*predict, "--model", str(f / "m.yaml")], {}, "is a device"
    if name == "workload file a FIFO":
        os.mkfifo(f / "w.yaml")
        return [*predict, "--workload", str(f / "w.yaml")], {}, "is a FIFO"
    if name in ("text part 5", "text part null"):
        text = 5 if name.endswith("5") else None
        (f / "d.json").write_text(json.dumps([{"messages": [{"role": "user", "content": [
            {"type": "text", "text": text}]}]}]))
        return [*predict, "--workload", str(f / "d.json")], {}, "not a string"
    if name == "duplicate CSV column":
        (f / "d.csv").write_text("text_tokens,text_tokens,image_tokens\n100,5,50\n")
        return [*predict, "--workload", str(f / "d.csv")], {}, "appears more than once"
    if name == "duplicate Parquet column":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_arrays([pa.array([100]), pa.array([5]), pa.array([50])],
                                            names=["text_tokens", "text_tokens", "image_tokens"]), f / "d.parquet")
        return [*predict, "--workload", str(f / "d.parquet")], {}, "appears more than once"
    if name == "duplicate JSONL key":
        (f / "d.jsonl").write_text('{"text_tokens": 100, "text_tokens": 5, "image_tokens": 50}\n')
        return [*predict, "--workload", str(f / "d.jsonl")], {}, "appears more than once"
    if name == "launch flag ²":
        (f / "model.json").write_text(json.dumps(MINDSPEED))
        return [*plan, "--current", str(f / "model.json"), "--current-args", "--tensor-model-parallel-size \u00b2"], {}, \
            "at most 9 digits"
    if name == "num_layers a string":
        (f / "model.json").write_text(json.dumps({"text_decoder": {"pipeline_num_layers": [14, 14], "num_layers": "28"}}))
        return [*plan, "--current", str(f / "model.json")], {}, "must be an integer"
    if name == "GROUP_RANK 1 on a one-node world":
        env = {**TORCHRUN, "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
        return ["profile", "--device", "cpu", "--compute", "ideal", "--out", str(f / "p.json")], env, "inconsistent"
    if name == "node rank beyond GROUP_WORLD_SIZE":
        env = {**TORCHRUN, "RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "1"}
        return ["profile", "--device", "cpu", "--compute", "ideal", "--out", str(f / "p.json")], env, "inconsistent"
    raise AssertionError(name)


CASES = ["manifest num_images 1e12", "manifest 1e12 tokens", "workload file 1e12 tokens",
         "1e8 microbatches from a dataset", "repeat 1e9", "100,000 stages", "100,000 stages, one negative",
         "600 factors in $((...))", "100,000-deep JSON dataset", "100,000-deep model.json", "100,000-deep JSON model",
         "100,000-deep HF config.json", "$((1+1+...)) 100,000 terms", "image a FIFO", "image path with a NUL byte", "dataset a symlink loop",
         "image folder a symlink loop", "model file a device", "workload file a FIFO", "text part 5", "text part null",
         "duplicate CSV column", "duplicate Parquet column", "duplicate JSONL key", "launch flag ²",
         "num_layers a string", "GROUP_RANK 1 on a one-node world", "node rank beyond GROUP_WORLD_SIZE"]


@pytest.mark.parametrize("name", CASES)
def test_each_hostile_input_is_one_short_line_with_nothing_written(tmp_path, name):
    args, env, says = _case(name, tmp_path)
    before = {p.name for p in tmp_path.iterdir()}
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=WALL_GUARD_S, cwd=tmp_path,
                          env={**{k: v for k, v in os.environ.items() if k not in TORCHRUN}, **env},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT_S, CPU_LIMIT_S + 1)))
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and len(lines[0]) <= MAX_ERROR_CHARS and says in lines[0], lines
    assert {p.name for p in tmp_path.iterdir()} == before


def test_an_image_header_of_100000_px_a_side_is_planned_with_the_model_s_resize(tmp_path):
    """Pillow's decompression-bomb guard refused it; no pixel is decoded, so its size is read and resized."""
    png(tmp_path / "big.png", 100000, 100000)
    (tmp_path / "d.json").write_text(json.dumps(conversations("big.png")))
    done = subprocess.run([*CLI, "workload", str(tmp_path / "d.json"), "--json"], capture_output=True, text=True,
                          timeout=60)  # a hang guard
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    tokens = json.loads(done.stdout)["quantities"]["tokens per image"]
    assert tokens["p0"] == tokens["p100"] == image_tokens_for(100000, 100000) == 1225  # resized within max_pixels
