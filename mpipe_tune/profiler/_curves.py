"""Least-squares fits of the cost model's efficiency curves by kernel shape to measured efficiencies.

The cost model evaluates fixed forms (the profile's ``kernel_efficiency`` table,
:mod:`mpipe_tune.cost._kernel_model`); the profiler measures efficiencies (achieved FLOP/s or bytes/s
over the profile's roofline) on a sweep of shapes and fits the forms' parameters here. Pure numpy; no torch.

- GEMM ``(m, n, k)``: ``eff = max * wave(m, n) * s(m) * s(n) * s(k)`` with ``s(x) = x / (x + half_dim)``,
  ``wave = tiles / (ceil(tiles / units) * units)`` and ``tiles = ceil(m / tile_m) * ceil(n / tile_n)``.
- Attention core of ``L`` tokens: ``eff = max * L / (L + half_seq)``.
- Memory-bound kernel moving ``b`` bytes: ``eff = max * b / (b + half_bytes)``.

The fits minimise the squared error of ``log(eff)`` (equivalently of ``log(time)``: every point weighs
by its relative error, a 16-token GEMM as much as a 4,096-token one), with ``max <= 1`` as the profile
schema requires (a copy that fits in a CPU cache runs above the memory bandwidth, which no curve of this
form with ``max <= 1`` follows: its fit says so). For a fixed half-size the best ``log(max)`` is the mean
residual, clamped at 0 (closed form), so only the half-size is searched (a logarithmic grid,
then finer ones around its best), and for GEMM each ``(tile_m, tile_n)`` of a candidate list, and
``units`` where the device does not say it. ``fit_r2`` is the R^2 of ``log(time)``, as the links'
entries state theirs; ``fit_r2_efficiency`` the stricter R^2 of ``log(eff)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mpipe_tune.cost import AttentionCurve, GemmCurve, MemoryCurve

TILE_CANDIDATES = (16, 32, 64, 128, 256)
"""Output tile sides a GEMM fit tries for ``tile_m`` and ``tile_n``."""
UNIT_CANDIDATES = (1, 2, 4, 8, 16, 20, 24, 30, 32, 48, 64, 80, 96, 108, 114, 120, 128, 132, 144, 160, 192, 256)
"""Compute-unit counts a GEMM fit tries where the device does not report its own."""
_HALF_GRID = np.geomspace(1e-3, 1e9, 1201)


def saturation(x, half):
    """``x / (x + half)`` (element-wise, ``half`` may be a column of candidates): the fits' roll-off."""
    x = np.asarray(x, dtype=float)
    return x / (x + half)


def wave_quantisation(m, n, *, tile_m: int, tile_n: int, units: int):
    """The share of ``units`` busy on average over the waves of an ``m x n`` output cut into tiles: the
    GEMM curve without its roll-off.

    >>> float(wave_quantisation(256, 256, tile_m=128, tile_n=128, units=4))  # 4 tiles, one full wave
    1.0
    >>> float(wave_quantisation(128 * 133, 128, tile_m=128, tile_n=128, units=132))  # 133 tiles: 2 waves
    0.5037878787878788
    """
    return GemmCurve(1.0, 0.0, tile_m, tile_n, units).efficiency(m, n, 1)


@dataclass(frozen=True)
class CurveFit:
    """A fitted curve and how well it follows the points it was fitted to."""

    curve: GemmCurve | AttentionCurve | MemoryCurve
    fit_r2: float
    """R^2 of ``log(time)`` (the links' measure)."""
    fit_r2_efficiency: float
    """R^2 of ``log(eff)``: what the shape explains of the efficiency's own spread."""
    rms_relative_error: float
    """Root mean square of ``(predicted - measured) / measured`` time over the points."""
    predicted: tuple[float, ...]
    """The curve's efficiency at each point."""


def fit_saturation(curve_type: type[AttentionCurve] | type[MemoryCurve], sizes: Sequence[float],
                   efficiencies: Sequence[float], work: Sequence[float] | None = None) -> CurveFit:
    """``max * x / (x + half)`` (an :class:`AttentionCurve` by sequence length or a :class:`MemoryCurve` by
    bytes) fitted to measured efficiencies at ``sizes`` (log least squares); ``work`` is each point's FLOPs
    or bytes (default: the size) for the R^2 of ``log(time)``.

    >>> f = fit_saturation(AttentionCurve, [64, 256, 1024, 4096], [0.6 * x / (x + 512) for x in (64, 256, 1024, 4096)])
    >>> round(f.curve.max, 4), round(f.curve.half_seq, 2), round(f.rms_relative_error, 6)
    (0.6, 512.0, 0.0)
    """
    x = np.asarray(sizes, dtype=float)
    eff = _checked(x, efficiencies)
    log_max, half = _fit_half(np.log(eff), lambda h: np.log(saturation(x, h)))
    curve = curve_type(float(np.exp(log_max)), half)
    return _result(curve, eff, np.asarray(curve.efficiency(x)), x if work is None else np.asarray(work, dtype=float))


def fit_gemm(shapes: Sequence[tuple[int, int, int]], efficiencies: Sequence[float], *,
             units: int | None = None, tiles: Sequence[int] = TILE_CANDIDATES) -> CurveFit:
    """The GEMM curve fitted to measured efficiencies of ``(m, n, k)`` shapes; ``units`` as the device
    reports it, or fitted from :data:`UNIT_CANDIDATES` where it is None. Among fits equally good (no
    shape tells two tile sides apart) the first candidate wins."""
    mnk = np.asarray(shapes, dtype=float)
    assert mnk.ndim == 2 and mnk.shape[1] == 3 and np.all(mnk >= 1), mnk.shape
    eff = _checked(mnk[:, 0], efficiencies)
    log_eff = np.log(eff)
    m, n, k = mnk.T
    best: tuple[float, GemmCurve] | None = None
    for units_tried in ((units,) if units is not None else UNIT_CANDIDATES):
        for tile_m in tiles:
            for tile_n in tiles:
                log_wave = np.log(wave_quantisation(m, n, tile_m=tile_m, tile_n=tile_n, units=units_tried))

                def shape(h, log_wave=log_wave):
                    return log_wave + np.log(saturation(m, h) * saturation(n, h) * saturation(k, h))

                log_max, half = _fit_half(log_eff, shape)
                sse = float(np.sum((log_eff - log_max - shape(half)) ** 2))
                if best is None or sse < best[0] * (1 - 1e-9):
                    best = (sse, GemmCurve(float(np.exp(log_max)), half, tile_m, tile_n, units_tried))
    assert best is not None
    return _result(best[1], eff, best[1].efficiency(m, n, k), m * n * k)


def _checked(x: np.ndarray, efficiencies: Sequence[float]) -> np.ndarray:
    eff = np.asarray(efficiencies, dtype=float)
    assert eff.shape == x.shape and len(eff) >= 2 and np.all(eff > 0) and np.all(np.isfinite(eff)), eff
    return eff


def _fit_half(log_eff: np.ndarray, log_shape: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float]:
    """``(log_max, half)`` minimising ``sum((log_eff - log_max - log_shape(half))^2)`` with ``log_max <= 0``:
    the half-size on a logarithmic grid, refined three times around the best; ``log_max`` the mean residual
    for it, or 0 where that is above (the error is a parabola in ``log_max``: its clamp is the constrained
    optimum). ``log_shape`` takes a column of half-sizes and gives one row of the points' log-shape per one."""
    grid = _HALF_GRID
    for _ in range(4):
        residual = log_eff[None, :] - log_shape(grid[:, None])
        log_max = np.minimum(residual.mean(axis=1), 0.0)
        errors = np.sum((residual - log_max[:, None]) ** 2, axis=1)
        best = int(np.argmin(errors))
        refined = np.geomspace(grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)], 41)
        chosen = (float(log_max[best]), float(grid[best]), float(errors[best]))
        grid = refined
    return chosen[0], chosen[1]


def _result(curve, eff: np.ndarray, predicted: np.ndarray, work: np.ndarray) -> CurveFit:
    # time ~ work / eff: the log-time residuals are the log-efficiency ones with the sign turned
    log_work = np.log(work)
    relative = eff / predicted - 1  # (predicted time - measured time) / measured time
    return CurveFit(curve, _r2(log_work - np.log(eff), log_work - np.log(predicted)),
                    _r2(np.log(eff), np.log(predicted)), float(np.sqrt(np.mean(relative**2))),
                    tuple(float(p) for p in predicted))


def _r2(measured: np.ndarray, predicted: np.ndarray) -> float:
    total = float(np.sum((measured - measured.mean()) ** 2))
    residual = float(np.sum((measured - predicted) ** 2))
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
