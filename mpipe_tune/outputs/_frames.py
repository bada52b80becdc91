"""Tables as data: every table the tool prints is a pandas DataFrame first, then text.

A table's frame holds one row per plan (or rank, or trial) in columns named with their unit and
valued in SI units (``step_s`` in seconds, ``peak_bytes`` in bytes, ratios and shares as plain
floats), so ``--csv`` writes it as it is. The printed table is made from the frame at print time:
each :class:`Column` says how it reads a row (milliseconds, GiB, ``pp/tp/dp`` from three columns),
and :class:`TextTable` makes every column as wide as its widest cell (never narrower than the
column's ``min_width``), so any schedule name keeps the columns aligned.

This module sits below ``search`` and ``report`` (it imports nothing of the package), so both
build their tables with it.

>>> import pandas as pd
>>> frame = pd.DataFrame({"plan": ["best", "transpose,gpipe,gpipe"], "step_s": [1.5, 0.25]})
>>> print(format_frame(frame, [Column("plan", text("plan")), Column("step ms", ms("step_s"), align=">")]))
plan                   step ms
------------------------------
best                  1500.000
transpose,gpipe,gpipe  250.000
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

Cell = Callable[[pd.Series], str]
"""The text of one cell, read off the row."""

MISSING = "-"
"""The text of a cell whose value is missing (None or NaN)."""


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def text(key: str, fmt: str = "", *, suffix: str = "", scale: float = 1.0) -> Cell:
    """A cell showing ``row[key]`` times ``scale``, formatted with ``fmt`` (``-`` when missing)."""
    def cell(row: pd.Series) -> str:
        value = row[key]
        if is_missing(value):
            return MISSING
        return format(value * scale if scale != 1.0 else value, fmt) + suffix
    return cell


def ms(key: str, fmt: str = ".3f") -> Cell:
    """Seconds shown as milliseconds."""
    return text(key, fmt, scale=1e3)


def gib(key: str, fmt: str = ".2f") -> Cell:
    """Bytes shown as GiB."""
    return text(key, fmt, scale=2.0**-30)


@dataclass(frozen=True)
class Column:
    header: str
    """The printed column's header (with the printed unit: ``step ms``)."""
    cell: Cell
    """The text of a row's cell."""
    align: str = "<"
    """``<`` (left) or ``>`` (right)."""
    min_width: int = 0
    """The narrowest the column gets (the header's width at least)."""


@dataclass(frozen=True)
class TextTable:
    """Columns with their widths, fitted to one frame's cells."""

    columns: tuple[Column, ...]
    widths: tuple[int, ...]

    @classmethod
    def fit(cls, frame: pd.DataFrame, columns: Sequence[Column]) -> TextTable:
        rows = [row for _, row in frame.iterrows()]
        widths = tuple(max([c.min_width, len(c.header), *(len(c.cell(r)) for r in rows)]) for c in columns)
        return cls(tuple(columns), widths)

    def pad(self, index: int, value: str) -> str:
        """``value`` aligned in column ``index``."""
        return format(value, f"{self.columns[index].align}{self.widths[index]}")

    def _join(self, cells: Sequence[str]) -> str:
        return " ".join(self.pad(i, c) for i, c in enumerate(cells)).rstrip()

    @property
    def header(self) -> str:
        return self._join([c.header for c in self.columns])

    @property
    def rule(self) -> str:
        return "-" * (sum(self.widths) + len(self.widths) - 1)

    def line(self, row: pd.Series) -> str:
        return self._join([c.cell(row) for c in self.columns])

    def lines(self, frame: pd.DataFrame) -> list[str]:
        """The header, a rule, and one line per row."""
        return [self.header, self.rule, *(self.line(row) for _, row in frame.iterrows())]


def format_frame(frame: pd.DataFrame, columns: Sequence[Column]) -> str:
    """``frame`` as a fixed-width text table: header, rule, one line per row."""
    return "\n".join(TextTable.fit(frame, columns).lines(frame))


def format_markdown(frame: pd.DataFrame, columns: Sequence[Column]) -> str:
    """``frame`` as a Markdown table (a ``>`` column is right-aligned)."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---:" if c.align == ">" else "---" for c in columns) + "|"]
    lines += ["| " + " | ".join(c.cell(row) for c in columns) + " |" for _, row in frame.iterrows()]
    return "\n".join(lines)


def to_csv_text(frame: pd.DataFrame) -> str:
    """The frame as CSV text, one row per line: list and dict cells as JSON (``[7, 17]``), a missing
    value as an empty field, floats at full precision (``pandas.read_csv`` reads them back)."""
    def encode(value: Any) -> Any:
        return json.dumps(value) if isinstance(value, (list, tuple, dict)) else value

    return frame.apply(lambda column: column.map(encode)).to_csv(index=False)
