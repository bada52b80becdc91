"""A layer's passes as kernels: how many the host issues, and each one timed at its shape's efficiency.

:func:`pass_kernels` counts the kernels of a layer's forward, input-gradient and weight-gradient passes under a
kernel mode (:data:`~mpipe_tune.cost._kernel_model.KERNEL_MODES`) from its
:class:`~mpipe_tune.cost._arch_pieces.Piece` list; :func:`host_pass_seconds` turns them into the host's issue
seconds. :func:`shaped_pass_seconds` times each pass kernel by kernel with the profile's curves
(:mod:`~mpipe_tune.cost._kernel_model`): a GEMM at ``eff_gemm(m, n, k)`` of the peak (the forward's
``rows x out`` reducing over ``in``, the input gradient's ``rows x in`` over ``out``, the weight gradient's
``in x out`` over ``rows``; in an fp8 step the curve's shape under the profile's ``fp8_linear`` efficiency
against the fp8 peak, where it has one), the attention core at ``eff_attention(L)`` per sequence, a memory-bound kernel at
``eff_memory(bytes per kernel)`` of the bandwidth (an index kernel at ``eff_index`` where the profile gives that
curve), each the larger of its compute and memory time; a
family the profile gives no curve for runs at the per-kind efficiencies as before. Communication pieces are
timed by the collectives' model elsewhere and counted here only as kernels the host issues.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mpipe_tune.cost._arch_pieces import Piece, maximum
from mpipe_tune.cost._kernel_model import _rolloff
from mpipe_tune.cost._profile import FP8_LINEAR, HardwareProfile

PASSES = ("fwd", "dgrad", "wgrad")
REFERENCE_HEAD_DIM = 128
"""The head dimension the attention curve's ``max`` describes (every fit run's: Llama, GLM, Qwen 7B and up, GPT-3
175B). A narrower head runs its scores and values matmuls with a short reduction or output width: the core's rate
scales by the GEMM curve's roll-off ``s(d) / s(128)``, ``s(x) = x / (x + half_dim)``, and a wider one by 1 (no
fit run shows it faster)."""
NATIVE_ATTENTION_MODES = ("eager", "compiled")
"""Kernel modes whose trainer calls torch's own attention (``scaled_dot_product_attention``), timed at the attention
curve's ``native_ratio`` where the profile gives one; the others call the fused stack's kernel (Transformer Engine)."""


def pass_kernels(pieces: Sequence[Piece], mode: str) -> tuple:
    """Kernels of the (forward, input-gradient, weight-gradient) passes under kernel ``mode``: ``eager``
    counts each piece's eager kernels, ``fused`` and ``graphs`` its fused ones, ``compiled`` the fused ones
    with each run of memory-bound pieces (between GEMMs, attention cores and collectives) one kernel.

    >>> from mpipe_tune.cost._arch_pieces import pointwise
    >>> p = pointwise(1, 1, 1, kernels=(3.0, 2.0, 0.0), fused_kernels=(1.0, 1.0, 0.0))
    >>> pass_kernels([p, p], "eager"), pass_kernels([p, p], "fused"), pass_kernels([p, p], "compiled")
    ((6.0, 4.0, 0.0), (2.0, 2.0, 0.0), (1.0, 1.0, 0.0))
    """
    fused = mode != "eager"
    totals = [0.0, 0.0, 0.0]
    in_run = [False, False, False]
    for piece in pieces:
        counts = piece.kernels_of(fused)
        memory = piece.family == "memory"
        for index in range(3):
            count = counts[index]
            if mode == "compiled" and memory and np.all(np.asarray(count) > 0):
                totals[index] = totals[index] + (0.0 if in_run[index] else 1.0)
                in_run[index] = True
                continue
            totals[index] = totals[index] + count
            if np.any(np.asarray(count) > 0):
                in_run[index] = False
    return tuple(totals)


def host_pass_seconds(pieces: Sequence[Piece], mode: str, dispatch_s: float) -> tuple:
    """Host seconds issuing each pass: its kernels times ``dispatch_s``; under ``graphs`` one graph launch per
    pass that has kernels."""
    counts = pass_kernels(pieces, mode)
    if mode == "graphs":
        return tuple(np.where(np.asarray(c) > 0, dispatch_s, 0.0) for c in counts)
    return tuple(c * dispatch_s for c in counts)


def shaped_pass_seconds(pieces: Sequence[Piece], kind: str, profile: HardwareProfile, dtype: str,
                        dtype_bytes: int, mode: str = "fused") -> tuple:
    """((forward, dgrad, wgrad) seconds, (forward, dgrad, wgrad) compute-bound share of them) of a layer's
    pieces, kernel by kernel (see the module docstring), under kernel ``mode`` (``eager``: a piece's eager
    kernels' traffic, :meth:`~mpipe_tune.cost._arch_pieces.Piece.bytes_moved`); collectives are left out."""
    curves = profile.kernel_efficiency
    peak = profile.peak(dtype)
    other_peak = profile.peak("bf16") if dtype == "fp8" else peak
    bandwidth = profile.memory_bytes_per_s
    kind_eff = (profile.efficiency_for(kind), profile.backward_efficiency_for(kind))
    memory_eff = (profile.memory_bound_efficiency(), profile.memory_bound_efficiency(backward=True))
    fp8_top = None  # an fp8 step's GEMMs: the curve's shape under the profile's fp8_linear efficiency
    if dtype == "fp8" and FP8_LINEAR in profile.efficiency:
        fp8_top = tuple(profile.linear_efficiency_for(kind, dtype, backward=b) for b in (False, True))
    seconds, compute = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    for piece in pieces:
        family = piece.family
        if family == "comm":
            continue
        for index, phase in enumerate(PASSES):
            flops = getattr(piece, f"{phase}_flops")
            moved = piece.bytes_moved(index, dtype_bytes, mode == "eager")
            if not np.any(flops) and not np.any(moved):
                continue
            backward = index > 0
            if family == "gemm":
                if curves.gemm is not None:
                    rows, out, inner = piece.gemm_shape
                    m, n, k = ((rows, out, inner), (rows, inner, out), (inner, out, rows))[index]
                    top = fp8_top[backward] if fp8_top is not None else curves.gemm.max
                    eff = maximum(curves.gemm.efficiency(m, n, k) * (top / curves.gemm.max), 1e-6)
                else:
                    eff = profile.linear_efficiency_for(kind, dtype, backward=backward)
                compute_s = flops / (eff * peak)
                memory_s = moved / bandwidth
            elif family == "attention":
                compute_s = _attention_compute_s(piece, flops, kind, profile, backward, other_peak,
                                                 native=mode in NATIVE_ATTENTION_MODES)
                memory_s = moved / bandwidth
            else:
                compute_s = flops / (kind_eff[backward] * other_peak)
                kernels = piece.kernels[index]
                curve = curves.index if piece.index and curves.index is not None else curves.memory
                if curve is not None:
                    per_kernel = moved / maximum(kernels, 1.0)
                    eff = maximum(curve.efficiency(per_kernel), 1e-6)
                else:
                    eff = memory_eff[backward] or 1.0
                memory_s = moved / (eff * bandwidth)
            seconds[index] = seconds[index] + maximum(compute_s, memory_s)
            compute[index] = compute[index] + np.where(compute_s >= memory_s, compute_s, 0.0)
    return tuple(seconds), tuple(compute)


def _attention_compute_s(piece: Piece, flops, kind: str, profile: HardwareProfile, backward: bool, peak: float,
                         native: bool = False):
    """The attention core's compute seconds: its FLOPs shared over its sequences by their squares, each
    sequence at ``eff_attention(L)`` (``sum s^2 (s + half) / s = sum s (s + half)`` over ``max``; ``native``:
    the curve's top for the framework's own kernel, :meth:`~mpipe_tune.cost._kernel_model.AttentionCurve.top`)."""
    curve = profile.kernel_efficiency.attention
    if curve is None or not piece.seq_lens:
        return flops / (profile.attention_core_efficiency_for(kind, backward=backward) * peak)
    gemm = profile.kernel_efficiency.gemm
    if gemm is not None and piece.head_dim:  # a narrower head than the fit runs' 128 rolls off as a GEMM dimension
        peak = peak * min(1.0, _rolloff(piece.head_dim, gemm.half_dim) / _rolloff(REFERENCE_HEAD_DIM, gemm.half_dim))
    squares = sum(np.asarray(s, dtype=float) ** 2 for s in piece.seq_lens)
    stretched = sum(np.asarray(s, dtype=float) * (np.asarray(s, dtype=float) + curve.half_seq) for s in piece.seq_lens)
    ratio = np.where(squares > 0, stretched / np.where(squares > 0, squares, 1.0), 1.0)
    return flops * ratio / (curve.top(native) * peak)
