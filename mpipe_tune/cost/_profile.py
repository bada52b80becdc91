"""Hardware profiles: the device numbers every event duration is computed from.

A profile is a JSON file (schema version 1, format in ``DESIGN.md`` section 8) holding a device's
per-dtype peak FLOP/s, memory bandwidth and capacity, calibrated efficiencies, and alpha-beta link
costs per link class and collective. Every number carries its provenance: ``source`` (one of
:data:`SOURCES`: ``fitted`` for a figure fitted to published runs), and optionally ``ref`` (what exactly the number is and where it came from), ``date``
and, for measured numbers, ``fit_r2`` and ``sizes_bytes``. A link entry may add ``alpha_source`` when
its latency has another origin than its bandwidth (a datasheet bandwidth with an assumed latency).
A collective's link entry may add ``mesh_links`` (an integer >= 1) where the link class is a full mesh of
direct links (Ascend's HCCS inside an 8-NPU node): its bandwidth is then that of ``mesh_links`` direct links
in use at once, and a collective over ``g`` ranks uses ``min(g - 1, mesh_links)`` of them
(:func:`estimate_collective_s`); absent, every group size sees the entry's full bandwidth.

An efficiency entry's ``value`` is the achieved fraction of peak for a layer kind's forward and, unless
the entry gives ``backward_value``, its backward too. Optional ``forward_overhead_s`` and
``backward_overhead_s`` are fixed seconds per layer call on top of the roofline (framework dispatch,
small kernels that the roofline of the FLOPs cannot see); absent, they are 0. Optional
``forward_image_overhead_s`` and ``backward_image_overhead_s`` are fixed seconds per image beyond the
first of a microbatch, for kinds whose runtime module makes one call per image (the ViT block attends
inside each image: one attention call each); absent, 0. The profiler fits them per layer kind when it
calibrates (:mod:`mpipe_tune.profiler._calibrate`). Optional ``tp_overhead_s`` maps a tensor-parallel
degree (a JSON key, ``"2"``) to ``[forward, backward]`` fixed seconds per call of the kind's layer
split over that many ranks, beyond the split roofline and the all-reduces the cost model charges for
it (the tensor-parallel modules' dispatch and the collectives' waits under the run's conditions); a
degree it does not give costs nothing extra. Optional ``tp_slowdown``, keyed the same way, is the
part that grows with the layer: ``[forward, backward]`` extra seconds of the split layer per second
the cost model charges for it (its roofline, call overheads and all-reduces at that degree), so a
split call costs ``(1 + slowdown) * charged + overhead``. The profiler fits both for degree 2 when it
calibrates with an even number of ranks (:mod:`mpipe_tune.profiler._build`). Optional ``ep_overhead_s`` and
``ep_slowdown``, keyed by an expert-parallel degree, are the same for a layer with routed experts spread over that
many ranks (its token dispatch and combine, all-to-alls included), for its own kind only (no ``default``): the
profiler fits them for degree 2 on a calibration model with MoE layers.

Optional top-level ``devices_per_package`` (default 1): the devices of one package, where the runtime counts each
die of a multi-die chip as a device (a 910C: two dies, 16 a server); above 1 the profile adds the link class
``intra_package`` (the die-to-die link), which a group inside one package uses
(:meth:`HardwareProfile.link_class_spanning`).

Optional top-level ``optimizer_update_bytes_per_s``: the rate of the optimizer update (bytes of
weights, gradients and optimizer state read and written per second), measured by the profiler on the
runtime's own update; a profile without it updates at ``memory_bytes_per_s``.

An optional ``tp_comm_overlap`` entry (a number with provenance) states the fraction of the
tensor-parallel collectives' time hidden behind compute; absent, they are fully exposed. An optional
``comm_compute_overlap`` entry states how much of a data-parallel or sharding collective (a gradient
reduce, a ZeRO gather or reduce-scatter on its own stream) the compute beside it hides: 1 where the two
run side by side at full speed, 0 where they take turns (:mod:`mpipe_tune.profiler._overlap` measures
it); absent, 1. An optional ``fsdp_host_s`` entry states the host seconds torch FSDP2 adds per sharded
layer per forward or backward call (its pre- and post-hooks) and an optional ``fsdp_bytes_s`` the seconds it
adds per byte of a layer's unsharded buffer per all-gather or reduce-scatter it issues (the copies into and out
of its flat buffers), an optional ``fsdp_collective_s`` the seconds per such collective beyond what the links
price it at and an optional ``fsdp_tensor_s`` the seconds per parameter tensor of the layer per such collective
(its work on each tensor around it); :mod:`mpipe_tune.profiler._fsdp_host` measures them: charged on ZeRO-2
and ZeRO-3's sharding actions and step-end collectives (:mod:`mpipe_tune.cost._sharding_events`); absent, 0.

An optional ``fabric`` entry (``devices_per_pod`` and ``pod_oversubscription``, each a number with provenance)
describes pods joined by an oversubscribed spine (:class:`~mpipe_tune.cost._collectives.Fabric`): a
data-parallel all-reduce, gather or reduce-scatter whose group spans pods runs its inter-node bytes
:func:`~mpipe_tune.cost._collectives.spine_slowdown` times slower; absent, one non-blocking fabric.

Optional ``host`` (the host's ``dispatch_s`` per kernel and ``sync_s`` per sync, and ``issue``: ``async``, the
default, where the device runs behind a queue, ``inline`` on a CPU) and ``kernel_efficiency``
(efficiency curves by kernel shape for the ``gemm``, ``attention`` and ``memory`` families) are read by
:mod:`mpipe_tune.cost._kernel_model`, which states their forms.

All numbers are SI base units given as plain JSON numbers: bytes, seconds, bytes per second, FLOP/s.
Built-in profiles live in ``profiles/`` (package data ``mpipe_tune.profiles``); :func:`load_profile`
takes their file stem or a path.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mpipe_tune.cost._collectives import (  # noqa: F401 (importable from here, as callers do)
    COLLECTIVES, Fabric, LinkCost, estimate_collective_s, measured_collective_s, mesh_beta_s_per_byte, spine_slowdown,
)
from mpipe_tune.cost._kernel_model import (
    HostCosts, KernelEfficiency, host_dict, kernel_efficiency_dict, parse_host, parse_kernel_efficiency,
)
from mpipe_tune.cost._profile_check import MISSING, SOURCES, Validator, thaw, to_json  # noqa: F401 (SOURCES)
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_data_file

SCHEMA_VERSION = 1
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
_TRAINING_DTYPES = ("fp32", "tf32", "bf16", "fp16")
"""Dtypes a whole training step commonly runs in: what :meth:`HardwareProfile.slow_dtype_note` compares."""
LINK_CLASSES = ("intra_node", "inter_node")
"""The link classes every profile has."""
PACKAGE_LINK_CLASS = "intra_package"
"""The optional link class between the devices of one package (a multi-die chip whose dies the runtime counts
as devices: the 910C's two dies and the link between them); a profile has it exactly when its
``devices_per_package`` is above 1."""
_TOP_KEYS = {
    "schema_version", "name", "device", "devices_per_node", "peak_flops_per_s",
    "memory_bytes_per_s", "memory_capacity_bytes", "efficiency", "links", "notes", "tp_comm_overlap",
    "optimizer_update_bytes_per_s", "host", "kernel_efficiency", "devices_per_package", "comm_compute_overlap",
    "fsdp_host_s", "fsdp_bytes_s", "fsdp_collective_s", "fsdp_tensor_s", "fabric",
}
_OPTIONAL_TOP_KEYS = {"notes", "tp_comm_overlap", "optimizer_update_bytes_per_s", "host", "kernel_efficiency",
                      "devices_per_package", "comm_compute_overlap", "fsdp_host_s", "fsdp_bytes_s",
                      "fsdp_collective_s", "fsdp_tensor_s", "fabric"}
_OVERLAP_FIXES = {"tp_comm_overlap": "give the fraction of the tensor-parallel collective time hidden behind compute",
                  "comm_compute_overlap": "give the share of a collective's time the compute beside it hides "
                                          "(1: fully, 0: they take turns)"}
ATTENTION_CORE = "attention_core"
"""Efficiency entry of the attention core (scores and values, one fused kernel) inside any layer kind: where
the profile has it, the core's FLOPs are timed at it and the rest of the layer at the kind's entry; where
not, the whole layer at the kind's entry."""
FP8_LINEAR = "fp8_linear"
"""Efficiency entry of the linear layers' GEMMs in an fp8 step (against the fp8 peak, casts and scaling
included); absent, they run at the layer kind's efficiency."""
MEMORY_BOUND = "memory_bound"
"""Efficiency entry of the memory-bound kernels (norms, activations, residual adds, softmax, permutes, lookups):
the achieved fraction of the memory bandwidth. Where the profile has it, each pass of a layer is timed as the
sum of three rooflines, its matmuls', its attention core's and its memory-bound kernels' (at this fraction of
the bandwidth), as the kernels run one after another on the device; where not, as one roofline of the whole
layer, ``max(W / (eff * F), D / B)``, under which a compute-bound layer's elementwise traffic costs nothing."""
_IMAGE_OVERHEADS = ("forward_image_overhead_s", "backward_image_overhead_s")
_SPLIT_TABLES = ("tp_overhead_s", "tp_slowdown", "ep_overhead_s", "ep_slowdown")
"""Tables keyed by tensor- or expert-parallel degree: fixed seconds per split call, and extra seconds per charged
second."""
_EFFICIENCY_EXTRAS = ("backward_value", "forward_overhead_s", "backward_overhead_s", *_IMAGE_OVERHEADS, *_SPLIT_TABLES)
"""Optional numbers of an efficiency entry besides ``value`` (not provenance)."""


@dataclass(frozen=True, eq=False)
class HardwareProfile:
    """One device kind's numbers, validated; build it with :func:`parse_profile` or :func:`load_profile`."""

    name: str
    device: str
    devices_per_node: int
    peak_flops_per_s: Mapping[str, float]
    """dtype -> peak dense FLOP/s."""
    memory_bytes_per_s: float
    """Device memory bandwidth, bytes per second."""
    memory_capacity_bytes: float
    efficiency: Mapping[str, float]
    """Layer kind (or ``"default"``) -> achieved fraction of peak, in (0, 1]."""
    links: Mapping[tuple[str, str], LinkCost]
    """(link class, collective) -> cost."""
    provenance: Mapping[str, Mapping[str, Any]]
    """Dotted field path (``"links.intra_node.p2p"``, ``"peak_flops_per_s.bf16"``) -> provenance."""
    source_path: str | None = None
    notes: str = ""
    backward_efficiency: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Layer kind -> efficiency of its backward, for the entries that give ``backward_value``."""
    call_overhead_s: Mapping[str, tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    """Layer kind -> (forward, backward) fixed seconds per call, for the entries that give either."""
    image_overhead_s: Mapping[str, tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    """Layer kind -> (forward, backward) fixed seconds per image beyond a microbatch's first, for the
    entries that give either."""
    tp_overhead_s: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    """(layer kind, tensor-parallel degree) -> (forward, backward) fixed seconds per call of the split
    layer beyond what the cost model charges for the split, for the entries that give them."""
    tp_slowdown: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    """(layer kind, tensor-parallel degree) -> (forward, backward) extra seconds of the split layer per
    second the cost model charges for it, for the entries that give them."""
    ep_overhead_s: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    """(layer kind, expert-parallel degree) -> (forward, backward) fixed seconds per call of the layer with its
    routed experts spread over that many ranks, beyond what the cost model charges for it."""
    ep_slowdown: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=lambda: MappingProxyType({}))
    """(layer kind, expert-parallel degree) -> (forward, backward) extra seconds of such a layer per second the
    cost model charges for it."""
    optimizer_update_bytes_per_s: float | None = None
    """Measured rate of the optimizer update; None: it runs at :attr:`memory_bytes_per_s`."""
    devices_per_package: int = 1
    """Devices of one package joined by the :data:`PACKAGE_LINK_CLASS` link (2 on a 910C counted by die); 1:
    every device its own package, the link classes are intra- and inter-node only."""
    tp_comm_overlap: float | None = None
    """Fraction in [0, 1] of the tensor-parallel all-reduce (reduce-scatter / all-gather) time hidden behind
    the layer's GEMMs (Transformer Engine's comm-GEMM overlap); None (absent from the file): 0, every
    tensor-parallel collective exposed."""
    host: HostCosts | None = None
    """The host's seconds per kernel issued and per sync (:mod:`~mpipe_tune.cost._kernel_model`); None: free."""
    kernel_efficiency: KernelEfficiency | None = None
    """Efficiency curves by kernel shape (:mod:`~mpipe_tune.cost._kernel_model`); None: per-kind efficiencies."""

    comm_compute_overlap: float | None = None
    """Share in [0, 1] of a data-parallel or sharding collective's time that the compute running beside it
    hides (1: the two run side by side at full speed; 0: they take turns); None (absent from the file): 1,
    full overlap (:mod:`mpipe_tune.profiler._overlap` measures it)."""

    fsdp_host_s: float = 0.0
    """Host seconds torch FSDP2 adds per sharded layer per forward or backward call (its hooks;
    :mod:`mpipe_tune.profiler._fsdp_host` measures it); 0 where the profile does not give it."""

    fsdp_bytes_s: float = 0.0
    """Host seconds torch FSDP2 adds per byte of a layer's unsharded buffer per all-gather or reduce-scatter it
    issues (its copies into and out of the flat buffers; measured with :attr:`fsdp_host_s`); 0 where the
    profile does not give it."""

    fsdp_collective_s: float = 0.0
    """Seconds each all-gather or reduce-scatter torch FSDP2 issues takes beyond what the links price it at (its
    collectives back to back; measured with :attr:`fsdp_host_s`); 0 where the profile does not give it."""

    fsdp_tensor_s: float = 0.0
    """Host seconds torch FSDP2 adds per parameter tensor of a layer per all-gather or reduce-scatter it issues for
    the layer (its per-tensor views, copies and parameter swaps around the collective; measured with
    :attr:`fsdp_host_s` on layers of several tensors); 0 where the profile does not give it."""

    fabric: Fabric | None = None
    """Pods joined by an oversubscribed spine, where the profile gives them; None: one non-blocking fabric."""

    @property
    def overlap_share(self) -> float:
        """:attr:`comm_compute_overlap`, 1 where the profile does not give it."""
        return 1.0 if self.comm_compute_overlap is None else self.comm_compute_overlap

    @property
    def tp_comm_exposed(self) -> float:
        """Share of the tensor-parallel collective time left on the critical path (1 - :attr:`tp_comm_overlap`)."""
        return 1.0 - (self.tp_comm_overlap or 0.0)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``."""
        if dtype not in self.peak_flops_per_s:
            raise MpipeError(
                f"profile {self.name!r} has no peak_flops_per_s for {dtype!r}; it has {sorted(self.peak_flops_per_s)}: "
                f"pick one of those as the dtype or add {dtype!r} to the profile",
                quantities=("dtype",))
        return self.peak_flops_per_s[dtype]

    def slow_dtype_note(self, dtype: str, *, factor: float = 4.0) -> str | None:
        """One line when the peak for ``dtype`` is more than ``factor`` times below the profile's best
        training dtype's (fp32, tf32, bf16 or fp16; e.g. bf16 on a CPU without native bf16 matmuls),
        else ``None``."""
        training = [d for d in _TRAINING_DTYPES if d in self.peak_flops_per_s] or list(self.peak_flops_per_s)
        best = max(training, key=self.peak_flops_per_s.__getitem__)
        ratio = self.peak_flops_per_s[best] / self.peak(dtype)
        if ratio <= factor:
            return None
        return (f"profile {self.name!r} peaks at {self.peak(dtype) / 1e12:.3g} TFLOP/s in {dtype}, {ratio:.0f}x below its "
                f"{best} peak ({self.peak_flops_per_s[best] / 1e12:.3g} TFLOP/s): a {dtype} plan is planned and run "
                f"slow; plan with dtype {best} unless {dtype} is what the training will use")

    def efficiency_for(self, kind: str) -> float:
        """Efficiency of layer kind ``kind``'s forward (its entry's ``value``), or the ``"default"`` one's."""
        return self.efficiency.get(kind, self.efficiency["default"])

    def backward_efficiency_for(self, kind: str) -> float:
        """Efficiency of ``kind``'s backward: its entry's ``backward_value``, else the entry's ``value``
        (the entry is ``kind``'s, or ``"default"`` when the profile has none for ``kind``)."""
        entry = kind if kind in self.efficiency else "default"
        return self.backward_efficiency.get(entry, self.efficiency[entry])

    def attention_core_efficiency_for(self, kind: str, *, backward: bool = False) -> float:
        """Efficiency of the attention core inside a ``kind`` layer: the :data:`ATTENTION_CORE` entry's
        (its ``backward_value`` for the backward), else the same as the rest of the layer."""
        entry = ATTENTION_CORE if ATTENTION_CORE in self.efficiency else kind
        return self.backward_efficiency_for(entry) if backward else self.efficiency_for(entry)

    def linear_efficiency_for(self, kind: str, dtype: str, *, backward: bool = False) -> float:
        """Efficiency of a ``kind`` layer's linear GEMMs in a ``dtype`` step: the :data:`FP8_LINEAR` entry's
        for fp8 where the profile has one, else the kind's."""
        entry = FP8_LINEAR if dtype == "fp8" and FP8_LINEAR in self.efficiency else kind
        return self.backward_efficiency_for(entry) if backward else self.efficiency_for(entry)

    def memory_bound_efficiency(self, *, backward: bool = False) -> float | None:
        """Achieved fraction of the memory bandwidth of the memory-bound kernels (the :data:`MEMORY_BOUND`
        entry's ``value``, or its ``backward_value`` for the backward); None where the profile has no entry."""
        if MEMORY_BOUND not in self.efficiency:
            return None
        return self.backward_efficiency_for(MEMORY_BOUND) if backward else self.efficiency[MEMORY_BOUND]

    def calibrated(self, kind: str) -> bool:
        """Whether ``kind``'s own efficiency entry gives fixed seconds per call: it was fitted to the runtime's own
        layer timings (``profile --calibrate``), which hold its kernels' issue and their shapes' efficiency as the
        layer runs them, so the kernel model (curves, an inline host's issue) stands back for it."""
        return kind in self.call_overhead_s

    def call_overhead_for(self, kind: str) -> tuple[float, float]:
        """(forward, backward) fixed seconds per call of a ``kind`` layer; (0, 0) unless its entry (or
        ``"default"``'s, when the profile has none for ``kind``) gives them."""
        entry = kind if kind in self.efficiency else "default"
        return self.call_overhead_s.get(entry, (0.0, 0.0))

    def image_overhead_for(self, kind: str) -> tuple[float, float]:
        """(forward, backward) fixed seconds per image beyond a microbatch's first for a ``kind`` layer
        (its entry's, or ``"default"``'s when the profile has none for ``kind``); (0, 0) unless given."""
        entry = kind if kind in self.efficiency else "default"
        return self.image_overhead_s.get(entry, (0.0, 0.0))

    def tp_overhead_for(self, kind: str, tp_degree: int) -> tuple[float, float]:
        """(forward, backward) fixed seconds per call of a ``kind`` layer split over ``tp_degree`` ranks
        (its entry's, or ``"default"``'s when the profile has none for ``kind``); (0, 0) unless that
        entry gives them for that degree."""
        entry = kind if kind in self.efficiency else "default"
        return self.tp_overhead_s.get((entry, tp_degree), (0.0, 0.0))

    def tp_slowdown_for(self, kind: str, tp_degree: int) -> tuple[float, float]:
        """(forward, backward) extra seconds per charged second of a ``kind`` layer split over
        ``tp_degree`` ranks (its entry's, or ``"default"``'s when the profile has none for ``kind``);
        (0, 0) unless that entry gives them for that degree."""
        entry = kind if kind in self.efficiency else "default"
        return self.tp_slowdown.get((entry, tp_degree), (0.0, 0.0))

    def ep_overhead_for(self, kind: str, ep_degree: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """((forward, backward) fixed seconds per call, (forward, backward) extra seconds per charged second) of a
        ``kind`` layer with its routed experts over ``ep_degree`` ranks: its own entry's, else none."""
        key = (kind, ep_degree)
        return self.ep_overhead_s.get(key, (0.0, 0.0)), self.ep_slowdown.get(key, (0.0, 0.0))

    @property
    def prices_fsdp2(self) -> bool:
        """Whether the profile gives any of torch FSDP2's host figures (per call, byte, collective or tensor)."""
        return any(getattr(self, key) > 0 for key in _FSDP_KEYS)

    @property
    def update_bytes_per_s(self) -> float:
        """Bytes per second of the optimizer update: the measured rate, else the memory bandwidth."""
        return self.optimizer_update_bytes_per_s or self.memory_bytes_per_s

    def link(self, collective: str, *, inter_node: bool = False, link_class: str | None = None) -> LinkCost:
        """Cost of ``collective`` on the intra- or inter-node link class (or on ``link_class`` when given),
        falling back to the class's ``p2p``."""
        if collective not in COLLECTIVES:
            raise MpipeError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
        link_class = link_class or ("inter_node" if inter_node else "intra_node")
        return self.links.get((link_class, collective), self.links[(link_class, "p2p")])

    def link_class_spanning(self, span_devices: int) -> str:
        """The link class of a group whose members lie within ``span_devices`` consecutive devices from a
        package's (and node's) first: :data:`PACKAGE_LINK_CLASS` within one package, ``intra_node`` within
        one node, else ``inter_node``.

        >>> from mpipe_tune.cost import load_profile
        >>> die = load_profile("ascend-910c-cm384-die")
        >>> [die.link_class_spanning(n) for n in (2, 16, 32)]
        ['intra_package', 'intra_node', 'inter_node']
        """
        if span_devices <= self.devices_per_package > 1:
            return PACKAGE_LINK_CLASS
        return "intra_node" if span_devices <= self.devices_per_node else "inter_node"

    def link_spanning(self, collective: str, span_devices: int) -> LinkCost:
        """Cost of ``collective`` over a group spanning ``span_devices`` consecutive devices
        (:meth:`link_class_spanning`)."""
        return self.link(collective, link_class=self.link_class_spanning(span_devices))

    def link_class_between(self, first_device: int, second_device: int) -> str:
        """The link class between two devices by their global indices (packages and nodes hold consecutive
        devices)."""
        if self.devices_per_package > 1 and \
                first_device // self.devices_per_package == second_device // self.devices_per_package:
            return PACKAGE_LINK_CLASS
        same_node = first_device // self.devices_per_node == second_device // self.devices_per_node
        return "intra_node" if same_node else "inter_node"

    def to_dict(self) -> dict[str, Any]:
        """The profile as its JSON form (schema version 1); ``parse_profile(p.to_dict())`` equals ``p``."""

        def number(path: str, value: float) -> dict[str, Any]:
            return {"value": value, **thaw(self.provenance[path])}

        links: dict[str, dict[str, Any]] = {}
        for (link_class, collective), cost in self.links.items():
            path = f"links.{link_class}.{collective}"
            links.setdefault(link_class, {})[collective] = {
                "alpha_s": cost.alpha_s,
                "beta_s_per_byte": cost.beta_s_per_byte,
                **({} if cost.mesh_links is None else {"mesh_links": cost.mesh_links}),
                **thaw(self.provenance[path]),
            }
        data = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "device": self.device,
            "devices_per_node": self.devices_per_node,
            **({} if self.devices_per_package == 1 else {"devices_per_package": self.devices_per_package}),
            "peak_flops_per_s": {
                d: number(f"peak_flops_per_s.{d}", v) for d, v in self.peak_flops_per_s.items()
            },
            "memory_bytes_per_s": number("memory_bytes_per_s", self.memory_bytes_per_s),
            "memory_capacity_bytes": number("memory_capacity_bytes", self.memory_capacity_bytes),
            "efficiency": {k: self._efficiency_entry(k) for k in self.efficiency},
            "links": links,
        }
        if self.optimizer_update_bytes_per_s is not None:
            data["optimizer_update_bytes_per_s"] = number("optimizer_update_bytes_per_s",
                                                          self.optimizer_update_bytes_per_s)
        for key in _OVERLAP_FIXES:
            if getattr(self, key) is not None:
                data[key] = number(key, getattr(self, key))
        for key in _FSDP_KEYS:
            if key in self.provenance:
                data[key] = number(key, getattr(self, key))
        if self.fabric is not None:
            data["fabric"] = {key: number(f"fabric.{key}", getattr(self.fabric, key)) for key in _FABRIC_KEYS}
        if self.host is not None:
            data["host"] = host_dict(self.host, self.provenance, thaw)
        if self.kernel_efficiency is not None:
            data["kernel_efficiency"] = kernel_efficiency_dict(self.kernel_efficiency, self.provenance, thaw)
        if self.notes:
            data["notes"] = self.notes
        return data

    def _efficiency_entry(self, kind: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"value": self.efficiency[kind]}
        if kind in self.backward_efficiency:
            entry["backward_value"] = self.backward_efficiency[kind]
        if kind in self.call_overhead_s:
            entry["forward_overhead_s"], entry["backward_overhead_s"] = self.call_overhead_s[kind]
        if kind in self.image_overhead_s:
            entry["forward_image_overhead_s"], entry["backward_image_overhead_s"] = self.image_overhead_s[kind]
        for key in _SPLIT_TABLES:
            table = getattr(self, key)
            degrees = sorted(degree for k, degree in table if k == kind)
            if degrees:
                entry[key] = {str(degree): list(table[(kind, degree)]) for degree in degrees}
        return {**entry, **thaw(self.provenance[f"efficiency.{kind}"])}

    @cached_property
    def _hash(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def content_hash(self) -> str:
        """sha256 hex digest of the canonical JSON of the data (not of ``source_path``)."""
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HardwareProfile):
            return NotImplemented
        return self.content_hash() == other.content_hash()

    def __hash__(self) -> int:
        return hash(self.content_hash())



# ---------------------------------------------------------------------------------------- parsing


def parse_profile(data: Mapping, *, where: str) -> HardwareProfile:
    """Validate ``data`` (the JSON form) and build the profile; ``where`` names it in messages."""
    v = Validator(where)
    if not isinstance(data, Mapping):
        v.fail("", data, "must be a JSON object", "write the profile as an object of fields")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        v.fail(unknown[0], data[unknown[0]], "is not a profile field",
               f"remove it or use one of {sorted(_TOP_KEYS)}")
    for key in sorted(_TOP_KEYS - _OPTIONAL_TOP_KEYS):
        if key not in data:
            v.fail(key, MISSING, "is required", "add it (see profiles/ideal.json for the format)")
    if data["schema_version"] != SCHEMA_VERSION or isinstance(data["schema_version"], bool):
        v.fail("schema_version", data["schema_version"], f"must be {SCHEMA_VERSION}",
               "convert the file to schema version 1")
    name = v.text("name", data["name"])
    device = v.text("device", data["device"])
    notes = v.text("notes", data["notes"]) if "notes" in data else ""
    dpn = data["devices_per_node"]
    if not isinstance(dpn, int) or isinstance(dpn, bool) or dpn < 1:
        v.fail("devices_per_node", dpn, "must be an integer >= 1", "give the devices in one node")
    per_package = data.get("devices_per_package", 1)
    if not isinstance(per_package, int) or isinstance(per_package, bool) or per_package < 1 or dpn % per_package:
        v.fail("devices_per_package", per_package, f"must be an integer >= 1 that divides devices_per_node ({dpn})",
               "give the devices (dies) of one package, 2 for a 910C counted by die")

    peaks = v.table("peak_flops_per_s", data["peak_flops_per_s"], allowed=DTYPES)
    peak_flops = {d: v.number(f"peak_flops_per_s.{d}", e, positive=True) for d, e in peaks.items()}
    memory_bps = v.number("memory_bytes_per_s", data["memory_bytes_per_s"], positive=True)
    capacity = v.number("memory_capacity_bytes", data["memory_capacity_bytes"], positive=True)
    update_bps = (v.number("optimizer_update_bytes_per_s", data["optimizer_update_bytes_per_s"], positive=True)
                  if "optimizer_update_bytes_per_s" in data else None)

    effs = v.table("efficiency", data["efficiency"], allowed=None)
    if "default" not in effs:
        v.fail("efficiency.default", MISSING, "is required", 'add {"value": 1.0, "source": "assumed"}')
    efficiency, backward_efficiency, call_overhead, image_overhead = {}, {}, {}, {}
    split_tables: dict[str, dict[tuple[str, int], tuple[float, float]]] = {key: {} for key in _SPLIT_TABLES}
    for kind, entry in effs.items():
        path = f"efficiency.{kind}"
        efficiency[kind] = v.efficiency(f"{path}.value", v.number(path, entry, positive=True,
                                                                    extras=_EFFICIENCY_EXTRAS))
        if "backward_value" in entry:
            backward = v.scalar(f"{path}.backward_value", entry["backward_value"], positive=True)
            backward_efficiency[kind] = v.efficiency(f"{path}.backward_value", backward)
        if "forward_overhead_s" in entry or "backward_overhead_s" in entry:
            call_overhead[kind] = tuple(
                v.scalar(f"{path}.{key}", entry[key], positive=False) if key in entry else 0.0
                for key in ("forward_overhead_s", "backward_overhead_s"))
        if any(key in entry for key in _IMAGE_OVERHEADS):
            image_overhead[kind] = tuple(
                v.scalar(f"{path}.{key}", entry[key], positive=False) if key in entry else 0.0
                for key in _IMAGE_OVERHEADS)
        for key in _SPLIT_TABLES:
            if key in entry:
                split_tables[key].update({(kind, tp): pair for tp, pair in v.tp_table(f"{path}.{key}", entry[key]).items()})

    overlaps = {}
    for key, fix in _OVERLAP_FIXES.items():
        if key in data:
            overlaps[key] = v.number(key, data[key], positive=False)
            if overlaps[key] > 1:
                v.fail(f"{key}.value", overlaps[key], "must lie in [0, 1]", fix)
    fsdp = {key: v.number(key, data[key], positive=False) for key in _FSDP_KEYS if key in data}
    host = parse_host(v, data["host"]) if "host" in data else None
    fabric = _parse_fabric(v, data["fabric"], dpn) if "fabric" in data else None
    curves = parse_kernel_efficiency(v, data["kernel_efficiency"]) if "kernel_efficiency" in data else None
    classes = v.table("links", data["links"], allowed=(*LINK_CLASSES, PACKAGE_LINK_CLASS))
    if (PACKAGE_LINK_CLASS in classes) != (per_package > 1):
        v.fail(f"links.{PACKAGE_LINK_CLASS}", classes.get(PACKAGE_LINK_CLASS, MISSING),
               f"must be given exactly when devices_per_package ({per_package}) is above 1",
               "give both (the dies of a package and the link between them) or neither")
    links = {}
    for link_class in (*LINK_CLASSES, *([PACKAGE_LINK_CLASS] if per_package > 1 else [])):
        if link_class not in classes:
            v.fail(f"links.{link_class}", MISSING, "is required",
                   "add the link class with at least a p2p entry")
        entries = v.table(f"links.{link_class}", classes[link_class], allowed=COLLECTIVES)
        if "p2p" not in entries:
            v.fail(f"links.{link_class}.p2p", MISSING, "is required",
                   "add a p2p entry; other collectives fall back to it")
        for collective, entry in entries.items():
            links[(link_class, collective)] = v.link(f"links.{link_class}.{collective}", entry)

    return HardwareProfile(
        name=name, device=device, devices_per_node=dpn, devices_per_package=per_package,
        peak_flops_per_s=MappingProxyType(peak_flops), memory_bytes_per_s=memory_bps,
        memory_capacity_bytes=capacity, efficiency=MappingProxyType(efficiency),
        links=MappingProxyType(links), provenance=MappingProxyType(v.provenance),
        notes=notes, backward_efficiency=MappingProxyType(backward_efficiency),
        call_overhead_s=MappingProxyType(call_overhead), image_overhead_s=MappingProxyType(image_overhead),
        **{key: MappingProxyType(table) for key, table in split_tables.items()}, optimizer_update_bytes_per_s=update_bps,
        tp_comm_overlap=overlaps.get("tp_comm_overlap"), comm_compute_overlap=overlaps.get("comm_compute_overlap"),
        host=host, kernel_efficiency=curves, **fsdp, fabric=fabric,
    )


_FABRIC_KEYS = ("devices_per_pod", "pod_oversubscription")
_FSDP_KEYS = ("fsdp_host_s", "fsdp_bytes_s", "fsdp_collective_s", "fsdp_tensor_s")


def _parse_fabric(v: Validator, entry: Any, devices_per_node: int) -> Fabric:
    table = v.table("fabric", entry, allowed=_FABRIC_KEYS)
    for key in _FABRIC_KEYS:
        if key not in table:
            v.fail(f"fabric.{key}", MISSING, "is required", "give both the devices of a pod and the spine's oversubscription")
    pod = v.number("fabric.devices_per_pod", table["devices_per_pod"], positive=True)
    if pod != int(pod) or pod % devices_per_node:
        v.fail("fabric.devices_per_pod.value", pod, f"must be a whole number of nodes ({devices_per_node} devices each)",
               "give the devices one pod holds")
    ratio = v.number("fabric.pod_oversubscription", table["pod_oversubscription"], positive=True)
    if ratio < 1:
        v.fail("fabric.pod_oversubscription.value", ratio, "must be >= 1", "give 7 for a 1:7 spine, 1 for none")
    return Fabric(int(pod), ratio)


# ------------------------------------------------------------------------------------ load / dump



def _builtin_dir() -> Path:
    try:
        return Path(str(importlib.resources.files("mpipe_tune.profiles")))
    except ModuleNotFoundError:  # running from a source checkout without installing
        return Path(__file__).resolve().parents[2] / "profiles"


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the tool (file stems in ``profiles/``), sorted."""
    return sorted(p.stem for p in _builtin_dir().glob("*.json"))


def load_profile(spec: str | os.PathLike) -> HardwareProfile:
    """Load a built-in profile by name (``"h100-sxm"``) or a profile JSON file by path."""
    text = os.fspath(spec)
    is_path = not isinstance(spec, str) or text.endswith(".json") or os.sep in text or "/" in text
    if is_path:
        path = Path(text)
    elif text in builtin_profiles():
        path = _builtin_dir() / f"{text}.json"
    else:
        raise MpipeError(
            f"unknown hardware profile {text!r}; built-in profiles: {', '.join(builtin_profiles())}; "
            "or give the path of a profile .json file"
        )
    data = load_data_file(path, "profile", as_json=True)
    return replace(parse_profile(data, where=str(path)), source_path=str(path))


def dump_profile(profile_dict: Mapping | HardwareProfile, path: str | os.PathLike) -> None:
    """Validate, then write the profile as JSON to ``path`` atomically (temporary file + rename; a
    command's last safe point for Ctrl-C, see :func:`~mpipe_tune.outputs._files.write_together`)."""
    from mpipe_tune.outputs import write_together

    data = profile_dict.to_dict() if isinstance(profile_dict, HardwareProfile) else dict(profile_dict)
    parse_profile(data, where=os.fspath(path))
    write_together([(path, lambda tmp: tmp.write_text(to_json(data) + "\n", encoding="utf-8"))])


def hierarchical_all_reduce_s(profile: HardwareProfile, size_bytes: float, group_size: int, stride: int) -> float:
    """An all-reduce over ``group_size`` ranks placed one every ``stride`` devices, as NCCL runs it
    across nodes: with ``k`` members on each node (``devices_per_node / stride``, at most the group),
    a ring reduce-scatter inside each node, a ring all-reduce of each rank's ``1/k`` share across the
    nodes over the rank's own inter-node link, and a ring all-gather inside the node. One node: the
    intra-node ring all-reduce; one member per node: the inter-node ring all-reduce of everything (each read
    off its link's measured sweep where the link has one over that many ranks, :func:`measured_collective_s`).
    Across the pods of the profile's :attr:`~HardwareProfile.fabric` the inter-node bytes slow by
    :func:`~mpipe_tune.cost._collectives.spine_slowdown`.

    >>> from mpipe_tune.cost import load_profile
    >>> h100 = load_profile("h100-sxm")
    >>> flat = hierarchical_all_reduce_s(h100, 8e9, 16, 8)  # tp8: one member per node
    >>> split = hierarchical_all_reduce_s(h100, 8e9, 16, 1)  # two full nodes: 8 NICs share the bytes
    >>> round(flat / split, 1)
    5.9
    """
    if group_size == 1:
        return 0.0
    per_node, nodes = _members_per_node(profile, group_size, stride)
    intra = profile.link("all_reduce", inter_node=False)
    if nodes == 1:
        return measured_collective_s(intra, "all_reduce", size_bytes, group_size)
    inter = profile.link("all_reduce", inter_node=True)
    slowdown = spine_slowdown(profile.fabric, group_size, stride, per_node)
    if slowdown > 1.0:
        inter = replace(inter, beta_s_per_byte=inter.beta_s_per_byte * slowdown, curve=None)
    return (measured_collective_s(intra, "all_reduce", size_bytes, per_node)
            + measured_collective_s(inter, "all_reduce", size_bytes / per_node, nodes))


def _members_per_node(profile: HardwareProfile, group_size: int, stride: int) -> tuple[int, int]:
    """(members on each node, nodes) of a group of ``group_size`` ranks placed one every ``stride`` devices."""
    per_node = max(1, min(group_size, profile.devices_per_node // stride)) if stride <= profile.devices_per_node else 1
    return per_node, -(-group_size // per_node)


SHARDED_HALVES = ("reduce_scatter", "all_gather")
"""The two halves of a sharded data-parallel reduce (ZeRO): the gradients' reduce-scatter, the weights' all-gather."""


def sharded_half_s(profile: HardwareProfile, collective: str, size_bytes: float, group_size: int, stride: int) -> float:
    """One half of a sharded data-parallel reduce over ``group_size`` ranks placed one every ``stride`` devices:
    the ``reduce_scatter`` of ``size_bytes`` of gradients or the ``all_gather`` of ``size_bytes`` of weights.

    Where the profile measured ``reduce_scatter`` on its intra-node links (profiles from the profiler of this
    version on, which measure both halves) and the group lies in one node, each half is timed on its own
    measured link: on gloo a reduce-scatter runs at about half an all-reduce's rate, nowhere near the half of
    its time a ring would take. Else, as NCCL's ring runs them, each is half of the
    :func:`hierarchical_all_reduce_s` of the bytes.

    >>> from mpipe_tune.cost import load_profile
    >>> h100 = load_profile("h100-sxm")
    >>> sharded_half_s(h100, "all_gather", 8e9, 8, 1) == hierarchical_all_reduce_s(h100, 8e9, 8, 1) / 2
    True
    """
    assert collective in SHARDED_HALVES, collective
    if group_size == 1:
        return 0.0
    if ("intra_node", "reduce_scatter") in profile.links and _members_per_node(profile, group_size, stride)[1] == 1:
        return measured_collective_s(profile.link(collective), collective, size_bytes, group_size)
    return hierarchical_all_reduce_s(profile, size_bytes, group_size, stride) / 2
