"""The bench table is a DataFrame of seconds; its printed form fits any schedule name."""

import pytest

from mpipe_tune.report._bench import bench_frame, bench_record, format_bench

LONG = "transpose,gpipe,gpipe,gpipe"


def _summary(schedule, predicted_s, measured_s):
    return {"schedule": schedule, "pp": 2, "tp": 1, "dp": 2, "microbatches": 4, "predicted_step_s": predicted_s,
            "measured_step_s": measured_s, "step_times_s": [measured_s]}


@pytest.fixture
def record():
    summaries = [_summary("1f1b", 1.0, 1.2), _summary(LONG, 0.5, 0.8)]
    return bench_record(summaries, ["megatron", "best"], 1, plan_file="plan.json", compute="emulated", device="cpu",
                        steps=1)


def test_the_frame_holds_one_row_per_plan_in_seconds(record):
    frame = bench_frame(record)
    assert list(frame.columns) == ["plan", "schedule", "pp", "tp", "dp", "microbatches", "predicted_step_s",
                                   "measured_step_s", "ratio", "speedup_predicted", "speedup_measured"]
    assert list(frame["plan"]) == ["megatron", "best"]
    best = frame.iloc[1]
    assert (best["predicted_step_s"], best["measured_step_s"]) == (0.5, 0.8)
    assert best["speedup_predicted"] == 2.0 and best["speedup_measured"] == pytest.approx(1.5)
    assert best["ratio"] == pytest.approx(1.6)


def test_the_printed_table_keeps_its_columns_aligned_and_says_what_it_predicts(record):
    lines = format_bench(record).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("plan "))
    table = lines[header:header + 4]
    assert len(set(map(len, table))) == 1, table
    assert table[3].split()[:2] == ["best", LONG] and table[3].split()[4:6] == ["500.000", "800.000"]
    assert table[0].index("pp/tp/dp") == table[3].index("2/1/2")
    assert lines[-1].startswith("pred ms    the plan file's predicted step time")
