"""The per-phase layer-time fit: efficiency and fixed seconds per call from timings of a few sizes."""

import json

import numpy as np
import pytest

from mpipe_tune.profiler._calibrate import (
    MIN_SIZES_FOR_OVERHEAD, Agreement, calibration_microbatch, fit_layer_timing, repeat_until_stable, time_chains,
)
from mpipe_tune.profiler import sweep_settings
from mpipe_tune.inputs import load_model

PEAK, BANDWIDTH = 1e11, 1e10


def timings(flops, bytes_moved, eff, overhead_s):
    return overhead_s + np.maximum(np.asarray(flops) / (eff * PEAK), np.asarray(bytes_moved) / BANDWIDTH)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_efficiency_and_overhead_under_noise(seed):
    rng = np.random.default_rng(seed)
    flops = np.geomspace(1e7, 1e10, 8)  # 0.1 ms .. 0.1 s of compute at efficiency 1
    bytes_moved = flops / 100  # compute bound
    eff, overhead = rng.uniform(0.2, 0.8), rng.uniform(2e-4, 2e-3)
    times = timings(flops, bytes_moved, eff, overhead) * rng.normal(1.0, 0.01, size=flops.size)
    fit = fit_layer_timing(flops, bytes_moved, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH)
    assert fit.efficiency == pytest.approx(eff, rel=0.03)
    assert fit.overhead_s == pytest.approx(overhead, rel=0.15)
    assert fit.rms_relative_error < 0.02
    assert len(fit.predicted_s) == flops.size


def test_one_efficiency_cannot_follow_a_fixed_cost_that_the_overhead_absorbs():
    flops = [1e7, 1e8, 1e9, 1e10]
    times = timings(flops, [0] * 4, 0.5, 1e-3)
    fit = fit_layer_timing(flops, [0] * 4, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH)
    assert fit.rms_relative_error < 1e-3 and fit.overhead_s == pytest.approx(1e-3, rel=1e-2)
    from mpipe_tune.profiler import fit_efficiency

    assert fit_efficiency(flops, [0] * 4, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH).rms_relative_error > 0.2


def test_overhead_stays_zero_below_the_minimum_number_of_sizes_and_never_goes_negative():
    flops = [1e9, 4e9][: MIN_SIZES_FOR_OVERHEAD - 1]
    fit = fit_layer_timing(flops, [0, 0], timings(flops, [0, 0], 0.5, 1e-3), peak_flops_per_s=PEAK,
                           bytes_per_s=BANDWIDTH)
    assert fit.overhead_s == 0.0
    # Times that grow faster than the work (a negative intercept): the overhead is clipped at 0.
    flops = [1e9, 2e9, 4e9]
    fit = fit_layer_timing(flops, [0] * 3, [0.015, 0.04, 0.09], peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH)
    assert fit.overhead_s == 0.0 and 0 < fit.efficiency <= 1


def test_a_phase_without_flops_fits_its_overhead_over_its_byte_sizes():
    """An embedding's forward is a lookup: no FLOPs at any size, only bytes. Three sizes are three work sizes, so its
    fixed seconds per call are fitted (a CPU calibration fitted 0 and predicted 6-99 us for 0.23-0.55 ms, rms error
    64%), and the efficiency, which no point depends on, is reported as 1 (it was the grid's floor, 1e-06)."""
    flops, bytes_moved = [0.0, 0.0, 0.0], [131072.0, 524288.0, 2097152.0]
    times = timings(flops, bytes_moved, 1.0, 2.5e-4)
    fit = fit_layer_timing(flops, bytes_moved, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH)
    assert fit.overhead_s == pytest.approx(2.5e-4, rel=1e-6) and fit.rms_relative_error < 1e-9
    assert fit.efficiency == 1.0


def test_memory_bound_points_follow_the_bandwidth_plus_overhead():
    flops, bytes_moved = [1e3, 2e3, 4e3], [1e6, 1e7, 1e8]
    fit = fit_layer_timing(flops, bytes_moved, timings(flops, bytes_moved, 0.5, 5e-4), peak_flops_per_s=PEAK,
                           bytes_per_s=BANDWIDTH)
    assert fit.overhead_s == pytest.approx(5e-4, rel=1e-2) and fit.rms_relative_error < 1e-3


def test_calibration_sizes_are_rows_per_layer_call():
    model = load_model("tiny-vit-llm")  # merge factor 4
    mb = calibration_microbatch(model, 256)
    assert (mb.text_tokens, mb.image_tokens) == (256, 64)  # 256 text tokens, one image of 256 ViT patches
    assert calibration_microbatch(model, 2).image_tokens == 1
    assert calibration_microbatch(load_model("llama3-8b"), 100).image_tokens == 100  # no encoder: merge 1


@pytest.mark.parametrize("seed", range(3))
def test_fit_tells_the_per_image_calls_from_the_per_layer_call(seed):
    rng = np.random.default_rng(seed)
    flops = np.tile(np.geomspace(1e7, 1e10, 4), 2)
    images = np.repeat([1, 4], 4)  # each size once in one image, once split into four
    eff, overhead, per_image = rng.uniform(0.2, 0.8), rng.uniform(2e-4, 2e-3), rng.uniform(1e-4, 1e-3)
    times = (timings(flops, flops / 100, eff, overhead) + per_image * (images - 1)) * rng.normal(1.0, 0.005, 8)
    fit = fit_layer_timing(flops, flops / 100, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH,
                           extra_images=images - 1)
    assert fit.efficiency == pytest.approx(eff, rel=0.03)
    assert fit.overhead_s == pytest.approx(overhead, rel=0.2)
    assert fit.image_overhead_s == pytest.approx(per_image, rel=0.2)
    # without the per-image term the same points fit worse
    plain = fit_layer_timing(flops, flops / 100, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH)
    assert plain.image_overhead_s == 0.0 and plain.rms_relative_error > fit.rms_relative_error


def test_per_image_overhead_is_clipped_at_zero():
    flops = np.tile([1e9, 2e9, 4e9], 2)
    times = timings(flops, [0] * 6, 0.5, 1e-3) - 1e-4 * np.repeat([0, 3], 3)  # split images run faster
    fit = fit_layer_timing(flops, [0] * 6, times, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH,
                           extra_images=np.repeat([0, 3], 3))
    assert fit.image_overhead_s == 0.0 and fit.overhead_s > 0


def test_repeats_stop_once_the_medians_are_stable_or_at_the_maximum():
    settings = sweep_settings("cpu", quick=False)  # batches of 7 repeats, 2% tolerance, at most 35
    steady = iter(range(100))
    batches = []

    def batch(values):
        batches.append(values)
        return [list(values)]

    samples = repeat_until_stable(lambda: batch([1.0] * settings.repeats), settings, Agreement())
    assert len(samples[0]) == 2 * settings.repeats  # the second batch confirms the first's median
    batches.clear()
    samples = repeat_until_stable(lambda: batch([float(next(steady))] * settings.repeats), settings, Agreement())
    assert len(samples[0]) == settings.calibration_max_repeats  # the median keeps moving: stop at the maximum
    # a rank that is not stable yet keeps every rank going
    votes = []
    stop_when_all = Agreement(all_stop=lambda stop: votes.append(stop) or len(votes) >= 3)
    samples = repeat_until_stable(lambda: batch([1.0] * settings.repeats), settings, stop_when_all)
    assert len(samples[0]) == 3 * settings.repeats


def test_multi_image_calibration_microbatches_split_the_same_patches():
    model = load_model("tiny-vit-llm")
    one, four = calibration_microbatch(model, 256), calibration_microbatch(model, 256, images=4)
    assert four.image_tokens == one.image_tokens == 64 and four.images == (16, 16, 16, 16)
    assert calibration_microbatch(model, 4, images=4).images == (1,)  # no more images than image tokens


def test_the_sizes_are_timed_interleaved_so_a_drift_reaches_every_size_alike(monkeypatch):
    # A machine that slows down by 1% per pass: timed one size after another, the larger size would
    # see only the slow minutes; interleaved, each size's samples span the whole calibration.
    import mpipe_tune.profiler._calibrate as calibrate

    passes = []

    def chain_once(torch, timer, specs, chain, modules, mb, dtype, where, repeat, fed, fwd, bwd):
        passes.append(mb)
        slowdown = 1 + 0.01 * len(passes)
        for k in range(len(chain)):
            fwd[k].append(mb * slowdown)
            bwd[k].append(2 * mb * slowdown)

    monkeypatch.setattr(calibrate, "_chain_once", chain_once)
    settings = sweep_settings("cpu", quick=True)
    sizes = [1.0, 2.0, 4.0]
    barriers = []
    timed = time_chains(None, None, None, [0, 1], None, sizes, None, None, settings,
                        Agreement(barrier=lambda: barriers.append(1)))
    assert passes[:6] == sizes + sizes and len(barriers) == len(passes)  # every pass after a barrier
    assert [len(fwd[0]) for fwd, _, _ in timed] == [settings.calibration_max_repeats] * 3  # never stable
    means = []
    for size, (fwd, bwd, _) in zip(sizes, timed):
        assert np.allclose(np.asarray(bwd[0]), 2 * np.asarray(fwd[0]))
        means.append(float(np.mean(np.asarray(fwd[1]) / size)))
    # interleaved, the sizes' mean slowdowns are one pass (1%) apart; one size after another, they
    # would be a whole size's repeats (7 passes here) apart
    assert max(means) - min(means) == pytest.approx(0.02)


@pytest.mark.parametrize("pass_s,timed", [(0.0, (64, 256, 1024)), (0.3, (64, 256, 1024)), (5.0, (64, 256))])
def test_the_first_two_sizes_are_timed_however_slow_the_machine(monkeypatch, pass_s, timed):
    # On a loaded machine the smallest size alone can pass the limit: the fits still get two sizes,
    # so how many points a profile holds does not depend on the load. Past them, growth stops at the
    # first size over the limit (cpu: 1 s per forward plus backward).
    import mpipe_tune.profiler._calibrate as calibrate

    def chain_once(torch, timer, specs, chain, modules, mb, dtype, where, repeat, fed, fwd, bwd):
        for k in range(len(chain)):
            fwd[k].append(pass_s)
            bwd[k].append(pass_s)

    monkeypatch.setattr(calibrate, "_chain_once", chain_once)
    settings = sweep_settings("cpu", quick=False)
    assert settings.calibration_tokens == (64, 256, 1024) and calibrate.MIN_CALIBRATION_SIZES == 2
    votes = []
    agreement = Agreement(all_stop=lambda stop: votes.append(stop) or stop)
    sizes = calibrate._sizes_within_limit(None, None, load_model("tiny-vit-llm"), None, [0, 1], None, None, None,
                                          settings, agreement)
    assert tuple(sizes) == timed
    assert len(votes) == len(sizes) - 1  # every rank votes on growing only past the first two sizes


def test_ranks_calibrating_a_moe_model_also_time_its_moe_layers_with_the_experts_spread_over_each_pair():
    """Two ranks at once on a model with MoE layers: the chain whole, split over the pair, and with the MoE layers'
    routed experts spread over the pair (the runtime's all-to-all dispatch), each MoE layer at every size in both
    phases; the profile fits ``ep_overhead_s`` and ``ep_slowdown`` to those points alone, for the MoE kind alone,
    and the whole layers' fits see none of them."""
    from mpipe_tune.cost import parse_profile
    from mpipe_tune.profiler import assemble_profile
    from mpipe_tune.profiler._together import calibrate_together

    from test_profile_command import _measurements

    model = load_model("tests/runtime/tiny-mla-moe.yaml")
    points, _ = calibrate_together("cpu", 2, model, "fp32", sweep_settings("cpu", quick=True), lambda _: None)
    spread = [p for p in points if p.ep > 1]
    moe = {u.name for u in model.layers if u.cost.kind == "moe_block"}
    assert {p.layer_name for p in spread} == moe and {p.ep for p in spread} == {2} and all(p.tp == 1 for p in spread)
    whole = [p for p in points if p.tp == p.ep == 1]
    assert {(p.tokens, p.phase) for p in spread} == {(p.tokens, p.phase) for p in whole if p.layer_name in moe}
    assert all(p.seconds.mean > 0 for p in spread)
    m = _measurements()
    data = assemble_profile(type(m)(**{**m.__dict__, "layer_points": tuple(points), "calibration_model": model.name, "calibration": model,
                                      "calibration_dtype": "fp32"}), name="t", date="2026-01-01")
    entry = data["efficiency"]["moe_block"]
    assert set(entry["ep_overhead_s"]) == set(entry["ep_slowdown"]) == {"2"}
    assert len(entry["ep_calibration"]["2"]["median_s"]) == len(spread)
    assert len(entry["median_s"]) == len([p for p in whole if p.kind == "moe_block"])  # the whole layers alone
    assert all("ep_overhead_s" not in e for kind, e in data["efficiency"].items() if kind != "moe_block")
    profile = parse_profile(json.loads(json.dumps(data)), where="test")
    assert profile.ep_overhead_for("moe_block", 2) == (tuple(entry["ep_overhead_s"]["2"]),
                                                       tuple(entry["ep_slowdown"]["2"]))
