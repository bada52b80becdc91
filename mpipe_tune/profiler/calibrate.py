"""Per-layer-kind efficiency: time the runtime's own layer modules and fit the roofline to them.

For each distinct layer (kind and dimensions) of a model, the runtime's module
(:func:`mpipe_tune.runtime.layers.build_layer`) runs a training forward and a backward on synthetic
microbatches of a few token counts; the cost model's FLOPs and bytes for the same layer and
microbatch (:func:`mpipe_tune.cost.arch.estimate_arch_work`) and the profile's measured peak and
bandwidth then give, per kind, the efficiency that makes ``max(W / (eff * F), D / B)`` follow the
measured medians best (:func:`~mpipe_tune.profiler.fit.fit_efficiency`).

The backward is compared with the weight gradient plus, when the layer's input needs a gradient (every
kind but ``patch_embed`` and ``embedding``, which are timed on no input tensor), the input gradient: what
the cost model charges a trainable layer in the middle of a model. Growth over token counts stops for a
layer once one forward plus backward takes longer than the settings allow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

from mpipe_tune.algebra.model import Model
from mpipe_tune.cost import arch
from mpipe_tune.cost.layers import DTYPE_BYTES
from mpipe_tune.cost.workload import Microbatch
from mpipe_tune.profiler.device import Timer
from mpipe_tune.profiler.roofline import TORCH_DTYPES
from mpipe_tune.profiler.settings import SweepSettings
from mpipe_tune.profiler.stats import Spread, summarize

_NO_INPUT_KINDS = ("patch_embed", "embedding")


@dataclass(frozen=True)
class LayerPoint:
    """One layer timed on one microbatch size, forward or backward, with the cost model's work for it."""

    layer_name: str
    kind: str
    tokens: int
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
    """Forward and backward medians of each distinct layer of ``model`` at the settings' token counts."""
    from mpipe_tune.runtime.blueprint import blueprint, output_shape
    from mpipe_tune.runtime.data import MicrobatchInputs
    from mpipe_tune.runtime.layers import build_layer

    specs = blueprint(model)
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    where = torch.device(device)
    timer = Timer(torch, device)
    points: list[LayerPoint] = []
    for index in calibration_layers(model):
        spec, layer = specs[index], model.layers[index]
        module = build_layer(replace(spec, trainable=True), seed=0, dtype=torch_dtype, device=where)
        has_input = spec.kind not in _NO_INPUT_KINDS
        for position, tokens in enumerate(settings.calibration_tokens):
            mb = Microbatch(image_tokens=tokens, text_tokens=tokens)
            inputs = MicrobatchInputs(mb, 0, 0, torch_dtype, where)
            x = None
            if has_input:
                x = torch.randn(output_shape(specs[index - 1], mb), dtype=torch_dtype, device=where)
                x.requires_grad_(True)
            fwd_s, bwd_s = _time_training_step(torch, timer, module, x, inputs, settings)
            work = arch.estimate_arch_work(layer.cost.kind, layer.cost.dims_dict(), mb,
                                           dtype_bytes=DTYPE_BYTES[dtype])
            bwd_flops = work.wgrad_flops + (work.dgrad_flops if has_input else 0.0)
            bwd_bytes = work.wgrad_bytes + (work.dgrad_bytes if has_input else 0.0)
            points.append(LayerPoint(layer.name, spec.kind, tokens, "fwd", work.fwd_flops, work.fwd_bytes, fwd_s))
            points.append(LayerPoint(layer.name, spec.kind, tokens, "bwd", bwd_flops, bwd_bytes, bwd_s))
            progress(f"layer {layer.name} {tokens} tokens")
            if fwd_s.median + bwd_s.median > settings.calibration_max_point_s:
                for skipped in settings.calibration_tokens[position + 1:]:
                    progress(f"layer {layer.name} {skipped} tokens (skipped)")
                break
        del module
    return points


def _time_training_step(torch, timer: Timer, module, x, inputs, settings: SweepSettings) -> tuple[Spread, Spread]:
    """Medians of a forward that records autograd, and of the backward from its output."""
    outputs: list = []
    fwd, bwd = [], []
    for repeat in range(max(1, settings.warmup) + settings.repeats):
        outputs.clear()
        fwd_s = timer.seconds_per_call(lambda: outputs.append(module(x, inputs)))
        y = outputs[0]
        grad = None if y.dim() == 0 else torch.ones_like(y)
        bwd_s = timer.seconds_per_call(lambda: torch.autograd.backward(y, grad))
        if repeat >= max(1, settings.warmup):
            fwd.append(fwd_s)
            bwd.append(bwd_s)
    return summarize(fwd), summarize(bwd)
