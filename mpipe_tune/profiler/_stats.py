"""Repeat statistics: the median of a set of timings, its spread (interquartile range) and its mean."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spread:
    """Median, interquartile range and mean of repeated measurements of one quantity."""

    median: float
    iqr: float
    """Third quartile minus first quartile (0 for a single repeat)."""
    num_repeats: int
    mean: float
    """What a sum of many such calls adds up to, per call, where the median is the typical call."""


def summarize(samples: Sequence[float]) -> Spread:
    """Median and IQR (linear interpolation between order statistics) and mean of ``samples``.

    >>> summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    Spread(median=3.0, iqr=2.0, num_repeats=5, mean=22.0)
    """
    values = np.asarray(samples, dtype=float)
    assert values.ndim == 1 and len(values) >= 1, values.shape
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return Spread(float(median), float(q3 - q1), len(values), float(values.mean()))
