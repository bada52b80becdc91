"""The comparison table is a DataFrame in SI units; its printed form fits any schedule and explains itself."""

from dataclasses import replace

import pytest

from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions
from mpipe_tune.search._compare import (
    ROW_COLUMNS, comparison_frame, comparison_rows, evaluate_baselines, format_comparison, format_rows, rows_frame,
)
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

LONG = "transpose,gpipe,gpipe,gpipe"


@pytest.fixture(scope="module")
def compared():
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 4, 8, mix="balanced", num_samples=2, seed=1)
    evaluator = Evaluator(problem)
    space = SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(max_microbatches=8))
    best = evaluator.evaluate(next(c for _, c in space.enumerate() if c.pp > 1))  # every baseline exists there
    baselines = evaluate_baselines(evaluator, space, best)
    return best, baselines, comparison_rows(best, baselines)


def test_the_frame_holds_one_row_per_plan_in_seconds_and_bytes(compared):
    best, baselines, rows = compared
    frame = rows_frame(rows)
    assert tuple(frame.columns) == ROW_COLUMNS and list(frame["plan"]) == [r["plan"] for r in rows]
    evaluations = {"best": best, **{name: e for name, e in baselines if e is not None}}
    for _, r in frame.iterrows():
        e = evaluations[r["plan"]]
        assert (r["step_s"], r["p90_s"], r["peak_bytes"]) == (e.mean_s, e.p90_s, e.peak_bytes)
        assert list(r["step_samples_s"]) == list(e.makespans_s) and r["fits_memory"] == e.fits
        assert (r["pp"], r["tp"], r["dp"], r["microbatches"]) == (e.candidate.pp, e.candidate.tp, e.candidate.dp,
                                                                  e.candidate.num_microbatches)
    assert frame.loc[frame["plan"] == "megatron", "speedup"].item() == 1.0


def test_the_summary_frame_is_in_table_order(compared):
    _best, _baselines, rows = compared
    own = [{**r, "plan": f"{r['plan']}@own"} for r in rows[1:]]
    current = {**rows[1], "plan": "current"}
    frame = comparison_frame({"comparison": rows, "own_best": own, "current": current})
    assert list(frame["plan"]) == ["best", *(n for r in rows[1:] for n in (r["plan"], f"{r['plan']}@own")), "current"]


def _table(text):
    lines = text.splitlines()
    end = lines.index("") if "" in lines else len(lines)
    return lines[0], lines[1], lines[2:end]


def test_a_long_schedule_name_keeps_every_column_aligned(compared):
    _best, _baselines, rows = compared
    long = [{**rows[0], "schedule": LONG, "cut": [7, 17, 19]}, *rows[1:]]
    header, rule, lines = _table(format_rows(long))
    assert len({len(header), len(rule), *map(len, lines)}) == 1, [header, *lines]
    for name in ("cut", "owners", "pp/tp/dp"):  # left-aligned: each cell starts under its header
        start = header.index(name)
        assert all(line[start - 1] == " " and line[start] != " " for line in lines), name
    assert lines[0].split()[:3] == ["best", LONG, "7,17,19"]
    assert header.index("cut") == lines[0].index("7,17,19")
    assert format_rows(rows).splitlines()[0].index("cut") == 35  # today's width where every name fits


def test_the_table_explains_its_step_time_and_the_over_capacity_marker(compared):
    _best, _baselines, rows = compared
    over = [rows[0], {**rows[1], "fits_memory": False}, *rows[2:]]
    text = format_comparison({"comparison": over, "samples": 2})
    _, _, lines = _table(text)
    assert lines[1].split()[0] == rows[1]["plan"] and "!" in lines[1] and "!" not in lines[0]
    assert "\nstep ms    the mean predicted step time over the 2 sampled steps, p90 ms their 90th percentile" in text
    assert "\n!          after peak GiB: the plan's peak is over the device's memory capacity" in text
    assert "!          after peak GiB" not in format_comparison({"comparison": rows, "samples": 2})
    assert "the predicted step time of the one step" in format_comparison({"comparison": rows, "samples": 1})


def test_best_over_is_shown_only_for_rows_that_could_run_instead(compared):
    """A row over memory may be faster than the best plan (no recomputation, say); it is no alternative, so its
    `best over` cell is empty rather than a speedup below 1.00x."""
    _best, _baselines, rows = compared
    faster = {**rows[1], "fits_memory": False, "step_s": rows[0]["step_s"] / 2, "best_speedup": 0.5}
    header, _, lines = _table(format_comparison({"comparison": [rows[0], faster, *rows[2:]], "samples": 2}))
    column = slice(header.index("best over"), header.index("best over") + len("best over"))
    assert lines[1][column].strip() == "-" and "0.500x" not in lines[1]
    assert lines[2][column].strip() == f"{rows[2]['best_speedup']:.3f}x"


def test_at_pp_1_the_table_says_why_each_baseline_but_megatron_is_missing():
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 4, 8, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    space = SearchSpace(problem, evaluator.reference_weights(), SpaceOptions(pp=(1,), max_microbatches=8))
    best = evaluator.evaluate(next(space.enumerate())[1])
    baselines = evaluate_baselines(evaluator, space, best)
    assert [name for name, e in baselines if e is not None] == ["megatron"]
    lines = format_comparison({"comparison": comparison_rows(best, baselines), "samples": 1}).splitlines()
    assert [line.split()[0] for line in lines[2:7]] == ["best", "megatron", "disttrain", "vpp", "gpipe"]
    assert lines[4].split(maxsplit=1)[1] == "- needs pp >= 2: the encoder's own stage and the backbone's"
    assert "megatron's step holding every microbatch's activations" in lines[6]
