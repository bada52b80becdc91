"""One profiling run: measure the roofline and the links, then assemble a schema-v1 profile.

:func:`profile_device` does the measuring; :func:`assemble_profile` is the pure part that turns the
measurements into the JSON form ``parse_profile`` accepts, every number with its provenance:
``source: "measured"``, the date, a ``ref`` that says how it was measured, and the raw medians and
spreads behind it. The inter-node link class, which a single-host run cannot see, is a copy of the
intra-node one marked ``assumed``; run by torchrun across nodes, ``profile`` measures both classes
(:mod:`~mpipe_tune.profiler._nodes`) and :func:`merge_link_classes` puts them into a single-node profile. When a calibration model is given, each layer kind (and a
``default`` over all its kinds) gets a forward efficiency (``value``), a ``backward_value`` and fixed
seconds per forward and backward call, fitted to its layers' timings (and, for the ViT block, fixed
seconds per image), and the profile gets the measured ``optimizer_update_bytes_per_s``; without one,
``default`` is 1.0, ``assumed``, and no call overhead. Where the layers were also timed split over
pairs of ranks (tensor parallelism of degree 2, an even number of ranks), each kind gets
``tp_overhead_s`` and ``tp_slowdown`` for degree 2, and where their MoE layers' routed experts were also spread
over the pairs, those kinds ``ep_overhead_s`` and ``ep_slowdown`` (:func:`split_call_entries`).

On CPU one device is one of the ``nproc`` processes: the roofline runs with that process's share of
the cores (:func:`~mpipe_tune.profiler._device.device_share`); the memory bandwidth is a process's share of
the host's while all ``nproc`` copy at once (:func:`~mpipe_tune.profiler._roofline.measure_memory_together`;
the rate one process reached alone is kept beside, and the copy-size curve is relative to it); the layers are
timed by ``nproc`` ranks at once, as a run's stages (:mod:`~mpipe_tune.profiler._together`).
"""

from __future__ import annotations

import copy
import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mpipe_tune.algebra import Degrees, Model
from mpipe_tune.cost import SCHEMA_VERSION, parse_profile
from mpipe_tune.interrupt import at_once, phase
from mpipe_tune.profiler._calibrate import (
    MIN_SIZES_FOR_OVERHEAD, PER_IMAGE_KINDS, LayerFit, LayerPoint, calibration_layers, fit_layer_timing,
)
from mpipe_tune.profiler._device import (
    BACKENDS, check_device, device_name, device_share, import_torch, memory_capacity_bytes, threads_per_process,
)
from mpipe_tune.profiler._dispatch import HostSweep, host_entries, measure_host
from mpipe_tune.profiler._fit import fit_alpha_beta, fit_nonnegative_line, to_link_cost
from mpipe_tune.profiler._links import LINK_COLLECTIVES, LinkSweep, measure_links
from mpipe_tune.profiler._nodes import NodeLayout
from mpipe_tune.profiler._fsdp_host import (
    UNITS, WIDTHS, FsdpHostPoint, fsdp_host_entries, measure_fsdp_host, priced_layer_comm_s)
from mpipe_tune.profiler._overlap import OverlapPoint, measure_overlap, overlap_entry, overlap_repeats
from mpipe_tune.profiler._roofline import (
    RatePoint, RateSweep, measure_memory_bandwidth, measure_memory_together, measure_peak_flops, shares_memory,
)
from mpipe_tune.profiler._settings import SweepSettings, sweep_settings
from mpipe_tune.profiler._shapes import (
    KernelSweeps, KernelSweepSettings, kernel_efficiency_entries, kernel_sweep_settings, measure_kernels,
)
from mpipe_tune.profiler._stats import summarize
from mpipe_tune.profiler._together import UpdatePoint, calibrate_together


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
    threads_per_process: int | None = None
    """CPU threads of one device (process); None for accelerators."""
    layer_points: tuple[LayerPoint, ...] = ()
    calibration_model: str | None = None
    calibration_dtype: str | None = None
    update_point: UpdatePoint | None = None
    """The runtime's optimizer update timed on the calibration layers' weights (with a calibration)."""
    calibration: Model | None = None
    """The calibration model itself (its layers' costs price the split points against the cost model)."""
    host: HostSweep | None = None
    """The dispatch and sync chains (the profile's ``host`` table)."""
    kernels: KernelSweeps | None = None
    """The GEMM, attention and copy sweeps (the profile's ``kernel_efficiency`` table)."""
    overlap: OverlapPoint | None = None
    """How much a collective and a product slow each other (:mod:`~mpipe_tune.profiler._overlap`)."""
    fsdp_host: FsdpHostPoint | None = None
    """FSDP2's host seconds per sharded layer per call and per byte per collective
    (:mod:`~mpipe_tune.profiler._fsdp_host`)."""
    memory_together: RatePoint | None = None
    """One process's copy rate while all ``nproc`` copy at once (CPU; the profile's bandwidth when given)."""

    @property
    def bandwidth(self) -> float:
        """The profile's memory bandwidth: a process's share of the host's while every one copies (CPU, several
        processes), else the rate one device reached alone."""
        return (self.memory_together or self.memory.best).rate.median


COPIED_INTER_NODE = "The inter-node links are a copy of the intra-node ones."
"""A single-node profile's note on its inter-node class (one node cannot measure it)."""

def quick_note(quick: bool) -> str:
    """What every measured entry's ``ref`` adds when the sweep was ``--quick``."""
    return " (--quick sweep: small sizes, few repeats; a smoke test, not a profile to plan with)" if quick else ""


def count_steps(dtypes: tuple[str, ...], settings: SweepSettings, calibration: Model | None = None,
                calibration_tokens: tuple[int, ...] | None = None,
                kernel_settings: KernelSweepSettings | None = None, together: bool = False) -> int:
    """Progress steps of a run: one per matrix size and dtype, one for the copy (and one for the copy
    on every process at once, ``together``), one per point of the kernel sweeps, one per calibration layer
    and token count, one per link repeat pass."""
    layers = len(calibration_layers(calibration)) if calibration is not None else 0
    sizes = len(calibration_tokens or settings.calibration_tokens)
    kernels = kernel_settings.num_points if kernel_settings is not None else 0
    return (len(dtypes) * len(settings.matmul_sizes) + 1 + together + kernels + layers * sizes
            + len(LINK_COLLECTIVES) * settings.link_repeats + overlap_repeats(settings) + len(UNITS) * len(WIDTHS))


def profile_device(device: str, nproc: int, dtypes: tuple[str, ...], *, quick: bool,
                   progress: Callable[[str], None], calibration: Model | None = None,
                   calibration_tokens: tuple[int, ...] | None = None,
                   kernel_settings: KernelSweepSettings | None = None) -> Measurements:
    """Measure ``device``: peak FLOP/s of each dtype, memory bandwidth, the host's dispatch and sync
    cost and the kernel sweeps (with ``kernel_settings``; in the first dtype), the layers of
    ``calibration`` (in the first dtype), and links over ``nproc`` processes.

    Ctrl-C (inside a command, :mod:`mpipe_tune.interrupt`): the roofline runs in this process, and a first
    Ctrl-C stops it at the caller's next ``progress`` step (or before the calibration or the links); the
    calibration and the links run on child processes, which a terminal's Ctrl-C reaches as well, so there
    it stops at once. Nothing measured is returned from an interrupted run.

    ``calibration_tokens`` replaces the sweep's layer sizes (rows per layer call, see
    :mod:`~mpipe_tune.profiler._calibrate`): give the range of the microbatches that will be planned."""
    torch = import_torch(device)
    check_device(torch, device, nproc)
    settings = sweep_settings(device, quick=quick)
    if calibration_tokens:
        assert all(n >= 1 for n in calibration_tokens), calibration_tokens
        settings = replace(settings, calibration_tokens=tuple(calibration_tokens))
    with device_share(torch, device, nproc):
        peaks = {dtype: measure_peak_flops(torch, device, dtype, settings, progress) for dtype in dtypes}
        memory = measure_memory_bandwidth(torch, device, settings, progress)
        host = kernels = None
        if kernel_settings is not None:
            host = measure_host(torch, device, kernel_settings.dispatch_lengths, kernel_settings.dispatch_repeats,
                                progress)
            kernels = measure_kernels(torch, device, dtypes[0], kernel_settings,
                                      peak_flops_per_s=peaks[dtypes[0]].best.rate.median, progress=progress)
    together = None
    if shares_memory(device, nproc):
        phase("memory bandwidth, every process at once")
        with at_once():
            together = measure_memory_together(device, nproc, settings, progress)
    points, update = (), None
    if calibration is not None:
        phase("calibration")
        with at_once():  # the ranks get a terminal's Ctrl-C too: nothing to wait for
            points, update = calibrate_together(device, nproc, calibration, dtypes[0], settings, progress)
    capacity, capacity_ref = memory_capacity_bytes(torch, device, nproc)
    phase("links")
    with at_once():
        links = measure_links(device, nproc, settings, progress)
    phase("overlap")
    with at_once():
        overlap = measure_overlap(device, nproc, settings, progress)
    phase("FSDP2 host cost")
    with at_once():
        fsdp_host = measure_fsdp_host(device, nproc, settings, progress)
    per_node = nproc if device == "cpu" else getattr(torch, device).device_count()
    return Measurements(
        device, device_name(torch, device), nproc, per_node, torch.__version__, peaks, memory, capacity,
        capacity_ref, links, quick, threads_per_process(nproc) if device == "cpu" else None, points,
        calibration.name if calibration is not None else None, dtypes[0] if calibration is not None else None,
        update, calibration, host, kernels, overlap, fsdp_host, together,
    )


def assemble_profile(m: Measurements, *, name: str, date: str | None = None) -> dict[str, Any]:
    """The profile's JSON form (schema version 1) from measurements."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    measured = {"source": "measured", "date": date}
    how = quick_note(m.quick)
    share = f" with {m.threads_per_process} thread(s), one process's share of the cores" if m.threads_per_process else ""

    peaks = {}
    for dtype, sweep in m.peak_flops.items():
        best = sweep.best
        peaks[dtype] = {
            "value": best.rate.median, **measured,
            "ref": f"best median rate of torch.matmul on {m.device}{share} over square sizes "
                   f"{[p.size for p in sweep.points]}, reached at n={best.size} "
                   f"(2 n^3 FLOP per product, {best.rate.num_repeats} repeats){how}",
            "matrix_sizes": [p.size for p in sweep.points],
            "median_flops_per_s": [p.rate.median for p in sweep.points],
            "iqr_flops_per_s": [p.rate.iqr for p in sweep.points],
        }
    copy = m.memory.best
    memory = {
        "value": copy.rate.median, **measured,
        "ref": f"median rate of copying a {copy.size / 2**20:.0f} MiB tensor on {m.device}{share}, bytes read plus "
               f"written, {copy.rate.num_repeats} repeats{how}",
        "iqr_bytes_per_s": copy.rate.iqr,
    }
    if m.memory_together is not None:
        together = m.memory_together
        memory = {
            "value": together.rate.median, **measured,
            "ref": f"median rate of copying a {together.size / 2**20:.0f} MiB tensor on each of {m.nproc} processes "
                   f"at once on {m.device}{share} (a run's ranks share the host's memory), bytes read plus written, "
                   f"{together.rate.num_repeats} repeats over the processes; one process alone: "
                   f"alone_bytes_per_s{how}",
            "iqr_bytes_per_s": together.rate.iqr, "alone_bytes_per_s": copy.rate.median,
        }
    capacity = {"value": m.memory_capacity_bytes, **measured, "ref": m.memory_capacity_ref}

    intra = link_entries(m.links, measured, f"with {BACKENDS[m.device]} between {m.nproc} local processes on "
                                            f"{m.device}", how)
    inter = {collective: {
        "alpha_s": entry["alpha_s"], "beta_s_per_byte": entry["beta_s_per_byte"], "source": "assumed",
        "ref": "not measured: a copy of links.intra_node (every profiled process ran on one node); "
               "profile across nodes (mpipe-tune profile under torchrun --nnodes 2 or more) or replace it with "
               "the interconnect's figures"} for collective, entry in intra.items()}

    extra = {}
    if m.update_point is not None:
        u = m.update_point
        extra["optimizer_update_bytes_per_s"] = {
            "value": u.bytes_per_s, **measured,
            "ref": f"the runtime's optimizer update (plain SGD: read weight and gradient, write weight) on the "
                   f"weights of model {m.calibration_model!r}'s calibration layers in {m.calibration_dtype}, "
                   f"{u.size_bytes / 2**20:.1f} MiB read and written per call, timed by {m.nproc} ranks at once; "
                   f"bytes over the median{how}",
            "size_bytes": u.size_bytes, "median_s": u.seconds.median, "iqr_s": u.seconds.iqr,
            "repeats": u.seconds.num_repeats,
        }
    if m.overlap is not None:
        extra["comm_compute_overlap"] = overlap_entry(
            m.overlap, measured, f"on {m.nproc} local processes with {BACKENDS[m.device]}", how)
    profile = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "device": f"{m.device_name} ({m.device}, {m.nproc} processes)",
        "devices_per_node": m.devices_per_node,
        "notes": f"measured by mpipe-tune profile --device {m.device} --nproc {m.nproc}"
                 f"{' --quick' if m.quick else ''} with torch {m.torch_version} on {date}. "
                 + (f"Efficiencies fitted to the runtime's layers of model {m.calibration_model!r} in "
                    f"{m.calibration_dtype}. " if m.layer_points else "Efficiencies are not calibrated (default 1.0). ")
                 + COPIED_INTER_NODE,
        "peak_flops_per_s": peaks,
        "memory_bytes_per_s": memory,
        "memory_capacity_bytes": capacity,
        "efficiency": _efficiencies(m, measured, how),
        "links": {"intra_node": intra, "inter_node": inter},
        **extra,
        **_kernel_tables(m, date),
    }
    for split in SPLITS:
        points = [p for p in m.layer_points if getattr(p, split) > 1]
        if points and m.calibration is not None:
            split_call_entries(profile, points, m.calibration, m.calibration_dtype, how, split=split)
    if m.fsdp_host is not None:  # its collectives priced as the cost model prices them on this very profile
        assembled = parse_profile(profile, where="the profile being assembled")
        priced = priced_layer_comm_s(assembled, m.fsdp_host.sizes, m.fsdp_host.group_size)
        profile.update(fsdp_host_entries(replace(m.fsdp_host, priced_s=priced), measured,
                                         f"on {m.nproc} local processes with {BACKENDS[m.device]}", how))
    return profile


def link_entries(links: Mapping[str, LinkSweep], measured: Mapping[str, str], between: str,
                 how: str = "") -> dict[str, dict[str, Any]]:
    """One link class's entries fitted to its sweeps: per collective, per-step alpha and beta, the
    provenance (``measured``), a ``ref`` saying it ran ``between`` which processes, and the medians and
    spreads behind the fit."""
    entries = {}
    for collective, sweep in links.items():
        spreads = [summarize(s) for s in sweep.samples_s]
        medians = [s.median for s in spreads]
        fit = fit_alpha_beta(sweep.sizes_bytes, medians)
        cost = to_link_cost(fit, collective, sweep.group_size)
        where = ("ping-pong between the group's first two ranks, half the round trip" if collective == "p2p"
                 else f"over a group of {sweep.group_size} ranks, the slowest rank's time")
        entries[collective] = {
            "alpha_s": cost.alpha_s, "beta_s_per_byte": cost.beta_s_per_byte, **measured,
            "ref": f"{collective} {between}, {where}; t = alpha + beta*n fitted to the median per size minimising "
                   f"relative error, then divided into per-step alpha and beta by the closed form of "
                   f"estimate_collective_s; fit_r2 is the R^2 of log(time){how}",
            "fit_r2": fit.fit_r2,
            "group_size": sweep.group_size,
            "sizes_bytes": list(sweep.sizes_bytes),
            "median_s": medians,
            "iqr_s": [s.iqr for s in spreads],
            "repeats": len(sweep.samples_s[0]),
        }
    return entries


def merge_link_classes(compute: Mapping[str, Any], sweeps: Mapping[str, Mapping[str, LinkSweep]], layout: NodeLayout,
                       *, device: str, name: str, quick: bool, torch_version: str,
                       date: str | None = None) -> dict[str, Any]:
    """A profile of the cluster: ``compute`` (a single-node profile's JSON form: its roofline,
    efficiencies and update rate are kept) with each link class in ``sweeps`` replaced by the entries
    fitted to its sweeps across ``layout``'s nodes, and ``devices_per_node`` the nodes' process count.
    A class not in ``sweeps`` (no two processes on one node) keeps ``compute``'s entries, and the notes
    say which classes were measured."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    measured = {"source": "measured", "date": date}
    how = quick_note(quick)
    backend = BACKENDS[device]
    profile = copy.deepcopy(dict(compute))
    profile["links"] = copy.deepcopy(dict(compute["links"]))
    nodes = ", ".join(f"node {node}: ranks {list(ranks)}" for node, ranks in layout.nodes)
    between = {
        "intra_node": f"with {backend} on {device} between the {len(layout.intra_members())} processes of one node "
                      f"(global ranks {list(layout.intra_members())}), under torchrun on {layout.num_nodes} nodes",
        "inter_node": f"with {backend} on {device} between one process on each of {layout.num_nodes} nodes (global "
                      f"ranks {list(layout.inter_members())}, local rank 0 of each), under torchrun",
    }
    for link_class, class_sweeps in sweeps.items():
        profile["links"][link_class] = link_entries(class_sweeps, measured, between[link_class], how)
    kept = [c for c in ("intra_node", "inter_node") if c not in sweeps]
    profile["name"] = name
    profile["devices_per_node"] = layout.devices_per_node
    profile["device"] = f"{compute['device']}; links across {layout.num_nodes} nodes x {layout.devices_per_node}"
    notes = compute.get("notes", "")
    if "inter_node" in sweeps:  # the single-node profile's copy is replaced: its note would say otherwise
        notes = notes.replace(COPIED_INTER_NODE, "")
    profile["notes"] = (f"{notes.strip()} Links measured by mpipe-tune profile --device {device} under "
                        f"torchrun across {layout.num_nodes} nodes ({nodes}) with torch {torch_version} on {date}: "
                        f"measured classes {', '.join(sweeps)}"
                        + (f"; {', '.join(kept)} kept from the compute profile '{compute['name']}'" if kept else "")
                        + f". Compute figures from the single-node profile '{compute['name']}'.").strip()
    return profile


def _kernel_tables(m: Measurements, date: str | None = None) -> dict[str, Any]:
    """The ``host`` and ``kernel_efficiency`` tables of what was measured (none without the sweeps)."""
    if m.host is None or m.kernels is None:
        return {}
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    measured = {"source": "measured", "date": date}
    how = quick_note(m.quick)
    return {
        "host": host_entries(m.host, measured, m.device, how),
        "kernel_efficiency": kernel_efficiency_entries(
            m.kernels, peak_flops_per_s=m.peak_flops[m.kernels.dtype].best.rate.median,
            bytes_per_s=m.memory.best.rate.median, dispatch_s=m.host.dispatch_s, device=m.device,
            measured=measured, how=how),
    }


def _efficiencies(m: Measurements, measured: Mapping[str, str], how: str) -> dict[str, Any]:
    if not m.layer_points:
        return {"default": {
            "value": 1.0, "source": "assumed",
            "ref": "uncalibrated: profile with --calibrate MODEL to fit per-layer-kind efficiencies to the "
                   "runtime's layers",
        }}
    return efficiency_entries(m.layer_points, peak_flops_per_s=m.peak_flops[m.calibration_dtype].best.rate.median,
                              bytes_per_s=m.bandwidth, model_name=m.calibration_model,
                              dtype=m.calibration_dtype, device=m.device, measured=measured, how=how)


def efficiency_entries(layer_points: Sequence[LayerPoint], *, peak_flops_per_s: float, bytes_per_s: float,
                       model_name: str, dtype: str, device: str, measured: Mapping[str, str],
                       how: str = "") -> dict[str, Any]:
    """The profile's ``efficiency`` table fitted to layer timings (at least one point): per kind, and
    ``default`` over all of them, the forward points give ``value`` and ``forward_overhead_s``, the
    backward points ``backward_value`` and ``backward_overhead_s``. ``measured`` is the provenance
    every entry carries (source and date). Refitting a profile to fresh timings (a drifting machine)
    replaces its ``efficiency`` with this."""
    peak, bandwidth = peak_flops_per_s, bytes_per_s
    layer_points = [p for p in layer_points if p.tp == p.ep == 1]  # split layers: split_call_entries
    groups: dict[str, list[LayerPoint]] = {}
    for point in layer_points:
        groups.setdefault(point.kind, []).append(point)
    entries = {}
    single = [p for p in layer_points if p.images == 1]  # the default entry: no kind's per-image part
    for kind, points in [("default", single), *sorted(groups.items())]:
        fits: dict[str, LayerFit] = {}
        predicted = [0.0] * len(points)
        squares = 0.0
        per_image = kind in PER_IMAGE_KINDS and any(p.images > 1 for p in points)
        for phase in ("fwd", "bwd"):
            chosen = [i for i, p in enumerate(points) if p.phase == phase]
            if not chosen:
                continue
            fit = fit_layer_timing([points[i].flops for i in chosen], [points[i].bytes_moved for i in chosen],
                                   [points[i].seconds.median for i in chosen], peak_flops_per_s=peak,
                                   bytes_per_s=bandwidth,
                                   extra_images=[points[i].images - 1 for i in chosen] if per_image else None)
            fits[phase] = fit
            squares += fit.rms_relative_error**2 * len(chosen)
            for i, seconds in zip(chosen, fit.predicted_s):
                predicted[i] = seconds
        forward = fits.get("fwd") or fits["bwd"]
        numbers: dict[str, float] = {"value": forward.efficiency}
        if "fwd" in fits and "bwd" in fits:
            numbers["backward_value"] = fits["bwd"].efficiency
        numbers["forward_overhead_s"] = forward.overhead_s
        numbers["backward_overhead_s"] = fits["bwd"].overhead_s if "bwd" in fits else 0.0
        if per_image:
            numbers["forward_image_overhead_s"] = forward.image_overhead_s
            numbers["backward_image_overhead_s"] = fits["bwd"].image_overhead_s if "bwd" in fits else 0.0
        what = "every calibrated layer kind" if kind == "default" else f"the runtime's {kind} layers"
        entries[kind] = {
            **numbers, **measured,
            "ref": f"{what} of model {model_name!r} timed forward and backward in {dtype} on {device}, chained "
                   f"in model order on fresh microbatches; per phase, the efficiency and the fixed seconds per "
                   f"call (>= 0; fitted where a phase has {MIN_SIZES_FOR_OVERHEAD} sizes or more) minimising the "
                   f"relative error of overhead + max(W / (eff * peak), D / bandwidth) against the medians, with "
                   f"this profile's {dtype} peak and bandwidth and the cost model's W and D"
                   + ("; also timed on the patches split into several images, with fixed seconds per image beyond "
                      "the first fitted beside (one attention call per image)" if per_image else "") + how,
            "rms_relative_error": math.sqrt(squares / len(points)),
            "layers": [p.layer_name for p in points],
            "tokens": [p.tokens for p in points],
            "images": [p.images for p in points],
            "phase": [p.phase for p in points],
            "flops": [p.flops for p in points],
            "bytes": [p.bytes_moved for p in points],
            "median_s": [p.seconds.median for p in points],
            "iqr_s": [p.seconds.iqr for p in points],
            "predicted_s": predicted,
        }
    return entries


def _split_call_fit(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(overhead, slowdown)`` of split calls from their ``(priced, measured)`` seconds (see
    :func:`split_call_entries`)."""
    if not pairs:
        return 0.0, 0.0
    priced, measured = (np.array(v, dtype=float) for v in zip(*pairs))
    if np.ptp(priced) <= 1e-6 * priced.max():  # one size: nothing to tell a slowdown from an overhead
        return max(0.0, float(np.median(measured - priced))), 0.0
    return fit_nonnegative_line(priced, measured - priced, 1.0 / measured)


SPLITS = {"tp": "split over {n} ranks with the runtime's tensor-parallel plans",
          "ep": "with the MoE layers' routed experts spread over {n} ranks (the runtime's all-to-all dispatch)"}
"""How the calibration chain was split, per parallelism whose split calls the profile prices (``tp``, ``ep``)."""


def split_call_entries(profile: dict[str, Any], points: Sequence[LayerPoint], model: Model, dtype: str,
                       how: str = "", *, split: str = "tp") -> None:
    """Add ``tp_overhead_s`` and ``tp_slowdown`` (``split="ep"``: ``ep_overhead_s`` and ``ep_slowdown``) to the
    efficiency entries of ``profile`` (its JSON form, fitted to the whole layers already) from layers timed split
    over ``tp`` ranks (their routed experts spread over ``ep`` ranks).

    Each split point is priced by the cost model on that profile at its tensor- or expert-parallel degree (the
    split roofline, the per-call overheads and the all-reduces or all-to-alls over the profile's links). Per kind
    and phase, what the split call took beyond that price is fitted as a line in the price, ``overhead +
    slowdown * price``, both >= 0, minimising the relative error of the call's time (so the split
    calls of a large microbatch pay more than those of a small one, as they were measured to); a phase
    timed at one price only gets the overhead alone (the median beyond its price).

    A split call's time is its **median** over the repeats, as the whole layers' is. Its calls' means run 10-30%
    over their medians (each ends in a collective that waits for the other rank of the pair), but in a step the
    ranks run in lockstep and its split calls do not pay that tail: fitted to the means, this 2-core VM's tp 2
    plans were predicted 12-16% over their measured steps on average (with the host's drift taken out by the speed
    probe, three rounds), fitted to the medians 6-7% (docs/profiling.md; an older VM read the other way, raw, in
    one round, when the means were taken). Where the split
    layers ran faster than priced, both are 0 (the cost model keeps its other terms as they are). For ``tp`` the
    ``default`` entry is fitted to every kind's points (for ``ep`` only the kinds with routed experts have any).
    The points and their prices are kept beside, as the entry's ``tp_calibration`` (``ep_calibration``)."""
    from mpipe_tune.cost import CostOptions, layer_seconds, parse_profile
    from mpipe_tune.profiler._calibrate import calibration_microbatch

    priced = parse_profile(profile, where="the profile being assembled")
    layers = {layer.name: layer for layer in model.layers}
    pairs: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    evidence: dict[tuple[str, int], list[tuple[LayerPoint, float]]] = {}
    for point in points:
        n = getattr(point, split)
        degrees = Degrees(1, tp=n) if split == "tp" else Degrees(1, dp=n, ep=n)
        options = CostOptions(dtype=dtype, degrees=degrees, rope="none")  # the runtime applies none
        fwd, dgrad, wgrad, bwd_call = layer_seconds(layers[point.layer_name].cost, layers[point.layer_name].block,
                                                    calibration_microbatch(model, point.tokens), priced, options)
        predicted = fwd if point.phase == "fwd" else wgrad + bwd_call + (dgrad if point.input_grad else 0.0)
        for kind in (point.kind, "default") if split == "tp" else (point.kind,):
            pairs.setdefault((kind, n, point.phase), []).append((predicted, point.seconds.median))
            evidence.setdefault((kind, n), []).append((point, predicted))
    for (kind, n), rows in sorted(evidence.items()):
        entry = profile["efficiency"].get(kind)
        if entry is None:
            continue
        fits = [_split_call_fit(pairs.get((kind, n, phase), [])) for phase in ("fwd", "bwd")]
        entry.setdefault(f"{split}_overhead_s", {})[str(n)] = [overhead for overhead, _ in fits]
        entry.setdefault(f"{split}_slowdown", {})[str(n)] = [slowdown for _, slowdown in fits]
        entry.setdefault(f"{split}_calibration", {})[str(n)] = {
            "ref": f"the calibration chain {SPLITS[split].format(n=n)}, timed by every rank at once; per phase, "
                   f"measured minus the cost model's seconds at {split} {n} on this profile fitted as overhead + "
                   f"slowdown x those seconds, both >= 0, minimising the relative error of the measured median "
                   f"times (the means beside them carry a tail a step's lockstep calls do not pay){how}",
            "layers": [p.layer_name for p, _ in rows], "tokens": [p.tokens for p, _ in rows],
            "phase": [p.phase for p, _ in rows], "median_s": [p.seconds.median for p, _ in rows],
            "mean_s": [p.seconds.mean for p, _ in rows], "predicted_s": [predicted for _, predicted in rows],
        }
