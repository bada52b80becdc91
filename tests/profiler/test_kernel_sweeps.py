"""The host's dispatch and sync cost and the kernel-efficiency curves: fits that recover known
parameters, the tables in an assembled profile, and a tiny real sweep on this CPU."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.cost import parse_profile
from mpipe_tune.profiler import assemble_profile
from mpipe_tune.cost import AttentionCurve, GemmCurve, MemoryCurve
from mpipe_tune.profiler._curves import fit_gemm, fit_saturation
from mpipe_tune.profiler._dispatch import ChainSweep, HostSweep, host_entries
from mpipe_tune.profiler._shapes import (
    KernelSweeps, KernelSweepSettings, ShapePoint, CALL_KERNELS, attention_fwd_flops, kernel_efficiency_entries,
    layer_gemms,
)
from mpipe_tune.profiler import summarize

PEAK, BANDWIDTH, DISPATCH = 2e12, 1e11, 5e-6
GEMM = GemmCurve(max=0.8, half_dim=96.0, tile_m=64, tile_n=128, units=8)
ATTENTION = AttentionCurve(max=0.6, half_seq=512.0)
MEMORY = MemoryCurve(max=0.85, half_bytes=1e6)
SHAPES = tuple((m, n, k) for m in (16, 64, 200, 600, 1000, 2700) for n in (64, 192, 320, 1024) for k in (64, 512, 4096))


def synthetic_sweeps(units: int | None) -> KernelSweeps:
    """Seconds per call exactly as the curves say, and a GEMM call shorter than the dispatch cost."""
    def point(size, seconds, backward=None):
        return ShapePoint(size, summarize([seconds]), None if backward is None else summarize([backward]))

    gemm = [point(s, 2.0 * math.prod(s) / (float(GEMM.efficiency(*s)) * PEAK)) for s in SHAPES]
    attention = [point((L,), 1.0, 3 * attention_fwd_flops(L, 16, 128) / (float(ATTENTION.efficiency(L)) * PEAK))
                 for L in (64, 256, 1024, 2048, 8192)]
    memory = [point((b,), 2.0 * b / (float(MEMORY.efficiency(2 * b)) * BANDWIDTH)) for b in (2**16, 2**20, 2**24, 2**28)]
    tiny = point((1, 1, 1), DISPATCH / 10)  # timed at the host's rate: must stay out of the fit
    return KernelSweeps("bf16", (tiny, *gemm), tuple(attention), tuple(memory), 16, 128, units)


@pytest.mark.parametrize("units", [8, None])
def test_the_fits_recover_the_curves_that_made_the_timings(units):
    entries = kernel_efficiency_entries(synthetic_sweeps(units), peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH,
                                        dispatch_s=DISPATCH, device="cuda", measured={"source": "measured"})
    gemm = entries["gemm"]
    assert (gemm["tile_m"], gemm["tile_n"], gemm["units"]) == (64, 128, 8)  # units fitted where the device is silent
    assert gemm["max"] == pytest.approx(0.8, rel=1e-3) and gemm["half_dim"] == pytest.approx(96.0, rel=1e-3)
    assert gemm["host_bound"] == [[1, 1, 1]] and len(gemm["shapes"]) == len(SHAPES)
    assert gemm["fit_r2"] == pytest.approx(1.0) and gemm["rms_relative_error"] < 1e-3
    attention = entries["attention"]
    assert attention["max"] == pytest.approx(0.6, rel=1e-3) and attention["half_seq"] == pytest.approx(512, rel=1e-3)
    assert attention["seq_lengths"] == [64, 256, 1024, 2048, 8192] and attention["causal"] is True
    memory = entries["memory"]
    assert memory["max"] == pytest.approx(0.85, rel=1e-3) and memory["half_bytes"] == pytest.approx(1e6, rel=1e-3)
    for entry in entries.values():
        assert entry["source"] == "measured" and entry["ref"] and len(entry["predicted_efficiency"]) == len(entry["efficiency"])


def with_issue(sweeps: KernelSweeps, dispatch_s: float) -> KernelSweeps:
    """``sweeps`` as an inline (CPU) host times them: every call's seconds plus its kernels' issue time."""
    def plus(points, family, both=False):
        issue = CALL_KERNELS[family] * dispatch_s
        return tuple(ShapePoint(p.size, summarize([p.seconds.median + (0.0 if both else issue)]),
                                None if p.backward is None else summarize([p.backward.median + issue]))
                     for p in points)

    return replace(sweeps, gemm=plus(sweeps.gemm, "gemm"), attention=plus(sweeps.attention, "attention", both=True),
                   memory=plus(sweeps.memory, "memory"))


def test_on_cpu_the_dispatch_and_the_curves_are_recovered_from_whole_calls():
    # An inline host: each call costs its kernels' issue plus the curve's time. The chains give dispatch_s, the
    # curves are fitted net of it, and the short GEMM (under twice its issue time) stays out of the fit.
    planted = 20e-6
    lengths = (16, 64, 256, 1024)
    chains = HostSweep(*(ChainSweep(lengths, tuple(summarize([3e-6 + (planted + extra) * n]) for n in lengths))
                         for extra in (0.0, 4e-6)))
    table = host_entries(chains, {"source": "measured"}, "cpu")
    assert table["issue"] == "inline" and table["dispatch_s"]["value"] == pytest.approx(planted, rel=1e-6)
    sweeps = with_issue(synthetic_sweeps(8), table["dispatch_s"]["value"])
    entries = kernel_efficiency_entries(sweeps, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH,
                                        dispatch_s=table["dispatch_s"]["value"], device="cpu",
                                        measured={"source": "measured"})
    gemm, attention, memory = entries["gemm"], entries["attention"], entries["memory"]
    assert (gemm["max"], gemm["half_dim"], gemm["tile_m"], gemm["tile_n"]) == pytest.approx((0.8, 96.0, 64, 128), rel=1e-3)
    assert [1, 1, 1] in gemm["host_bound"] and len(gemm["shapes"]) + len(gemm["host_bound"]) == len(SHAPES) + 1
    assert "net of its issue time" in gemm["ref"]
    assert (attention["max"], attention["half_seq"]) == pytest.approx((0.6, 512.0), rel=1e-3)
    assert (memory["max"], memory["half_bytes"]) == pytest.approx((0.85, 1e6), rel=1e-3)
    # fitted to the whole calls instead, the curves would carry the dispatch: the small GEMMs far slower
    whole = kernel_efficiency_entries(sweeps, peak_flops_per_s=PEAK, bytes_per_s=BANDWIDTH, dispatch_s=0.0,
                                      device="cuda", measured={"source": "measured"})["gemm"]
    assert whole["rms_relative_error"] > 0.1


def test_a_noisy_sweep_is_fitted_with_its_fit_quality_stated():
    rng = np.random.default_rng(0)
    lengths = np.array([64, 128, 256, 512, 1024, 2048, 4096])
    noisy = ATTENTION.efficiency(lengths) * np.exp(rng.normal(0, 0.05, len(lengths)))
    fit = fit_saturation(AttentionCurve, lengths, noisy)
    assert fit.curve.max == pytest.approx(0.6, rel=0.15) and fit.curve.half_seq == pytest.approx(512, rel=0.4)
    assert 0.5 < fit.fit_r2_efficiency < 1 and 0 < fit.rms_relative_error < 0.2
    cached = fit_saturation(MemoryCurve, [2**16, 2**20, 2**24], [3.0, 1.5, 0.9])  # in-cache copies above the bandwidth
    assert cached.curve.max == 1.0 and cached.rms_relative_error > 0.3  # max <= 1, as the schema requires
    flat = fit_gemm([(256, 256, 256), (512, 512, 512)], [0.5, 0.5], units=1)  # one thread: the tiles do not matter
    assert flat.curve.units == 1 and flat.rms_relative_error < 1e-4  # no roll-off: half_dim at the grid's floor


def test_the_host_table_is_the_slope_of_each_chain():
    lengths = (16, 64, 256, 1024)
    plain = ChainSweep(lengths, tuple(summarize([1e-6 + 2e-6 * n] * 3) for n in lengths))
    synced = ChainSweep(lengths, tuple(summarize([1e-6 + 2.5e-6 * n] * 3) for n in lengths))
    sweep = HostSweep(plain, synced)
    assert sweep.dispatch_s == pytest.approx(2e-6) and sweep.sync_s == pytest.approx(5e-7)
    table = host_entries(sweep, {"source": "measured", "date": "2026-12-07"}, "npu")
    assert table["dispatch_s"]["value"] == pytest.approx(2e-6) and table["sync_s"]["value"] == pytest.approx(5e-7)
    assert table["dispatch_s"]["fit_r2"] == pytest.approx(1.0) and table["sync_s"]["date"] == "2026-12-07"
    assert "queue runs ahead" in table["dispatch_s"]["ref"]
    assert HostSweep(synced, plain).sync_s == 0.0  # a sync that costs nothing measurable is 0, never negative


def test_layer_gemms_cover_micro_batch_1_shapes():
    shapes = layer_gemms((600, 2700), (128,))
    assert (2700, 384, 128) in shapes and (600, 128, 512) in shapes and len(shapes) == 6


def measurements_with_tables():
    from test_profile_command import _measurements


    lengths = (16, 64, 256)
    host = HostSweep(ChainSweep(lengths, tuple(summarize([2e-6 * n]) for n in lengths)),
                     ChainSweep(lengths, tuple(summarize([3e-6 * n]) for n in lengths)))
    return replace(_measurements(), host=host, kernels=replace(synthetic_sweeps(None), dtype="fp32"))


def test_the_assembled_profile_carries_the_kernel_tables_and_round_trips():
    m = measurements_with_tables()
    data = json.loads(json.dumps(assemble_profile(m, name="t", date="2026-12-07")))
    profile = parse_profile(data, where="test")
    assert profile.host.dispatch_s == pytest.approx(2e-6) and profile.host.sync_s == pytest.approx(1e-6)
    # fitted against the measurements' own roofline: fp32 peak 3e10 FLOP/s, bandwidth 1.1e10 B/s
    expected = kernel_efficiency_entries(m.kernels, peak_flops_per_s=3e10, bytes_per_s=1.1e10, dispatch_s=2e-6,
                                         device="cpu", measured={"source": "measured"})
    curves = profile.kernel_efficiency
    for family, names in (("gemm", ("max", "half_dim", "tile_m", "tile_n", "units")), ("attention", ("max", "half_seq")),
                          ("memory", ("max", "half_bytes"))):
        assert [getattr(getattr(curves, family), n) for n in names] == pytest.approx([expected[family][n] for n in names])
    for key in ("host.dispatch_s", "host.sync_s", "kernel_efficiency.gemm", "kernel_efficiency.memory"):
        origin = profile.provenance[key]
        assert origin["source"] == "measured" and origin["date"] == "2026-12-07" and origin["ref"] and "fit_r2" in origin
    again = parse_profile(json.loads(json.dumps(profile.to_dict())), where="test again")  # the profile's own form
    assert again.host == profile.host and again.kernel_efficiency == profile.kernel_efficiency


def test_a_tiny_measured_sweep_on_this_cpu_has_plausible_figures():
    torch = pytest.importorskip("torch")
    from mpipe_tune.profiler._dispatch import measure_host
    from mpipe_tune.profiler._shapes import measure_kernels

    settings = KernelSweepSettings(
        dispatch_lengths=(16, 64, 256), dispatch_repeats=3, gemm_shapes=((128, 128, 128), (256, 256, 256), (256, 512, 128)),
        max_call_s=1.0, attention_lengths=(64, 128, 256), attention_heads=2, head_dim=32, attention_max_call_s=1.0,
        memory_sizes_bytes=(2**18, 2**20, 2**22), repeats=3, min_repeat_s=1e-3)
    steps = []
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host = measure_host(torch, "cpu", settings.dispatch_lengths, settings.dispatch_repeats, steps.append)
        sweeps = measure_kernels(torch, "cpu", "fp32", settings, peak_flops_per_s=1e11, progress=steps.append)
    finally:
        torch.set_num_threads(saved)
    assert len(steps) == settings.num_points
    assert 0 < host.dispatch_s < 1e-3 and host.sync_s >= 0
    table = host_entries(host, {"source": "measured"}, "cpu")
    assert table["dispatch_s"]["fit_r2"] <= 1 and len(table["sync_s"]["median_s"]) == 3
    assert sweeps.units == 1 and len(sweeps.gemm) == 3 and len(sweeps.attention) == 3
    entries = kernel_efficiency_entries(sweeps, peak_flops_per_s=1e11, bytes_per_s=1e10, dispatch_s=host.dispatch_s,
                                        device="cpu", measured={"source": "measured"})
    for family, half in (("gemm", "half_dim"), ("attention", "half_seq"), ("memory", "half_bytes")):
        entry = entries[family]
        assert entry["max"] > 0 and entry[half] > 0 and entry["fit_r2"] <= 1, (family, entry)
        assert all(e > 0 for e in entry["efficiency"])


def test_ctrl_c_in_the_kernel_sweeps_stops_at_the_next_point_with_no_profile_written(tmp_path):
    pytest.importorskip("torch")
    from tests.test_interrupt import profile_interrupted_at

    code, err, written = profile_interrupted_at(tmp_path, "measure:14")  # a --quick GEMM point (7 roofline steps)
    assert code == 130 and not written and "stopping at the next safe point" in err, err
    assert err.strip().splitlines()[-1].startswith("mpipe-tune profile: interrupted; no profile written"), err


@pytest.mark.parametrize("properties, units", [({"multi_processor_count": 132}, 132),  # CUDA: SMs
                                               ({"cube_core_num": 24}, 24),  # torch_npu where it says its cube cores
                                               ({"name": "an npu that does not say"}, None)])  # fitted then
def test_compute_units_come_from_the_accelerator_s_properties(properties, units):
    from types import SimpleNamespace

    from mpipe_tune.profiler._shapes import compute_units

    module = SimpleNamespace(get_device_properties=lambda index: SimpleNamespace(**properties))
    assert compute_units(SimpleNamespace(npu=module, cuda=module), "npu") == units
    assert compute_units(SimpleNamespace(npu=module, cuda=module), "cuda") == units


class StandInDevice:
    """torch with an ``npu`` that is the CPU underneath: synchronize and timing events counted, tensors made on
    the CPU. The accelerator code path runs up to the device boundary, which this machine does not have."""

    def __init__(self, torch):
        import time
        from types import SimpleNamespace

        self._torch, self.syncs, self.events = torch, 0, 0
        outer = self

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing
                outer.events += 1

            def record(self):
                self.at = time.perf_counter()

            def synchronize(self):
                outer.syncs += 1

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3  # milliseconds, as torch's events give it

        def synchronize():
            outer.syncs += 1

        self.npu = SimpleNamespace(Event=Event, synchronize=synchronize,
                                   get_device_properties=lambda index: SimpleNamespace(cube_core_num=20))

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        if name in ("zeros", "ones", "randn", "empty"):
            return lambda *args, device=None, **kw: value(*args, **kw)
        return value


def test_the_accelerator_path_runs_up_to_the_device_boundary():
    torch = pytest.importorskip("torch")
    from mpipe_tune.profiler._dispatch import measure_host
    from mpipe_tune.profiler._shapes import measure_kernels

    settings = KernelSweepSettings(
        dispatch_lengths=(8, 32), dispatch_repeats=2, gemm_shapes=((64, 64, 64), (128, 128, 128)), max_call_s=1.0,
        attention_lengths=(32, 64), attention_heads=1, head_dim=16, attention_max_call_s=1.0,
        memory_sizes_bytes=(2**16, 2**18), repeats=2, min_repeat_s=1e-4)
    device = StandInDevice(torch)
    host = measure_host(device, "npu", settings.dispatch_lengths, settings.dispatch_repeats, lambda _: None)
    syncs = device.syncs
    assert syncs >= 2 * 2 * 2 * 2  # both chains, every length and repeat: the queue emptied before and after
    sweeps = measure_kernels(device, "npu", "fp32", settings, peak_flops_per_s=1e11, progress=lambda _: None)
    assert device.events > 0 and device.syncs > syncs  # timed by device events, read after they synchronize
    assert sweeps.units == 20 and len(sweeps.gemm) == 2 and len(sweeps.memory) == 2
    entries = kernel_efficiency_entries(sweeps, peak_flops_per_s=1e11, bytes_per_s=1e10, dispatch_s=host.dispatch_s,
                                        device="npu", measured={"source": "measured"})
    assert entries and all("device-event seconds" in e["ref"] for e in entries.values())
    for family, entry in entries.items():  # each point fitted or set aside as timed at the host's rate
        assert len(entry["efficiency"]) + len(entry["host_bound"]) == 2, family
