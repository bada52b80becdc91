"""Datasets given to the CLI: `workload` prints and draws their distribution; plan and predict sample them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from mpipe_tune.cli import main
from mpipe_tune.inputs import DatasetDraw
from mpipe_tune.inputs._workload import image_tokens_for
from mpipe_tune.plan_file import read_plan

LLAVA = Path(__file__).parent / "fixtures" / "llava" / "llava-mini.json"
FIXTURE_IMAGES = {image_tokens_for(h, w) for h, w in ((480, 640), (768, 1024), (1100, 850), (224, 224), (1080, 1920))}


def test_workload_prints_the_percentiles_and_draws_them(tmp_path, capsys):
    picture = tmp_path / "hist.png"
    assert main(["workload", str(LLAVA), "--model", "qwen2vl-vit-qwen2-7b", "--plot", str(picture), "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["records"] == 6 and record["images"] == 6
    images = record["quantities"]["images per sample"]
    assert (images["p0"], images["p100"], images["mean"]) == (0, 2, 1.0)
    assert record["quantities"]["tokens per image"]["p100"] == max(FIXTURE_IMAGES)
    assert "4 characters per token" in err
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["workload", str(LLAVA), "--model", "qwen2vl-vit-qwen2-7b", "--chars-per-token", "3"]) == 0
    out = capsys.readouterr().out
    assert "images per sample" in out and "text tokens per sample" in out and "p90" in out


def test_workload_refuses_what_is_not_a_dataset(tmp_path, capsys):
    assert main(["workload", "balanced"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not a dataset" in err
    assert main(["workload", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "missing.json is not a file" in err
    bad = tmp_path / "m.csv"
    bad.write_text("text_tokens,image_tokens\n1,-1\n")
    assert main(["workload", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "row 0 column image_tokens" in err and "Traceback" not in err


def test_plan_on_the_llava_fixture_samples_its_records(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "qwen2vl-vit-qwen2-7b", "--profile", "h100-sxm", "--devices", "8",
                 "--workload", str(LLAVA), "--trials", "12", "--no-progress",
                 "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "workload llava-mini.json" in text
    workload = read_plan(out).best.workload
    assert isinstance(workload.draw, DatasetDraw)
    assert workload.draw.step(0, len(workload)).microbatches == workload.microbatches  # what run's later steps draw from
    assert {x for mb in workload.microbatches for x in mb.images} <= FIXTURE_IMAGES
    assert main(["show", str(out), "--json"]) == 0


def test_predict_draws_its_microbatches_from_a_packed_manifest(tmp_path, capsys):
    manifest = tmp_path / "m.parquet"
    pd.DataFrame({"text_tokens": [300, 900, 40], "num_images": [1, 0, 3],
                  "image_tokens": [256, 0, 64]}).to_parquet(manifest)
    assert main(["predict", "--workload", str(manifest), "--seq-len", "2048", "--microbatches", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["workload"].startswith("m.parquet@seed0")


def test_zero_characters_per_token_is_refused_not_read_as_the_default(capsys):
    assert main(["workload", str(LLAVA), "--model", "qwen2vl-vit-qwen2-7b", "--chars-per-token", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "characters per token (--chars-per-token) 0.0: must be" in err


def test_dataset_options_with_a_mix_or_a_workload_file_are_refused_in_one_line(tmp_path, capsys):
    """--seq-len and the other dataset options change nothing for a named mix or a workload file: a
    user who gives one expects packed sequences, so the command says so instead of ignoring it."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--seq-len", "2048", "--no-progress", "--storage", f"sqlite:///{tmp_path / 's.db'}",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not out.exists() and not (tmp_path / "s.db").exists()
    assert "packing length (--seq-len) given, but workload 'balanced' is not a dataset" in err
    workload = tmp_path / "w.yaml"
    workload.write_text("microbatches: [{image_tokens: 0, text_tokens: 64}]\n")
    assert main(["predict", "--workload", str(workload), "--chars-per-token", "3", "--image-folder", "x"]) == 2
    err = capsys.readouterr().err
    assert "characters per token (--chars-per-token) and image folder (--image-folder) given" in err
    assert main(["predict", "--workload", str(LLAVA), "--seq-len", "2048", "--json"]) == 0  # a dataset takes them


def test_a_manifest_counts_its_own_text_so_no_tokenizer_note_and_no_text_options(tmp_path, capsys):
    """A manifest's rows give text_tokens: the workload table says so and no note claims that text is counted at 4
    characters per token; --tokenizer, --chars-per-token and --image-folder would change nothing and are refused."""
    manifest = tmp_path / "m.csv"
    manifest.write_text("text_tokens,num_images,image_width,image_height\n120,1,224,224\n40,0,,\n")
    assert main(["workload", str(manifest), "--model", "small-vit-llm"]) == 0
    out, err = capsys.readouterr()
    assert "text: the manifest's text_tokens" in out and "characters per token" not in out + err
    for flags in (["--tokenizer", str(tmp_path / "t.json")], ["--chars-per-token", "3"], ["--image-folder", "x"]):
        assert main(["workload", str(manifest), *flags]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"({flags[0]}) given, but dataset {manifest} is a manifest" in err
    assert main(["predict", "--workload", str(manifest), "--seq-len", "256", "--json"]) == 0  # packing still applies
