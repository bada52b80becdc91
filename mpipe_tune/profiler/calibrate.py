"""Per-layer-kind efficiency and call overhead: time the runtime's own layer modules, fit the roofline.

For each distinct layer (kind and dimensions) of a model, the runtime's module
(:func:`mpipe_tune.runtime.layers.build_layer`) runs a training forward and a backward on synthetic
microbatches of a few sizes; the cost model's FLOPs and bytes for the same layer and microbatch
(:func:`mpipe_tune.cost.arch.estimate_arch_work`) and the profile's measured peak and bandwidth then
give, per kind and per phase (forward, backward), the efficiency and the fixed seconds per call that
make ``overhead + max(W / (eff * F), D / B)`` follow the measured medians best
(:func:`fit_layer_timing`). A size of ``n`` tokens means ``n`` rows through the layer: a text
sequence of ``n`` tokens, and one image of ``n`` ViT patches (``n / merge_factor`` image tokens) for
the image-stream kinds, so that a ViT block and a decoder block are timed on matrices of one size.

The layers are timed as they run in a pipeline stage, not each on its own: the distinct layers are
chained in model order (one of each kind and dimensions: patch embedding, ViT block, merger, embedding,
decoder block, LM head) and every repeat is a training forward through the chain then a backward back
through it, each layer's call timed separately, each on a fresh microbatch whose synthetic inputs
(pixels, token ids, targets) the modules draw as they do in a run. A layer called twice in a row on
the same tensors keeps its weights and activations in cache and ran 10-25% faster on a CPU than the
same layer inside a stage. The backward of a layer that received a tensor from the chain (all but the
first) includes its input gradient, as the cost model charges a trainable layer in the middle of a
model. Growth over sizes stops once one layer's forward plus backward takes longer than the settings
allow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType

import numpy as np

from mpipe_tune.algebra.model import ArchCost, Model
from mpipe_tune.cost import arch
from mpipe_tune.algebra.candidate import DTYPE_BYTES
from mpipe_tune.inputs.workload import Microbatch
from mpipe_tune.profiler.device import Timer
from mpipe_tune.profiler.roofline import TORCH_DTYPES
from mpipe_tune.profiler.settings import SweepSettings
from mpipe_tune.profiler.stats import Spread, summarize

@dataclass(frozen=True)
class LayerPoint:
    """One layer timed on one microbatch size, forward or backward, with the cost model's work for it."""

    layer_name: str
    kind: str
    tokens: int
    """Rows through the layer: text tokens, or ViT patches for an image-stream kind."""
    phase: str
    """``"fwd"`` or ``"bwd"``."""
    flops: float
    bytes_moved: float
    seconds: Spread


def calibration_layers(model: Model) -> list[int]:
    """Indices of the layers to time: the first of each distinct (kind, dimensions) (no torch needed).

    A model the runtime cannot build is a one-line MpipeError from its blueprint.
    """
    from mpipe_tune.runtime.blueprint import blueprint

    specs = blueprint(model)
    first: dict[tuple, int] = {}
    for spec in specs:
        first.setdefault((spec.kind, spec.dims), spec.index)
    return sorted(first.values())


def time_layers(torch: ModuleType, device: str, model: Model, dtype: str, settings: SweepSettings,
                progress: Callable[[str], None]) -> list[LayerPoint]:
    """Forward and backward medians of each distinct layer of ``model``, timed in a chain (see the module
    docstring), at the settings' sizes."""
    from mpipe_tune.runtime.blueprint import blueprint
    from mpipe_tune.runtime.layers import build_layer

    specs = blueprint(model)
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    where = torch.device(device)
    chain = calibration_layers(model)
    modules = [build_layer(replace(specs[i], trainable=True), seed=0, dtype=torch_dtype, device=where) for i in chain]
    timer = Timer(torch, device)
    points: list[LayerPoint] = []
    for position, tokens in enumerate(settings.calibration_tokens):
        mb = calibration_microbatch(model, tokens)
        fwd, bwd, fed = _time_chain(torch, timer, specs, chain, modules, mb, torch_dtype, where, settings)
        too_long = False
        for k, index in enumerate(chain):
            layer = model.layers[index]
            work = arch.estimate_arch_work(layer.cost.kind, layer.cost.dims_dict(), mb, dtype_bytes=DTYPE_BYTES[dtype])
            bwd_flops = work.wgrad_flops + (work.dgrad_flops if fed[k] else 0.0)
            bwd_bytes = work.wgrad_bytes + (work.dgrad_bytes if fed[k] else 0.0)
            fwd_s, bwd_s = summarize(fwd[k]), summarize(bwd[k])
            points.append(LayerPoint(layer.name, specs[index].kind, tokens, "fwd", work.fwd_flops, work.fwd_bytes, fwd_s))
            points.append(LayerPoint(layer.name, specs[index].kind, tokens, "bwd", bwd_flops, bwd_bytes, bwd_s))
            progress(f"layer {layer.name} {tokens} tokens")
            too_long = too_long or fwd_s.median + bwd_s.median > settings.calibration_max_point_s
        if too_long:
            for skipped in settings.calibration_tokens[position + 1:]:
                for index in chain:
                    progress(f"layer {model.layers[index].name} {skipped} tokens (skipped)")
            break
    return points


def _time_chain(torch, timer: Timer, specs, chain: list[int], modules: list, mb: Microbatch, dtype, where,
                settings: SweepSettings) -> tuple[list[list[float]], list[list[float]], list[bool]]:
    """Per chained layer, its forward and backward seconds over the repeats, and whether it was fed a
    tensor by the layer before it (and so computes an input gradient)."""
    from mpipe_tune.runtime.blueprint import output_shape
    from mpipe_tune.runtime.data import MicrobatchInputs

    n = len(chain)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    fed = [False] * n
    warmup = max(1, settings.warmup)
    for repeat in range(warmup + settings.repeats):
        inputs = MicrobatchInputs(mb, repeat, 0, dtype, where)  # fresh draws, as each microbatch of a run
        y = None
        saved = []
        for k, index in enumerate(chain):
            x = None
            if index > 0:
                shape = output_shape(specs[index - 1], mb)
                fed[k] = y is not None and tuple(y.shape) == tuple(shape)
                x = y.detach() if fed[k] else torch.randn(shape, dtype=dtype, device=where)
                x.requires_grad_(True)
            outputs: list = []
            seconds = timer.seconds_per_call(lambda: outputs.append(modules[k](x, inputs)))
            y = outputs[0]
            saved.append((x, y))
            if repeat >= warmup:
                fwd[k].append(seconds)
        grad = None
        for k in reversed(range(n)):
            x, y = saved[k]
            out_grad = None if y.dim() == 0 else (grad if grad is not None else torch.ones_like(y))
            seconds = timer.seconds_per_call(lambda: torch.autograd.backward(y, out_grad))
            if repeat >= warmup:
                bwd[k].append(seconds)
            grad = None
            if x is not None and fed[k]:
                grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return fwd, bwd, fed


def calibration_microbatch(model: Model, tokens: int) -> Microbatch:
    """A microbatch of ``tokens`` text tokens and one image of about ``tokens`` ViT patches.

    >>> from mpipe_tune.specs import load_model
    >>> calibration_microbatch(load_model("tiny-vit-llm"), 64)
    Microbatch(image_tokens=16, text_tokens=64, images=())
    """
    merge = next((layer.cost.dims_dict()["merge_factor"] for layer in model.layers
                  if isinstance(layer.cost, ArchCost) and "merge_factor" in layer.cost.dims_dict()), 1)
    return Microbatch(image_tokens=max(1, math.ceil(tokens / merge)), text_tokens=tokens)


@dataclass(frozen=True)
class LayerFit:
    """``overhead_s + max(W / (efficiency * F), D / B)`` fitted to one phase of one layer kind."""

    efficiency: float
    overhead_s: float
    rms_relative_error: float
    """Root mean square of ``(predicted - measured) / measured`` over the points."""
    predicted_s: tuple[float, ...]


MIN_SIZES_FOR_OVERHEAD = 3
"""Distinct work sizes a group of points needs before a per-call overhead is fitted besides the
efficiency (two parameters from two sizes would follow any noise exactly)."""


def fit_layer_timing(flops: Sequence[float], bytes_moved: Sequence[float], times_s: Sequence[float], *,
                     peak_flops_per_s: float, bytes_per_s: float) -> LayerFit:
    """The efficiency in (0, 1] and overhead >= 0 minimising the relative error against ``times_s``.

    For each efficiency on a logarithmic grid from 1e-6 to 1 (0.1% steps) the best overhead has a
    closed form (relative least squares, clipped at 0); the pair with the smallest error wins. With
    fewer than :data:`MIN_SIZES_FOR_OVERHEAD` distinct FLOP counts the overhead is 0.

    >>> f = fit_layer_timing([1e9, 2e9, 4e9], [0, 0, 0], [0.011, 0.021, 0.041],
    ...                      peak_flops_per_s=1e11, bytes_per_s=1e10)
    >>> round(f.efficiency, 2), round(f.overhead_s, 4), round(f.rms_relative_error, 4)
    (1.0, 0.001, 0.0)
    """
    t = np.asarray(times_s, dtype=float)
    w = np.asarray(flops, dtype=float)
    assert t.ndim == 1 and len(t) >= 1 and np.all(t > 0) and w.shape == t.shape, (w, t)
    grid = np.geomspace(1e-6, 1.0, 13_817)  # ratio 1.001 between neighbours
    roof = np.maximum(w[None, :] / (grid[:, None] * peak_flops_per_s),
                      np.asarray(bytes_moved, dtype=float)[None, :] / bytes_per_s)
    if len(np.unique(w)) >= MIN_SIZES_FOR_OVERHEAD:
        inv2 = 1.0 / t**2
        overhead = np.maximum(0.0, ((t - roof) * inv2).sum(axis=1) / inv2.sum())
    else:
        overhead = np.zeros(len(grid))
    predicted = roof + overhead[:, None]
    errors = np.sqrt(np.mean(((predicted - t) / t) ** 2, axis=1))
    best = int(np.argmin(errors))
    return LayerFit(float(grid[best]), float(overhead[best]), float(errors[best]),
                    tuple(float(x) for x in predicted[best]))
