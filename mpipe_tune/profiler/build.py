"""One profiling run: measure the roofline and the links, then assemble a schema-v1 profile.

:func:`profile_device` does the measuring; :func:`assemble_profile` is the pure part that turns the
measurements into the JSON form ``parse_profile`` accepts, every number with its provenance:
``source: "measured"``, the date, a ``ref`` that says how it was measured, and the raw medians and
spreads behind it. The inter-node link class, which a single-host run cannot see, is a copy of the
intra-node one marked ``assumed``. Efficiencies are not calibrated here (``default`` 1.0, ``assumed``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mpipe_tune.cost.profile import SCHEMA_VERSION
from mpipe_tune.profiler.device import BACKENDS, check_device, device_name, import_torch, memory_capacity_bytes
from mpipe_tune.profiler.fit import fit_alpha_beta, to_link_cost
from mpipe_tune.profiler.links import LINK_COLLECTIVES, LinkSweep, measure_links
from mpipe_tune.profiler.roofline import RateSweep, measure_memory_bandwidth, measure_peak_flops
from mpipe_tune.profiler.settings import SweepSettings, sweep_settings
from mpipe_tune.profiler.stats import summarize


@dataclass(frozen=True)
class Measurements:
    """Everything one run measured, before it becomes a profile."""

    device: str
    device_name: str
    nproc: int
    devices_per_node: int
    torch_version: str
    peak_flops: Mapping[str, RateSweep]
    memory: RateSweep
    memory_capacity_bytes: float
    memory_capacity_ref: str
    links: Mapping[str, LinkSweep]
    quick: bool


def count_steps(dtypes: tuple[str, ...], settings: SweepSettings) -> int:
    """Progress steps of a run: one per matrix size and dtype, one for the copy, one per link repeat pass."""
    return len(dtypes) * len(settings.matmul_sizes) + 1 + len(LINK_COLLECTIVES) * settings.link_repeats


def profile_device(device: str, nproc: int, dtypes: tuple[str, ...], *, quick: bool,
                   progress: Callable[[str], None]) -> Measurements:
    """Measure ``device``: peak FLOP/s of each dtype, memory bandwidth, and links over ``nproc`` processes."""
    torch = import_torch(device)
    check_device(torch, device, nproc)
    settings = sweep_settings(device, quick=quick)
    peaks = {dtype: measure_peak_flops(torch, device, dtype, settings, progress) for dtype in dtypes}
    memory = measure_memory_bandwidth(torch, device, settings, progress)
    capacity, capacity_ref = memory_capacity_bytes(torch, device, nproc)
    links = measure_links(device, nproc, settings, progress)
    per_node = nproc if device == "cpu" else getattr(torch, device).device_count()
    return Measurements(device, device_name(torch, device), nproc, per_node, torch.__version__, peaks,
                        memory, capacity, capacity_ref, links, quick)


def assemble_profile(m: Measurements, *, name: str, date: str | None = None) -> dict[str, Any]:
    """The profile's JSON form (schema version 1) from measurements."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    measured = {"source": "measured", "date": date}
    how = "" if not m.quick else " (--quick sweep: small sizes, few repeats; a smoke test, not a profile to plan with)"

    peaks = {}
    for dtype, sweep in m.peak_flops.items():
        best = sweep.best
        peaks[dtype] = {
            "value": best.rate.median, **measured,
            "ref": f"best median rate of torch.matmul on {m.device} over square sizes "
                   f"{[p.size for p in sweep.points]}, reached at n={best.size} "
                   f"(2 n^3 FLOP per product, {best.rate.num_repeats} repeats){how}",
            "matrix_sizes": [p.size for p in sweep.points],
            "median_flops_per_s": [p.rate.median for p in sweep.points],
            "iqr_flops_per_s": [p.rate.iqr for p in sweep.points],
        }
    copy = m.memory.best
    memory = {
        "value": copy.rate.median, **measured,
        "ref": f"median rate of copying a {copy.size / 2**20:.0f} MiB tensor on {m.device}, bytes read plus "
               f"written, {copy.rate.num_repeats} repeats{how}",
        "iqr_bytes_per_s": copy.rate.iqr,
    }
    capacity = {"value": m.memory_capacity_bytes, **measured, "ref": m.memory_capacity_ref}

    intra, inter = {}, {}
    backend = BACKENDS[m.device]
    for collective, sweep in m.links.items():
        spreads = [summarize(s) for s in sweep.samples_s]
        medians = [s.median for s in spreads]
        fit = fit_alpha_beta(sweep.sizes_bytes, medians)
        cost = to_link_cost(fit, collective, sweep.group_size)
        where = ("ping-pong between ranks 0 and 1, half the round trip" if collective == "p2p"
                 else f"over a group of {sweep.group_size} ranks, the slowest rank's time")
        intra[collective] = {
            "alpha_s": cost.alpha_s, "beta_s_per_byte": cost.beta_s_per_byte, **measured,
            "ref": f"{collective} with {backend} between {m.nproc} local processes on {m.device}, {where}; "
                   f"t = alpha + beta*n fitted to the median per size minimising relative error, then "
                   f"divided into per-step alpha and beta by the closed form of estimate_collective_s; "
                   f"fit_r2 is the R^2 of log(time){how}",
            "fit_r2": fit.fit_r2,
            "group_size": sweep.group_size,
            "sizes_bytes": list(sweep.sizes_bytes),
            "median_s": medians,
            "iqr_s": [s.iqr for s in spreads],
            "repeats": len(sweep.samples_s[0]),
        }
        inter[collective] = {
            "alpha_s": cost.alpha_s, "beta_s_per_byte": cost.beta_s_per_byte, "source": "assumed",
            "ref": "not measured: a copy of links.intra_node (every profiled process ran on one node); "
                   "profile across nodes or replace it with the interconnect's figures",
        }

    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "device": f"{m.device_name} ({m.device}, {m.nproc} processes)",
        "devices_per_node": m.devices_per_node,
        "notes": f"measured by mpipe-tune profile --device {m.device} --nproc {m.nproc}"
                 f"{' --quick' if m.quick else ''} with torch {m.torch_version} on {date}. "
                 "Efficiencies are not calibrated yet (default 1.0) and the inter-node links are a copy of "
                 "the intra-node ones.",
        "peak_flops_per_s": peaks,
        "memory_bytes_per_s": memory,
        "memory_capacity_bytes": capacity,
        "efficiency": {"default": {
            "value": 1.0, "source": "assumed",
            "ref": "uncalibrated: the profiler measures the roofline only; per-layer-kind efficiencies "
                   "need the runtime's layers",
        }},
        "links": {"intra_node": intra, "inter_node": inter},
    }
