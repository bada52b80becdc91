"""Alpha-beta costs of messages and collectives on a profile's links.

A link entry of a profile (:mod:`~mpipe_tune.cost._profile`) is a :class:`LinkCost`; :func:`estimate_collective_s`
times one collective on it (:func:`~mpipe_tune.cost._profile.hierarchical_all_reduce_s` an all-reduce whose
ranks span nodes, on a profile's two link classes). A profile's optional :class:`Fabric` describes the network
above the nodes where it is not one non-blocking tree: pods joined by an oversubscribed spine, which slows a
data-parallel ring that leaves its pod where the rings leaving a pod ask more than the spine carries
(:func:`spine_slowdown`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipe_tune.errors import MpipeError

COLLECTIVES = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta cost of one message step: ``alpha_s + beta_s_per_byte * size_bytes`` seconds."""

    alpha_s: float
    """Latency per step, seconds."""
    beta_s_per_byte: float
    """Inverse bandwidth, seconds per byte (``1 / bytes_per_s``)."""
    mesh_links: int | None = None
    """Direct links whose combined bandwidth ``beta_s_per_byte`` is, on a full-mesh link class (each device
    wired to each peer by its own link): a collective over ``g`` ranks then uses only ``min(g - 1, mesh_links)``
    of them. None: a switched fabric, every group size sees the full bandwidth."""
    curve: tuple[str, int, tuple[float, ...], tuple[float, ...]] | None = None
    """A measured link's sweep: (its collective, group size, message sizes in bytes, the median seconds at
    each), which :func:`measured_collective_s` reads for a gradient reduce's large messages. None: a stated
    link."""



@dataclass(frozen=True)
class Fabric:
    """The scale-out network as pods of ``devices_per_pod`` devices, full bisection bandwidth inside each, joined
    by a spine that carries ``1 / pod_oversubscription`` of what the pod's devices can inject (the Llama 3 paper's
    RoCE cluster: pods of 3,072 GPUs, 1:7 at the aggregation layer, arXiv:2407.21783 section 3.3.1)."""

    devices_per_pod: int
    pod_oversubscription: float
    """Injection bandwidth of a pod's devices over the spine bandwidth it has (>= 1; 1: non-blocking)."""


def spine_slowdown(fabric: Fabric | None, group_size: int, stride: int, rings_per_group: int = 1) -> float:
    """Factor on the inter-node seconds per byte of a ring collective over ``group_size`` ranks placed one every
    ``stride`` devices, each group running ``rings_per_group`` rings across the nodes (one per member a node holds).

    Groups are placed pod-aligned in rank order, so a group inside one pod (``group_size * stride`` devices at
    most a pod) never touches the spine, and a ring that spans pods leaves each pod by one edge. Every group of
    its kind (``stride`` of them, the devices between two members) runs the collective at once, as the
    data-parallel groups of every other position do at the step's end (an upper bound): ``stride *
    rings_per_group`` rings leave each pod (at most one per device), each edge at a device's link rate, against
    a spine that carries ``devices_per_pod / pod_oversubscription`` of them. A ring runs at its slowest edge, so
    its bytes slow by ``max(1, rings * pod_oversubscription / devices_per_pod)``.

    >>> pods = Fabric(3072, 7.0)
    >>> spine_slowdown(pods, 64, 128), spine_slowdown(pods, 64, 8)  # the Llama 3 paper's DP 64: 128 rings, 1 pod
    (1.0, 1.0)
    >>> spine_slowdown(pods, 4, 4096)  # one member per pod, every device's ring edge leaves its pod
    7.0
    """
    if fabric is None or group_size * stride <= fabric.devices_per_pod:
        return 1.0
    rings = min(stride * rings_per_group, fabric.devices_per_pod)
    return max(1.0, rings * fabric.pod_oversubscription / fabric.devices_per_pod)


def estimate_collective_s(link: LinkCost, collective: str, size_bytes: float, group_size: int) -> float:
    """Seconds for ``collective`` of ``size_bytes`` over ``group_size`` ranks on ``link``.

    ``size_bytes`` is the message for ``p2p``, the reduced buffer for ``all_reduce``, the full
    (gathered) buffer for ``all_gather``, ``gather`` and ``scatter``, the full buffer before it is
    scattered for ``reduce_scatter``, and for ``all_to_all`` the buffer
    each rank holds before the exchange (``1/g`` of it stays on the rank). With ``a`` = alpha,
    ``b`` = beta, ``n`` = size and ``g`` = group size:

    - ``p2p``: ``a + b*n`` (``g`` is ignored except that ``g == 1`` costs nothing);
    - ``all_reduce`` (ring: reduce-scatter then all-gather): ``2(g-1) * (a + b*n/g)``;
    - ``all_gather`` and ``reduce_scatter`` (ring), ``gather`` and ``scatter`` (linear, root link bound):
      ``(g-1) * (a + b*n/g)``;
    - ``all_to_all`` (pairwise exchange: ``g-1`` steps, each sending one ``n/g`` share to another
      rank, so ``n*(g-1)/g`` bytes leave each rank): ``(g-1) * (a + b*n/g)``.

    A group of one costs 0.0. An empty payload (``n == 0``) with ``g > 1`` still pays the alpha terms.
    On a full mesh (``link.mesh_links`` = ``k``, the links ``b`` is the combined bandwidth of) a group of ``g``
    ranks drives only ``min(g - 1, k)`` of them, so every collective but ``p2p`` runs at
    ``b * k / min(g - 1, k)`` per byte (:func:`mesh_beta_s_per_byte`); the step count is unchanged.

    >>> estimate_collective_s(LinkCost(1e-5, 1e-9), "all_reduce", 4e6, 4)
    0.00606
    """
    assert np.all(np.asarray(size_bytes) >= 0) and group_size >= 1, (size_bytes, group_size)
    if collective not in COLLECTIVES:
        raise MpipeError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    if group_size == 1:
        return 0.0
    n = size_bytes * 1.0 if isinstance(size_bytes, np.ndarray) else float(size_bytes)  # an array: elementwise
    a, b, g = link.alpha_s, link.beta_s_per_byte, group_size
    if collective == "p2p":
        return a + b * n
    b = mesh_beta_s_per_byte(link, g)
    steps = 2 * (g - 1) if collective == "all_reduce" else g - 1
    return steps * (a + b * n / g)


def mesh_beta_s_per_byte(link: LinkCost, group_size: int) -> float:
    """Seconds per byte a collective over ``group_size`` ranks sees on ``link``: ``beta_s_per_byte``, or on a
    full mesh of ``k = link.mesh_links`` direct links (``beta`` their combined rate) ``beta * k / min(g - 1, k)``,
    as a group of ``g`` ranks reaches its ``g - 1`` peers over one direct link each.

    >>> mesh_beta_s_per_byte(LinkCost(0.0, 1.0, mesh_links=7), 2), mesh_beta_s_per_byte(LinkCost(0.0, 1.0, 7), 8)
    (7.0, 1.0)
    """
    if link.mesh_links is None or group_size < 2:
        return link.beta_s_per_byte
    return link.beta_s_per_byte * link.mesh_links / min(group_size - 1, link.mesh_links)


def monotone_fit(values) -> np.ndarray:
    """The non-decreasing sequence nearest ``values`` in least squares (pool-adjacent-violators): a run of
    sizes whose medians fall is replaced by its mean, so a noisy size neither lowers the sizes above it to its
    fast reading nor raises those below it.

    >>> monotone_fit([1.0, 3.0, 2.0, 4.0, 0.5]).tolist()
    [1.0, 2.375, 2.375, 2.375, 2.375]
    """
    sums: list[float] = []
    counts: list[int] = []
    for v in np.asarray(values, dtype=float):
        sums.append(float(v))
        counts.append(1)
        while len(sums) > 1 and sums[-2] * counts[-1] > sums[-1] * counts[-2]:
            s, c = sums.pop(), counts.pop()
            sums[-1] += s
            counts[-1] += c
    return np.repeat(np.array(sums) / np.array(counts), counts)


def measured_collective_s(link: LinkCost, collective: str, size_bytes, group_size: int):
    """``collective`` of ``size_bytes`` over ``group_size`` ranks on ``link``, read off the link's measured
    sweep where it has one of that collective over that group size, else :func:`estimate_collective_s`.

    The fitted line weighs every size of the sweep alike, so at the tens of MiB of a data-parallel gradient
    reduce it can be far from the measurement (on a CPU a reduce-scatter's seconds per byte double past the
    caches). The sweep's medians, made non-decreasing in the size by :func:`monotone_fit` (a run that falls
    is read at its mean: gloo's latency on a shared host is bimodal, and the fastest reading is not what a
    step meets), are interpolated linearly in the size; below the smallest size it takes that
    size's time, above the largest it grows at the last segment's seconds per byte or in proportion to the size
    (bandwidth-bound), whichever is steeper: a short sweep (``profile --quick``'s, to 64 KiB) ends where the
    latency still hides the bandwidth, and its last segment alone would price megabytes at a few microseconds.

    >>> link = LinkCost(0.0, 1.0, curve=("all_reduce", 2, (1e6, 4e6), (1e-3, 5e-3)))
    >>> [round(measured_collective_s(link, "all_reduce", n, 2), 6) for n in (5e5, 2e6, 8e6)]
    [0.001, 0.002333, 0.010333]
    >>> measured_collective_s(link, "all_reduce", 4.0, 4) == estimate_collective_s(link, "all_reduce", 4.0, 4)
    True
    >>> short = LinkCost(0.0, 1.0, curve=("all_reduce", 2, (1e3, 4e3), (1e-3, 1.1e-3)))  # latency-bound to its end
    >>> round(measured_collective_s(short, "all_reduce", 4e6, 2), 6)  # in proportion: 1000x the size, 1000x the time
    1.1
    """
    if link.curve is None or link.curve[:2] != (collective, group_size):
        return estimate_collective_s(link, collective, size_bytes, group_size)
    _, _, sizes, seconds = link.curve
    x = np.asarray(sizes, dtype=float)
    y = monotone_fit(seconds)
    slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), y[-1] / x[-1])
    n = np.asarray(size_bytes, dtype=float)
    out = np.where(n > x[-1], y[-1] + (n - x[-1]) * slope, np.interp(n, x, y))
    return out if isinstance(size_bytes, np.ndarray) else float(out)

