"""The alpha-beta fit and its inversion into per-step link costs (numpy only, no torch)."""

import doctest

import numpy as np
import pytest

from mpipe_tune.cost._profile import COLLECTIVES, LinkCost, estimate_collective_s
from mpipe_tune.profiler import (
    _calibrate as calibrate, _device as device, _fit as fit, _links as links, _stats as stats,
)
from mpipe_tune.profiler._fit import fit_alpha_beta, fit_efficiency, roofline_s, step_multipliers, to_link_cost
from mpipe_tune.profiler import summarize

SIZES = [4**k for k in range(1, 13)]  # 4 B .. 16 MiB, the CPU sweep's sizes


def noisy_medians(alpha, beta, *, noise, repeats, seed):
    """Median over repeats of alpha + beta*n with multiplicative log-normal noise of ``noise`` sigma."""
    rng = np.random.default_rng(seed)
    n = np.asarray(SIZES, dtype=float)
    samples = (alpha + beta * n)[:, None] * rng.lognormal(0.0, noise, size=(len(n), repeats))
    return np.median(samples, axis=1)


@pytest.mark.parametrize("seed", range(10))
def test_fit_recovers_known_alpha_and_beta_under_noise(seed):
    alpha, beta = 50e-6, 1 / 2e9
    f = fit_alpha_beta(SIZES, noisy_medians(alpha, beta, noise=0.05, repeats=7, seed=seed))
    assert f.alpha_s == pytest.approx(alpha, rel=0.04)
    assert f.beta_s_per_byte == pytest.approx(beta, rel=0.04)
    assert 0.99 < f.fit_r2 <= 1.0


def test_small_alpha_is_not_swamped_by_the_largest_messages():
    # 16 MiB takes 16.8 ms, 3000x alpha: a fit of raw seconds would leave alpha to the noise.
    alpha, beta = 5e-6, 1e-9
    medians = noisy_medians(alpha, beta, noise=0.03, repeats=5, seed=1)
    assert fit_alpha_beta(SIZES, medians).alpha_s == pytest.approx(alpha, rel=0.05)
    design = np.column_stack([np.ones(len(SIZES)), SIZES])
    (ols_alpha, _), *_ = np.linalg.lstsq(design, medians, rcond=None)
    assert abs(ols_alpha - alpha) > 0.5 * alpha  # the unweighted fit misses it


def test_exact_line_is_recovered_exactly_with_r2_one():
    f = fit_alpha_beta(SIZES, [2e-5 + 3e-10 * n for n in SIZES])
    assert (f.alpha_s, f.beta_s_per_byte, f.fit_r2) == pytest.approx((2e-5, 3e-10, 1.0), rel=1e-9)


def test_coefficients_stay_non_negative():
    # Pure bandwidth with a slight downward bend at small sizes: the free fit wants alpha < 0.
    times = [1e-9 * n * (0.8 if n < 100 else 1.0) for n in SIZES]
    f = fit_alpha_beta(SIZES, times)
    assert f.alpha_s == 0.0 and f.beta_s_per_byte == pytest.approx(1e-9, rel=0.1)
    # Pure latency that falls with size (noise): the free fit wants beta < 0.
    times = [1e-4 * (1.2 - 0.01 * k) for k in range(len(SIZES))]
    f = fit_alpha_beta(SIZES, times)
    assert f.beta_s_per_byte == 0.0 and f.alpha_s == pytest.approx(1e-4, rel=0.2)
    assert f.fit_r2 <= 1.0


def test_r2_falls_when_the_line_does_not_follow_the_data():
    good = fit_alpha_beta(SIZES, noisy_medians(1e-5, 1e-9, noise=0.02, repeats=5, seed=0)).fit_r2
    bent = fit_alpha_beta(SIZES, [1e-5 + 1e-13 * n**1.5 for n in SIZES]).fit_r2
    assert good > 0.99 > bent


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("group_size", [2, 3, 4, 8])
def test_link_cost_reproduces_the_measured_collective_time(collective, group_size):
    per_step = LinkCost(30e-6, 1 / 5e9)
    measured = [estimate_collective_s(per_step, collective, n, group_size) for n in SIZES]
    f = fit_alpha_beta(SIZES, measured)
    link = to_link_cost(f, collective, group_size)
    assert link.alpha_s == pytest.approx(per_step.alpha_s, rel=1e-6)
    assert link.beta_s_per_byte == pytest.approx(per_step.beta_s_per_byte, rel=1e-6)
    for n, t in zip(SIZES, measured):
        assert estimate_collective_s(link, collective, n, group_size) == pytest.approx(t, rel=1e-6)


def test_all_reduce_inversion_matches_the_ring_closed_form():
    # measured t = 2(g-1)(a + b n/g): the fitted intercept is 2(g-1)a, the slope 2(g-1)b/g.
    assert step_multipliers("all_reduce", 2) == (2.0, 1.0)
    assert step_multipliers("all_reduce", 4) == (6.0, 1.5)
    assert step_multipliers("gather", 4) == (3.0, 0.75)
    assert step_multipliers("p2p", 2) == (1.0, 1.0)
    link = to_link_cost(fit.AlphaBetaFit(6e-5, 3e-9, 1.0), "all_reduce", 4)
    assert (link.alpha_s, link.beta_s_per_byte) == pytest.approx((1e-5, 2e-9))


def test_efficiency_fit_recovers_the_compute_share_and_ignores_memory_bound_points():
    peak, bandwidth = 1e11, 1e10
    flops = np.array([1e8, 1e9, 1e10, 1e6])
    bytes_moved = np.array([1e6, 1e7, 1e8, 1e8])  # the last point is memory bound at any efficiency >= 0.001
    times = roofline_s(flops, bytes_moved, efficiency=0.3, peak_flops_per_s=peak, bytes_per_s=bandwidth)
    f = fit_efficiency(flops, bytes_moved, times, peak_flops_per_s=peak, bytes_per_s=bandwidth)
    assert f.efficiency == pytest.approx(0.3, rel=2e-3) and f.rms_relative_error < 2e-3
    # Faster than the roofline allows: the efficiency stays at its bound of 1.
    f = fit_efficiency([1e9], [0.0], [1e-3], peak_flops_per_s=peak, bytes_per_s=bandwidth)
    assert f.efficiency == 1.0 and f.rms_relative_error == pytest.approx(9.0)


def test_summarize_gives_median_and_interquartile_range():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.iqr, s.num_repeats) == (3.0, 2.0, 5)
    assert summarize([7.0]).iqr == 0.0


@pytest.mark.parametrize("module", [fit, stats, device, links, calibrate])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0
