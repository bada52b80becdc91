"""Issue 37, item 7: predict, plan and the report say whether compute, memory traffic, host issue or
communication bounds each rank's step."""

import json

import pytest

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost._bound_by import BOUNDS, bound_text, rank_bounds
from mpipe_tune.cost import Framework, predict, load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload
from mpipe_tune.report import prediction_record, print_prediction
from mpipe_tune.search import format_rows


def _predict(model, tokens, *, pp=2, tp=1, mode="eager", profile="h100-sxm"):
    workload = Workload(tuple(Microbatch(0, tokens) for _ in range(4)), f"4 x {tokens}")
    c = Candidate("1f1b", (), pp=pp, tp=tp, num_microbatches=4)
    return predict(c, load_model(model), workload, load_profile(profile), Framework(kernel_mode=mode))


def test_a_tiny_model_on_short_sequences_is_host_bound_and_a_large_one_on_long_ones_compute_bound():
    small = rank_bounds(_predict("tiny-vit-llm", 64))
    large = rank_bounds(_predict("llama3-8b", 8192))
    assert [b.bound for b in small] == ["host", "host"]
    assert [b.bound for b in large] == ["compute", "compute"]
    assert all(0.5 < b.share <= 1 for b in (*small, *large))


def test_a_rank_s_seconds_by_bound_add_up_to_its_busy_time():
    prediction = _predict("tiny-vit-llm", 256, tp=2)
    for bound, busy in zip(rank_bounds(prediction), prediction.timeline.busy_s):
        assert sum(bound.seconds) == pytest.approx(busy, rel=1e-9)
        assert bound.seconds[BOUNDS.index("communication")] > 0  # tensor-parallel all-reduces and transfers


def test_a_profile_without_host_costs_never_says_host():
    bounds = rank_bounds(_predict("tiny-vit-llm", 64, profile="ideal"))
    assert all(b.bound != "host" for b in bounds)


def test_predict_prints_and_records_the_bound_of_each_rank(capsys):
    prediction = _predict("tiny-vit-llm", 64)
    record = prediction_record(prediction, load_model("tiny-vit-llm"), Workload((), "w"), load_profile("h100-sxm"))
    assert [r["bound_by"]["bound"] for r in record["ranks"]] == ["host", "host"]
    json.dumps(record)  # what --json prints
    print_prediction(record)
    out = capsys.readouterr().out
    assert "bound by" in out and out.count("host ") >= 2


def test_the_plan_table_has_a_bound_by_column():
    row = {"plan": "best", "schedule": "1f1b", "cut": [], "owners": None, "slabs": [[5, 5]], "pp": 2, "tp": 1, "dp": 1,
           "ep": 1, "cp": 1, "encoder_tp": 1, "encoder_dp": 1, "microbatches": 4, "recompute": False, "zero_stage": 1,
           "sequence_parallel": False, "step_s": 0.01, "p90_s": 0.01, "step_samples_s": [0.01], "speedup": 1.0,
           "best_speedup": 1.0, "bubble_share": 0.1, "spill_s": 0.0, "peak_bytes": 1e9, "fits_memory": True,
           "bound_by": bound_text(rank_bounds(_predict("tiny-vit-llm", 64)))}
    table = format_rows([row])
    assert "bound by" in table and "r0 host" in table and "r1 host" in table


def test_predict_takes_the_kernel_mode_and_records_it(capsys):
    from mpipe_tune.cli import main

    steps = {}
    for mode in ("graphs", "eager"):
        assert main(["predict", "--model", "tiny-vit-llm", "--profile", "h100-sxm", "--pp", "2", "--workload", "smoke",
                     "--kernel-mode", mode, "--json"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["kernel_mode"] == mode
        steps[mode] = record["makespan_s"]
    assert steps["eager"] > steps["graphs"]  # more kernels, each issued by the host


def test_an_unknown_kernel_mode_on_the_command_line_exits_2(capsys):
    from mpipe_tune.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--model", "tiny-vit-llm", "--profile", "h100-sxm", "--kernel-mode", "jit"])
    assert exit_.value.code == 2 and "--kernel-mode" in capsys.readouterr().err
