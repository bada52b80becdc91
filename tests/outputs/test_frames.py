"""Tables as data: columns fit their widest cell, and CSV text reads back with pandas."""

import io
import json

import pandas as pd

from mpipe_tune.outputs import Column, TextTable, format_frame, format_markdown, gib, ms, text, to_csv_text

COLUMNS = (Column("plan", text("plan"), min_width=6), Column("step ms", ms("step_s"), ">", 8),
           Column("peak GiB", gib("peak_bytes"), ">"))


def frame():
    return pd.DataFrame({"plan": ["best", "transpose,gpipe,gpipe,gpipe"], "step_s": [1.5, None],
                         "peak_bytes": [2.0**31, 2.0**30], "cut": [[7, 17], []]})


def test_each_column_is_as_wide_as_its_widest_cell_and_no_narrower_than_its_minimum():
    table = TextTable.fit(frame(), COLUMNS)
    assert table.widths == (len("transpose,gpipe,gpipe,gpipe"), 8, len("peak GiB"))
    lines = format_frame(frame(), COLUMNS).splitlines()
    assert lines == ["plan                         step ms peak GiB",
                     "---------------------------------------------",
                     "best                        1500.000     2.00",
                     "transpose,gpipe,gpipe,gpipe        -     1.00"]
    assert TextTable.fit(frame().iloc[:1], COLUMNS).widths == (6, 8, 8)


def test_markdown_aligns_right_columns():
    assert format_markdown(frame().iloc[:1], COLUMNS).splitlines() == [
        "| plan | step ms | peak GiB |", "|---|---:|---:|", "| best | 1500.000 | 2.00 |"]


def test_csv_text_reads_back_with_lists_as_json_and_missing_values_empty():
    back = pd.read_csv(io.StringIO(to_csv_text(frame())))
    assert list(back.columns) == ["plan", "step_s", "peak_bytes", "cut"]
    assert back["step_s"].iloc[0] == 1.5 and pd.isna(back["step_s"].iloc[1])
    assert list(back["peak_bytes"]) == [2.0**31, 2.0**30]
    assert [json.loads(c) for c in back["cut"]] == [[7, 17], []]
