"""Kernel efficiency by shape: a GEMM shape sweep, an attention sweep and a copy-size sweep, and the
curves of the profile's ``kernel_efficiency`` table fitted to them (:mod:`~mpipe_tune.profiler._curves`).

- **GEMM**: ``torch.matmul`` of ``(m, k) x (k, n)`` operands, from 16-wide squares to the shapes of a
  transformer layer at 64-8,192 tokens a micro-batch (among them micro-batch 1 at 600-2,700 tokens) and
  small to large hidden sizes: ``(tokens, h, h)``, ``(tokens, 3h, h)``, ``(tokens, h, 4h)``. Efficiency:
  ``2 m n k / seconds`` over the profile's peak for the dtype. A shape the peak says would take longer
  than ``max_call_s`` a call is skipped.
- **Attention core**: ``scaled_dot_product_attention`` as the runtime calls it (causal, as its decoder
  attention runs), batch 1, ``heads`` heads of ``head_dim``, forward and backward, for growing sequence
  lengths until a forward plus backward takes longer than ``attention_max_call_s``. FLOPs as the cost
  model counts them: ``4 L^2 d`` per head forward (the full square, causal or not), twice that backward;
  the curve is fitted to forward plus backward (``3x`` the forward FLOPs over their seconds), each
  phase's efficiency is kept beside.
- **Memory-bound kernels**: ``dst.copy_(src)`` of 4 KiB .. ``memory_sizes_bytes[-1]``; efficiency: bytes
  read and written per second over the profile's memory bandwidth.

On an accelerator a call's seconds are the device's where the queue runs ahead of the host: calls that
take less than ``HOST_BOUND_FACTOR`` times ``dispatch_s`` are timed at the host's issue rate, not the
kernel's, and are kept in the entry (``host_bound``) but left out of the fit. On CPU each call runs on
the issuing thread, its dispatch and its work one after the other, and the profile's host issues
``inline`` (the cost model charges a pass its kernels' issue time plus their device time): the curves
are fitted net of dispatch, each call's seconds less the issue time the cost model charges for the same
kernels (:data:`CALL_KERNELS`: one ``dispatch_s`` for a GEMM or a copy, the attention core's forward and
backward kernels for an attention call), so that issue plus curve gives back the whole call. A CPU call
under ``HOST_BOUND_FACTOR`` times its issue time leaves too little net of it to fit and is left out too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mpipe_tune.cost import ATTENTION_BWD_KERNELS, AttentionCurve, MemoryCurve
from mpipe_tune.profiler._curves import CurveFit, fit_gemm, fit_saturation
from mpipe_tune.profiler._device import Timer, time_repeats
from mpipe_tune.profiler._roofline import TORCH_DTYPES
from mpipe_tune.profiler._stats import Spread, summarize

KiB = 2**10
HOST_BOUND_FACTOR = 2.0
"""A call under this many times its issue cost is timed at the host's rate: kept out of the fits."""
CALL_KERNELS = {"gemm": 1.0, "attention": 1.0 + ATTENTION_BWD_KERNELS, "memory": 1.0}
"""Kernels the cost model issues for one timed call of each family (:mod:`~mpipe_tune.cost._arch_pieces`): a
matmul, the attention core's forward and its backward (the call timed is forward plus backward), a copy."""


@dataclass(frozen=True)
class KernelSweepSettings:
    """How much of each kernel family to measure."""

    dispatch_lengths: tuple[int, ...]
    """Chain lengths of the dispatch measurement (:mod:`~mpipe_tune.profiler._dispatch`)."""
    dispatch_repeats: int
    gemm_shapes: tuple[tuple[int, int, int], ...]
    """``(m, n, k)`` shapes, in the order timed."""
    max_call_s: float
    """Skip a GEMM the peak says takes longer than this a call."""
    attention_lengths: tuple[int, ...]
    attention_heads: int
    head_dim: int
    attention_max_call_s: float
    """Stop growing the sequence once a forward plus backward takes longer than this."""
    memory_sizes_bytes: tuple[int, ...]
    repeats: int
    min_repeat_s: float
    """One timed repeat batches calls until it lasts at least this long."""

    @property
    def num_points(self) -> int:
        """Progress steps: one per chain length, GEMM shape, sequence length and copy size."""
        return (len(self.dispatch_lengths) + len(self.gemm_shapes) + len(self.attention_lengths)
                + len(self.memory_sizes_bytes))


def layer_gemms(tokens: Sequence[int], hiddens: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """A transformer layer's GEMM shapes: ``(t, h, h)`` (attention output), ``(t, 3h, h)`` (fused QKV),
    ``(t, h, 4h)`` (MLP down) for every token count and hidden size.

    >>> layer_gemms([600], [128])
    ((600, 128, 128), (600, 384, 128), (600, 128, 512))
    """
    return tuple((t, n, k) for t in tokens for h in hiddens for n, k in ((h, h), (3 * h, h), (h, 4 * h)))


def kernel_sweep_settings(device: str, *, quick: bool) -> KernelSweepSettings:
    """The sweep for ``device``, or the ``--quick`` one (a second or two on CPU)."""
    if quick:
        return KernelSweepSettings(
            dispatch_lengths=(16, 64, 256), dispatch_repeats=5,
            gemm_shapes=((16, 16, 16), (64, 64, 64), (128, 128, 128)) + layer_gemms((64, 600), (64, 128)),
            max_call_s=0.01, attention_lengths=(64, 128, 256), attention_heads=2, head_dim=32,
            attention_max_call_s=0.05, memory_sizes_bytes=(256 * KiB, 1024 * KiB, 4096 * KiB),
            repeats=3, min_repeat_s=5e-4)
    squares = tuple((s, s, s) for s in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
    if device == "cpu":
        return KernelSweepSettings(
            dispatch_lengths=(16, 64, 256, 1024), dispatch_repeats=15,
            gemm_shapes=squares + layer_gemms((64, 256, 600, 1024, 2700), (128, 256, 512, 1024, 2048)),
            max_call_s=0.05, attention_lengths=(64, 128, 256, 512, 1024, 2048, 4096, 8192), attention_heads=4,
            head_dim=64, attention_max_call_s=0.3,
            memory_sizes_bytes=tuple(4 * KiB * 4**k for k in range(8)),  # 4 KiB .. 64 MiB
            repeats=5, min_repeat_s=1e-2)
    return KernelSweepSettings(
        dispatch_lengths=(16, 64, 256, 1024), dispatch_repeats=20,
        gemm_shapes=squares + ((8192, 8192, 8192),)
        + layer_gemms((1, 64, 256, 600, 1024, 2700, 4096, 8192), (512, 1024, 2048, 4096, 8192)),
        max_call_s=0.05, attention_lengths=(64, 128, 256, 512, 1024, 2048, 4096, 8192), attention_heads=16,
        head_dim=128, attention_max_call_s=0.5,
        memory_sizes_bytes=tuple(4 * KiB * 4**k for k in range(10)),  # 4 KiB .. 1 GiB
        repeats=10, min_repeat_s=2e-3)


@dataclass(frozen=True)
class ShapePoint:
    """One timed kernel: its size (``(m, n, k)``, a sequence length or bytes) and seconds per call."""

    size: tuple[int, ...]
    seconds: Spread
    backward: Spread | None = None
    """Attention: the forward plus backward's seconds (``seconds`` is the forward's)."""


@dataclass(frozen=True)
class KernelSweeps:
    """Everything the kernel sweeps timed, in one dtype."""

    dtype: str
    gemm: tuple[ShapePoint, ...]
    attention: tuple[ShapePoint, ...]
    memory: tuple[ShapePoint, ...]
    attention_heads: int
    head_dim: int
    units: int | None
    """Compute units as the device reports them (CPU: the process's threads); None: fitted."""
    skipped_gemms: tuple[tuple[int, int, int], ...] = ()


def compute_units(torch: ModuleType, device: str) -> int | None:
    """Units a GEMM's tiles are spread over: CPU threads, CUDA SMs, Ascend cube cores where torch_npu says."""
    if device == "cpu":
        return torch.get_num_threads()
    properties = getattr(torch, device).get_device_properties(0)
    for name in ("multi_processor_count", "cube_core_num"):
        if getattr(properties, name, None):
            return int(getattr(properties, name))
    return None


def measure_kernels(torch: ModuleType, device: str, dtype: str, settings: KernelSweepSettings, *,
                    peak_flops_per_s: float, progress: Callable[[str], None]) -> KernelSweeps:
    """Time the GEMM, attention and copy sweeps in ``dtype``; ``progress`` once per point (skipped ones too)."""
    timer = Timer(torch, device)
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])

    def timed(fn: Callable[[], object]) -> Spread:
        return summarize(time_repeats(timer, fn, warmup=2, repeats=settings.repeats,
                                      min_time_s=settings.min_repeat_s))

    gemm, skipped = [], []
    for m, n, k in settings.gemm_shapes:
        if 2.0 * m * n * k / peak_flops_per_s > settings.max_call_s:
            skipped.append((m, n, k))
            progress(f"gemm {m}x{n}x{k} (skipped)")
            continue
        a = torch.randn(m, k, device=device, dtype=torch_dtype)
        b = torch.randn(k, n, device=device, dtype=torch_dtype)
        gemm.append(ShapePoint((m, n, k), timed(lambda: torch.matmul(a, b))))
        del a, b
        progress(f"gemm {m}x{n}x{k}")
    attention = []
    for index, length in enumerate(settings.attention_lengths):
        shape = (1, settings.attention_heads, length, settings.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=torch_dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device=device, dtype=torch_dtype)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.no_grad():
            forward = timed(lambda: sdpa(q, k, v, is_causal=True))
        both = timed(lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad))
        attention.append(ShapePoint((length,), forward, both))
        del q, k, v, grad
        progress(f"attention {length}")
        if both.median > settings.attention_max_call_s:
            for rest in settings.attention_lengths[index + 1:]:
                progress(f"attention {rest} (skipped)")
            break
    memory = []
    for size in settings.memory_sizes_bytes:
        src = torch.ones(size // 4, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        memory.append(ShapePoint((size,), timed(lambda: dst.copy_(src))))
        del src, dst
        progress(f"copy {size // KiB} KiB")
    return KernelSweeps(dtype, tuple(gemm), tuple(attention), tuple(memory), settings.attention_heads,
                        settings.head_dim, compute_units(torch, device), tuple(skipped))


def attention_fwd_flops(length: int, heads: int, head_dim: int) -> float:
    """The attention core's forward FLOPs as the cost model counts them: scores and values, the full square."""
    return 4.0 * length * length * head_dim * heads


def kernel_efficiency_entries(sweeps: KernelSweeps, *, peak_flops_per_s: float, bytes_per_s: float,
                              dispatch_s: float, device: str, measured: Mapping[str, str],
                              how: str = "") -> dict[str, Any]:
    """The profile's ``kernel_efficiency`` table: each family's curve fitted to its points."""
    inline = device == "cpu"

    def rates(points: Sequence[ShapePoint], family: str, work: Callable[[ShapePoint], float], roof: float,
              seconds: Callable[[ShapePoint], float] = lambda p: p.seconds.median):
        """The points the curve is fitted to and their efficiencies: on an accelerator the calls not timed at
        the host's issue rate, on CPU (inline) each call net of its issue time, where enough is left."""
        issue_s = CALL_KERNELS[family] * dispatch_s
        kept, effs = [], []
        for p in points:
            s = seconds(p)
            if s >= HOST_BOUND_FACTOR * (issue_s if inline else dispatch_s):
                kept.append(p)
                effs.append(work(p) / (s - issue_s if inline else s) / roof)
        return kept, effs

    where = (f"on {device}, each call's seconds net of its issue time (the host issues inline: the cost model "
             f"adds a pass's issue time to its device time), {dispatch_s:.3g} s dispatch_s a kernel" if inline
             else f"on {device}, device-event seconds per call")
    left_out = (f"calls under {HOST_BOUND_FACTOR:g}x their issue time are left out of the fit (host_bound)"
                if inline else f"calls under {HOST_BOUND_FACTOR:g}x dispatch_s are timed at the host's issue "
                f"rate and left out of the fit (host_bound)")
    entries: dict[str, Any] = {}

    gemm_kept, gemm_eff = rates(sweeps.gemm, "gemm", lambda p: 2.0 * p.size[0] * p.size[1] * p.size[2], peak_flops_per_s)
    if len(gemm_kept) >= 2:
        fit = fit_gemm([p.size for p in gemm_kept], gemm_eff, units=sweeps.units)
        c = fit.curve
        units = (f"units {c.units} as the device reports them" if sweeps.units is not None
                 else f"units {c.units} fitted from candidates")
        entries["gemm"] = {
            "max": c.max, "half_dim": c.half_dim, "tile_m": c.tile_m, "tile_n": c.tile_n, "units": c.units,
            **measured, **_fit_fields(fit),
            "ref": f"torch.matmul of (m, k) x (k, n) in {sweeps.dtype} {where}, {len(gemm_kept)} shapes; "
                   f"efficiency 2mnk / seconds / the profile's {sweeps.dtype} peak; max, half_dim and the tile "
                   f"sides fitted (log least squares, tiles from candidates), {units}; {left_out}{how}",
            "dtype": sweeps.dtype, "shapes": [list(p.size) for p in gemm_kept],
            "median_s": [p.seconds.median for p in gemm_kept], "efficiency": gemm_eff,
            "host_bound": [list(p.size) for p in sweeps.gemm if p not in gemm_kept],
            "skipped": [list(s) for s in sweeps.skipped_gemms],
        }

    heads, d = sweeps.attention_heads, sweeps.head_dim
    flops = lambda p: attention_fwd_flops(p.size[0], heads, d)  # noqa: E731
    att_kept, att_eff = rates(sweeps.attention, "attention", lambda p: 3.0 * flops(p), peak_flops_per_s,
                              seconds=lambda p: p.backward.median)
    if len(att_kept) >= 2:
        fit = fit_saturation(AttentionCurve, [p.size[0] for p in att_kept], att_eff,
                             work=[3.0 * flops(p) for p in att_kept])
        entries["attention"] = {
            "max": fit.curve.max, "half_seq": fit.curve.half_seq, **measured, **_fit_fields(fit),
            "ref": f"scaled_dot_product_attention, causal as the runtime's decoder attention runs, batch 1, "
                   f"{heads} heads of {d}, in {sweeps.dtype} {where}; efficiency of forward plus backward: 3 x "
                   f"4 L^2 d heads FLOPs (the cost model's count, the full square) over their seconds / the "
                   f"profile's peak; max and half_seq fitted (log least squares); {left_out}{how}",
            "dtype": sweeps.dtype, "causal": True, "heads": heads, "head_dim": d,
            "seq_lengths": [p.size[0] for p in att_kept], "efficiency": att_eff,
            "forward_median_s": [p.seconds.median for p in att_kept],
            "median_s": [p.backward.median for p in att_kept],
            "forward_efficiency": [flops(p) / (p.seconds.median - (dispatch_s if inline else 0.0)) / peak_flops_per_s
                                   for p in att_kept],
            "host_bound": [p.size[0] for p in sweeps.attention if p not in att_kept],
        }

    mem_kept, mem_eff = rates(sweeps.memory, "memory", lambda p: 2.0 * p.size[0], bytes_per_s)
    if len(mem_kept) >= 2:
        fit = fit_saturation(MemoryCurve, [2 * p.size[0] for p in mem_kept], mem_eff)
        entries["memory"] = {
            "max": fit.curve.max, "half_bytes": fit.curve.half_bytes, **measured, **_fit_fields(fit),
            "ref": f"dst.copy_(src) of fp32 tensors {where}; bytes moved (read plus written) per second over "
                   f"the large copy's rate in the same process (the profile's bandwidth but on a CPU of several "
                   f"processes, where that is each one's share while all copy at once); max and half_bytes fitted "
                   f"(log least squares); a size that fits in a cache can run above that bandwidth; {left_out}{how}",
            "bytes": [2 * p.size[0] for p in mem_kept], "median_s": [p.seconds.median for p in mem_kept],
            "efficiency": mem_eff, "host_bound": [2 * p.size[0] for p in sweeps.memory if p not in mem_kept],
        }
    return entries


def _fit_fields(fit: CurveFit) -> dict[str, Any]:
    return {"fit_r2": fit.fit_r2, "fit_r2_efficiency": fit.fit_r2_efficiency,
            "rms_relative_error": fit.rms_relative_error, "predicted_efficiency": list(fit.predicted)}
