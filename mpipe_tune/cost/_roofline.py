"""The roofline of one layer's passes: compute seconds at the profile's efficiencies, the per-kind roofline of
each pass (one roofline, or three with the profile's memory-bound entry), ring attention's exposed exchange, the
per-image calls, and the split of a pass's seconds by what bounds it. :mod:`mpipe_tune.cost._layers` composes them
into the layer table (its module docstring states the model); the shaped, kernel-by-kernel form is
:mod:`mpipe_tune.cost._kernel_passes`'s.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.cost import _arch as arch
from mpipe_tune.cost._arch_pieces import maximum
from mpipe_tune.cost._profile import HardwareProfile
from mpipe_tune.inputs import Microbatch


def compute_bound(work: arch.ArchWork, kind: str, profile: HardwareProfile, dtype: str, device: tuple) -> tuple:
    """Of each pass's roofline seconds ``device``, the part its compute roof sets (the whole pass where its
    compute time reaches its memory time, else none)."""
    compute = compute_seconds(work, kind, profile, dtype)[:3]
    moved = (work.fwd_bytes, work.dgrad_bytes, work.wgrad_bytes)
    return tuple(np.where(c >= b / profile.memory_bytes_per_s, d, 0.0) for c, b, d in zip(compute, moved, device))


def bound_split(device, compute, comm, host, passes, *, inline: bool = False) -> tuple:
    """Each pass's charged seconds split into (compute, memory, host, communication) summed over the passes: a
    pass whose host issue time exceeds its device and collective time counts whole as host-bound; on an
    ``inline`` host (issue and device work add up) each part counts its own seconds."""
    out = [0.0, 0.0, 0.0, 0.0]
    for d, c, m, h, total in zip(device, compute, comm, host, passes):
        host_bound = False if inline else h > d + m
        out[0] = out[0] + np.where(host_bound, 0.0, c)
        out[1] = out[1] + np.where(host_bound, 0.0, d - c)
        out[2] = out[2] + np.where(host_bound, total, h if inline else 0.0)
        out[3] = out[3] + np.where(host_bound, 0.0, m)
    return tuple(out)


def estimate_image_calls_s(profile: HardwareProfile, kind: str, mb: Microbatch) -> tuple[float, float]:
    """(forward, backward) seconds of the per-image calls beyond the first: the profile's per-image
    overhead for ``kind`` (:meth:`~mpipe_tune.cost._profile.HardwareProfile.image_overhead_for`; the ViT
    block attends inside each image, one attention call per image) times the microbatch's images less
    one. Text-stream kinds and microbatches of at most one image pay nothing."""
    if kind not in arch.IMAGE_STREAM_KINDS:
        return 0.0, 0.0
    extra = maximum(0, (mb.num_images if isinstance(mb, arch.MicrobatchArray) else len(mb.image_sizes())) - 1)
    fwd_s, bwd_s = profile.image_overhead_for(kind)
    return extra * fwd_s, extra * bwd_s


def compute_seconds(work: arch.ArchWork, kind: str, profile: HardwareProfile, dtype: str):
    """Compute-bound seconds of a layer's (forward, dgrad, wgrad, attention-core forward, attention-core
    backward): each part's FLOPs over its efficiency times its peak. The attention core runs at the
    profile's attention-core efficiency (``HardwareProfile.attention_core_efficiency_for``), the rest at
    the kind's. With ``dtype`` fp8 only the linear layers' matmuls run at the fp8 peak (at the profile's
    ``fp8_linear`` efficiency where it has one) and every other kernel at the bf16 peak (Transformer
    Engine's fp8 recipe: GEMMs in fp8; attention, norms and pointwise kernels in bf16); any other dtype
    runs everything at its own peak."""
    linear_peak = profile.peak(dtype)
    other_peak = profile.peak("bf16") if dtype == "fp8" else linear_peak
    layer_fwd, layer_bwd = profile.efficiency_for(kind), profile.backward_efficiency_for(kind)
    linear_fwd = profile.linear_efficiency_for(kind, dtype)
    linear_bwd = profile.linear_efficiency_for(kind, dtype, backward=True)
    core_fwd = work.attention_core_fwd_flops / (profile.attention_core_efficiency_for(kind) * other_peak)
    core_bwd = work.attention_core_dgrad_flops / (profile.attention_core_efficiency_for(kind, backward=True) * other_peak)

    def part(flops: float, linear: float, core: float, efficiency: float, linear_efficiency: float) -> float:
        return linear / (linear_efficiency * linear_peak) + maximum(0.0, flops - linear - core) / (efficiency * other_peak)

    return (part(work.fwd_flops, work.linear_fwd_flops, work.attention_core_fwd_flops, layer_fwd, linear_fwd) + core_fwd,
            part(work.dgrad_flops, work.linear_dgrad_flops, work.attention_core_dgrad_flops, layer_bwd, linear_bwd)
            + core_bwd,
            part(work.wgrad_flops, work.linear_wgrad_flops, 0.0, layer_bwd, linear_bwd), core_fwd, core_bwd)


def pass_seconds(work: arch.ArchWork, kind: str, profile: HardwareProfile, dtype: str) -> tuple[float, float, float]:
    """Roofline seconds of a layer's forward, dgrad and wgrad, before collectives and per-call overheads.

    Without the profile's memory-bound entry (:meth:`~mpipe_tune.cost._profile.HardwareProfile.memory_bound_efficiency`)
    each pass is one roofline, ``max(compute, bytes / B)``. With it, the pass's kernels run one after another:
    its matmuls ``max(compute, bytes / B)``, its attention core the same, and its memory-bound kernels
    (every other kernel: norms, activations, residual adds, softmax, permutes, lookups)
    ``max(compute, bytes / (eff_mem * B))``, summed."""
    fwd_c, dgrad_c, wgrad_c, core_fwd_c, core_bwd_c = compute_seconds(work, kind, profile, dtype)
    bandwidth = profile.memory_bytes_per_s
    fwd_eff, bwd_eff = profile.memory_bound_efficiency(), profile.memory_bound_efficiency(backward=True)
    if fwd_eff is None:
        return (maximum(fwd_c, work.fwd_bytes / bandwidth), maximum(dgrad_c, work.dgrad_bytes / bandwidth),
                maximum(wgrad_c, work.wgrad_bytes / bandwidth))
    peak = profile.peak("bf16") if dtype == "fp8" else profile.peak(dtype)
    fwd_layer, bwd_layer = profile.efficiency_for(kind) * peak, profile.backward_efficiency_for(kind) * peak

    def split(compute_s, total_bytes, core_s, core_bytes, mb_flops, mb_bytes, layer_flops_per_s, eff):
        mb_s = mb_flops / layer_flops_per_s
        rest_s, rest_bytes = compute_s - core_s - mb_s, total_bytes - core_bytes - mb_bytes
        return (maximum(rest_s, rest_bytes / bandwidth) + maximum(core_s, core_bytes / bandwidth)
                + maximum(mb_s, mb_bytes / (eff * bandwidth)))

    return (split(fwd_c, work.fwd_bytes, core_fwd_c, work.attention_core_fwd_bytes, work.memory_bound_fwd_flops,
                  work.memory_bound_fwd_bytes, fwd_layer, fwd_eff),
            split(dgrad_c, work.dgrad_bytes, core_bwd_c, work.attention_core_dgrad_bytes,
                  work.memory_bound_dgrad_flops, work.memory_bound_dgrad_bytes, bwd_layer, bwd_eff),
            split(wgrad_c, work.wgrad_bytes, 0.0, 0.0, work.memory_bound_wgrad_flops, work.memory_bound_wgrad_bytes,
                  bwd_layer, bwd_eff))


def exposed_ring_s(link, step_bytes: float, steps: int, core_s: float) -> float:
    """Ring-attention time beyond the core's compute ``core_s``: ``steps`` transfers of ``step_bytes``
    (``alpha + beta * n`` each), each overlapping one of the core's ``steps + 1`` equal compute steps.

    >>> from mpipe_tune.cost._profile import LinkCost
    >>> round(exposed_ring_s(LinkCost(0.0, 1e-9), 4e6, 3, 4e-3), 12), exposed_ring_s(LinkCost(0.0, 1e-9), 4e6, 3, 40e-3)
    (0.009, 0.0)
    """
    step_s = link.alpha_s + link.beta_s_per_byte * step_bytes
    return steps * maximum(0.0, step_s - core_s / (steps + 1))
