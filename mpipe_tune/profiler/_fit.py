"""Alpha-beta fits: ``t = alpha + beta * n`` from a timing table, and back to a per-step link cost.

Pure numpy; no torch. The fit minimises the *relative* error ``sum(((t_i - a - b n_i) / t_i)^2)``, so an
8-byte message whose time is all latency weighs as much as a 16 MiB one whose time is all bandwidth (an
ordinary least-squares fit on seconds would be decided by the largest messages alone and leave alpha to
chance). Both coefficients are kept non-negative, as the profile schema requires: when the free fit
gives a negative one, the better of the two one-coefficient fits is taken instead.

``fit_r2`` is the coefficient of determination of ``log(t)``: on a sweep that spans six decades of
size it says how well the line follows the measurements at every scale, which an R^2 on raw seconds
(always close to 1, carried by the largest message) does not.

A collective's whole time over ``g`` ranks is what the profiler measures; :func:`to_link_cost` turns
the fitted line into the per-step :class:`LinkCost` that ``estimate_collective_s`` multiplies back up,
reading the step counts off ``estimate_collective_s`` itself so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpipe_tune.cost import LinkCost, estimate_collective_s


@dataclass(frozen=True)
class AlphaBetaFit:
    """The line ``time_s = alpha_s + beta_s_per_byte * size_bytes`` fitted to one timing table."""

    alpha_s: float
    beta_s_per_byte: float
    fit_r2: float
    """R^2 of ``log(time)`` (see the module docstring)."""


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> AlphaBetaFit:
    """Fit ``t = alpha + beta * n`` to one time per size, minimising relative error, both coefficients >= 0.

    >>> f = fit_alpha_beta([8, 1024, 2**20], [1e-5 + 1e-9 * n for n in (8, 1024, 2**20)])
    >>> round(f.alpha_s * 1e6, 6), round(f.beta_s_per_byte * 1e9, 6), round(f.fit_r2, 6)
    (10.0, 1.0, 1.0)
    """
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    assert n.shape == t.shape and n.ndim == 1 and len(n) >= 2, (n.shape, t.shape)
    assert np.all(n >= 0) and np.all(t > 0), "sizes must be >= 0 and times > 0"
    alpha, beta = fit_nonnegative_line(n, t, 1.0 / t)  # weights 1/t: the residuals are relative errors
    return AlphaBetaFit(alpha, beta, _log_r2(t, alpha + beta * n))


def fit_nonnegative_line(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """``(a, b)``, both >= 0, minimising ``sum((weights * (y - a - b x))^2)`` (:func:`nonnegative_fit`: the free
    least-squares fit when both come out >= 0, else the better of the one-coefficient fits).

    >>> [round(v, 9) for v in fit_nonnegative_line(np.array([1.0, 2.0, 3.0]), np.array([3.0, 5.0, 7.0]), np.ones(3))]
    [1.0, 2.0]
    >>> fit_nonnegative_line(np.array([1.0, 2.0]), np.array([-1.0, -2.0]), np.ones(2))
    (0.0, 0.0)
    """
    x = np.asarray(x, dtype=float)
    a, b = nonnegative_fit([np.ones_like(x), x], y, weights)
    return a, b


def nonnegative_fit(columns: Sequence[Sequence[float]], y: Sequence[float],
                    weights: Sequence[float] | None = None) -> tuple[float, ...]:
    """The coefficients, each >= 0, of the (``weights``-weighted) least-squares fit of ``y`` on ``columns``:
    non-negative least squares, exactly, as the best of the unconstrained fits on every subset of the columns
    whose coefficients all come out >= 0 (the columns are few); all 0 where none fits better than nothing.

    >>> [round(v, 9) for v in nonnegative_fit([[1.0, 1.0], [1.0, 3.0]], [4.0, 2.0])]  # a falling line: the mean
    [3.0, 0.0]
    """
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    a, y = np.asarray(columns, dtype=float).T * w[:, None], np.asarray(y, dtype=float) * w
    scale = np.where(np.abs(a).max(axis=0) > 0, np.abs(a).max(axis=0), 1.0)  # columns of seconds and of bytes
    best, best_residual = np.zeros(a.shape[1]), float(y @ y)
    for mask in range(1, 2 ** a.shape[1]):
        keep = [j for j in range(a.shape[1]) if mask >> j & 1]
        coef = np.linalg.lstsq(a[:, keep] / scale[keep], y, rcond=None)[0] / scale[keep]
        residual = float(np.sum((a[:, keep] @ coef - y) ** 2))
        if np.all(coef >= 0) and residual < best_residual * (1 - 1e-12):
            best, best_residual = np.zeros(a.shape[1]), residual
            best[keep] = coef
    return tuple(float(v) for v in best)


def _log_r2(measured: np.ndarray, predicted: np.ndarray) -> float:
    log_t = np.log(measured)
    log_p = np.log(np.maximum(predicted, np.finfo(float).tiny))
    total = float(np.sum((log_t - log_t.mean()) ** 2))
    residual = float(np.sum((log_t - log_p) ** 2))
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)


def step_multipliers(collective: str, group_size: int) -> tuple[float, float]:
    """``(A, B)`` with ``estimate_collective_s(link, collective, n, g) == A*alpha + B*beta*n``.

    Read off ``estimate_collective_s`` with unit links, so the profiler inverts exactly the closed forms
    the cost model uses (``all_reduce`` over 2 ranks: ``(2, 1)``; ``gather`` over 4: ``(3, 0.75)``).
    """
    assert group_size >= 2, group_size
    a = estimate_collective_s(LinkCost(1.0, 0.0), collective, 0.0, group_size)
    b = estimate_collective_s(LinkCost(0.0, 1.0), collective, 1.0, group_size)
    return a, b


def to_link_cost(fit: AlphaBetaFit, collective: str, group_size: int) -> LinkCost:
    """The per-step link cost whose ``estimate_collective_s`` over ``group_size`` reproduces ``fit``'s line."""
    a, b = step_multipliers(collective, group_size)
    return LinkCost(fit.alpha_s / a, fit.beta_s_per_byte / b)


# ----------------------------------------------------------------------------- layer efficiency


@dataclass(frozen=True)
class EfficiencyFit:
    """The efficiency that makes the roofline ``max(W / (eff * F), D / B)`` follow measured layer times."""

    efficiency: float
    rms_relative_error: float
    """Root mean square of ``(predicted - measured) / measured`` over the points, at ``efficiency``."""
    predicted_s: tuple[float, ...]


def roofline_s(flops, bytes_moved, *, efficiency: float, peak_flops_per_s: float, bytes_per_s: float):
    """The cost model's compute-event seconds: ``max(W / (eff * F), D / B)`` (element-wise on arrays)."""
    return np.maximum(np.asarray(flops, dtype=float) / (efficiency * peak_flops_per_s),
                      np.asarray(bytes_moved, dtype=float) / bytes_per_s)


def fit_efficiency(flops: Sequence[float], bytes_moved: Sequence[float], times_s: Sequence[float], *,
                   peak_flops_per_s: float, bytes_per_s: float) -> EfficiencyFit:
    """The efficiency in (0, 1] minimising the relative error of :func:`roofline_s` against ``times_s``.

    The error is not smooth in the efficiency (the max switches terms), so it is minimised on a fine
    logarithmic grid from 1e-6 to 1 (0.1% steps).

    >>> f = fit_efficiency([1e9, 4e9], [0, 0], [0.04, 0.16], peak_flops_per_s=1e11, bytes_per_s=1e10)
    >>> round(f.efficiency, 3), round(f.rms_relative_error, 3)
    (0.25, 0.0)
    """
    t = np.asarray(times_s, dtype=float)
    assert t.ndim == 1 and len(t) >= 1 and np.all(t > 0), t
    grid = np.geomspace(1e-6, 1.0, 13_817)  # ratio 1.001 between neighbours
    flops_a = np.asarray(flops, dtype=float)[None, :]
    bytes_a = np.asarray(bytes_moved, dtype=float)[None, :]
    predicted = np.maximum(flops_a / (grid[:, None] * peak_flops_per_s), bytes_a / bytes_per_s)
    errors = np.sqrt(np.mean(((predicted - t) / t) ** 2, axis=1))
    best = int(np.argmin(errors))
    return EfficiencyFit(float(grid[best]), float(errors[best]), tuple(float(p) for p in predicted[best]))
