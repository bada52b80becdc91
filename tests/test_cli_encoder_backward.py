"""``--encoder-backward`` on predict and plan: placements by name, ``search`` for the fastest, one-line errors."""

import json

import pytest

from mpipe_tune.cli import main

REAL = ["--model", "qwen2vl-vit-llama3-8b", "--profile", "h100-sxm", "--pp", "4", "--microbatches", "8"]


def _predict(capsys, *args):
    assert main(["predict", *REAL, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_places_the_encoder_backwards_and_search_keeps_the_fastest(capsys):
    times = {p: _predict(capsys, "--encoder-backward", p) for p in ("cooldown", "earliest", "optimised")}
    assert times["cooldown"]["encoder_backward"] == "cooldown" and times["cooldown"]["encoder_backward_slots"] is None
    assert len(times["optimised"]["encoder_backward_slots"]) == 8
    best = _predict(capsys, "--encoder-backward", "search")
    assert best["makespan_s"] == min(r["makespan_s"] for r in times.values())
    assert best["encoder_backward"] == min(times, key=lambda p: times[p]["makespan_s"])


def test_a_placement_without_a_transpose_region_is_a_one_line_error(capsys):
    code = main(["predict", "--schedule", "1f1b", "--cut", "", "--encoder-backward", "earliest"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no transpose region" in err[0] and "use cooldown" in err[0]


def test_plan_searches_the_placement_and_writes_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "qwen2vl-vit-llama3-8b", "--profile", "h100-sxm", "--devices", "4",
                 "--global-batch", "8", "--samples", "1", "--pp", "4", "--tp", "1", "--skeletons", "1f1b",
                 "--max-chunks", "1", "--owners", "round-robin", "--recompute", "on", "--encoder-backward", "search",
                 "--exhaustive",
                 "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--out", str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["candidate"]["encoder_backward"] in ("cooldown", "earliest", "optimised")
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["makespan_s"] == pytest.approx(shown["recorded_makespan_s"], rel=1e-12)
