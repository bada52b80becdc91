"""Per-layer-kind efficiency and call overhead: time the runtime's own layer modules, fit the roofline.

For each distinct layer (kind and dimensions) of a model, the runtime's module
(:func:`mpipe_tune.runtime._layers.build_layer`) runs a training forward and a backward on synthetic
microbatches of a few sizes; the cost model's FLOPs and bytes for the same layer and microbatch
(:func:`mpipe_tune.cost._arch.estimate_arch_work`) and the profile's measured peak and bandwidth then
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
allow, but never before :data:`MIN_CALIBRATION_SIZES` sizes were timed: the fits need two sizes to
tell a call's fixed seconds from its slope, and on a loaded machine the smallest size alone can take
longer than the limit, which would otherwise leave a profile with fewer points depending on the load.

The sizes are found first (growing until one pass takes too long), then timed interleaved: every
repeat passes through the chain once at each size in turn (:func:`time_chains`), so that a drift of
the machine's speed during the calibration reaches every size alike. Repeats run in batches of
``settings.repeats`` (after the warm-up) until every layer's forward and backward median at every
size moved by at most ``settings.calibration_tolerance`` (relative) over the last batch, or
``settings.calibration_max_repeats`` repeats were taken. The ranks of
:mod:`~mpipe_tune.profiler._together` time at once, as a pipeline's stages run: each repeat starts
after a barrier and all ranks agree when to stop.

Kinds whose runtime module makes one call per image (:data:`PER_IMAGE_KINDS`: the ViT block attends
inside each image) are also timed on the same patches split into :data:`CALIBRATION_IMAGES` images,
so that the fit can tell the fixed seconds per image from those per call.

Given a tensor-parallel mesh (:func:`layer_samples`' ``tp_mesh``), the chain is split over it with
the runtime's own tensor-parallel plans (:func:`~mpipe_tune.runtime._tensor_parallel.parallelize_layer`)
and timed the same way inside :func:`~mpipe_tune.runtime._tensor_parallel.tp_context`, one image per
size: each split layer's time, all-reduces included, for the profile's per-kind ``tp_overhead_s`` and
``tp_slowdown``. Given an expert-parallel shard (``expert_shard``), the chain's MoE layers keep only the shard's
routed experts and dispatch their tokens over its group, as the runtime's expert-parallel plans do, timed the
same way: each such layer's time, all-to-alls included, for the profile's ``ep_overhead_s`` and ``ep_slowdown``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType

import numpy as np

from mpipe_tune.algebra import ArchCost, Model
from mpipe_tune.cost import estimate_arch_work
from mpipe_tune.algebra import DTYPE_BYTES
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import IMAGE_STREAM_KINDS, Microbatch
from mpipe_tune.profiler._device import Timer
from mpipe_tune.profiler._roofline import TORCH_DTYPES
from mpipe_tune.profiler._settings import SweepSettings
from mpipe_tune.profiler._stats import Spread

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
    images: int = 1
    """Images the microbatch's patches were split into (1 for text-stream kinds)."""
    tp: int = 1
    """Ranks the layer was split over (tensor parallelism; 1: whole)."""
    input_grad: bool = True
    """Whether the backward computed the layer's input gradient (it was fed by the layer before it)."""
    ep: int = 1
    """Ranks the layer's routed experts were spread over (expert parallelism; 1: all held)."""


PER_IMAGE_KINDS = frozenset({"vit_block"})
"""Kinds whose runtime module makes a call per image (:class:`~mpipe_tune.runtime._layers.VitBlock`
attends inside each image), so their time has a per-image part."""
CALIBRATION_IMAGES = 4
"""Images the multi-image calibration points split a size's patches into."""
MIN_CALIBRATION_SIZES = 2
"""Sizes timed whatever they take (the settings' first ones): two, for a fixed and a per-token part."""


@dataclass(frozen=True)
class Agreement:
    """How the ranks that calibrate together keep in step: ``barrier()`` before each timed repeat,
    ``all_stop(flag)`` true once every rank's flag is. One process alone: neither waits."""

    barrier: Callable[[], None] = lambda: None
    all_stop: Callable[[bool], bool] = lambda stop: stop


def calibration_layers(model: Model) -> list[int]:
    """Indices of the layers to time: the first of each distinct (kind, dimensions) (no torch needed).

    A model the runtime cannot build is a one-line MpipeError: a layer of explicit per-token costs here (the
    blueprint's own message would offer an emulated run, which has no layer to time), the others from its blueprint.
    """
    from mpipe_tune.runtime import blueprint

    for index, layer in enumerate(model.layers):
        if not isinstance(layer.cost, ArchCost):
            raise MpipeError(f"model '{model.name}' layer {index} ('{layer.name}') has explicit per-token costs, so "
                             f"there is no runtime layer to time; give as calibration model one whose layers give an "
                             f"architecture kind, e.g. small-vit-llm", quantities=("calibration model",))
    specs = blueprint(model)
    first: dict[tuple, int] = {}
    for spec in specs:
        first.setdefault((spec.kind, spec.dims), spec.index)
    return sorted(first.values())


def layer_samples(torch: ModuleType, device: str, model: Model, dtype: str, settings: SweepSettings,
                  progress: Callable[[str], None], agreement: Agreement = Agreement(), tp_mesh=None,
                  expert_shard=None) -> list[tuple[LayerPoint, list[float]]]:
    """Forward and backward seconds of each distinct layer of ``model``, every repeat's, timed in a
    chain (see the module docstring) at the settings' sizes, beside the point each belongs to (its
    ``seconds`` a placeholder until the samples of all ranks that timed together are summarized).
    With ``tp_mesh`` (a 1-D ``DeviceMesh`` of more than one rank), the chain split over it, one image
    per size; with ``expert_shard`` (a :class:`~mpipe_tune.runtime.ExpertShard`), the MoE layers' experts
    spread over its group, one image per size, and only the points of layers with routed experts."""
    from mpipe_tune.runtime import blueprint, tp_context

    specs = blueprint(model)
    chain = calibration_layers(model)
    modules = chain_modules(torch, device, model, dtype, tp_mesh, expert_shard)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    ep = 1 if expert_shard is None else expert_shard.degree
    with tp_context(tp_mesh):
        return _layer_samples(torch, device, model, dtype, settings, progress, agreement, specs, chain, modules,
                              tp, ep)


def _layer_samples(torch, device, model, dtype, settings, progress, agreement, specs, chain, modules, tp, ep):
    timer = Timer(torch, device)
    torch_dtype, where = getattr(torch, TORCH_DTYPES[dtype]), torch.device(device)
    tokens_timed = _sizes_within_limit(torch, timer, model, specs, chain, modules, torch_dtype, where, settings,
                                       agreement)
    points = []  # (tokens, images) of every microbatch timed, in the order of settings.calibration_tokens
    for tokens in tokens_timed:
        for images in (1, CALIBRATION_IMAGES) if tp == ep == 1 else (1,):
            if images == 1 or any(specs[i].kind in PER_IMAGE_KINDS for i in chain):
                points.append((tokens, images))
    mbs = [calibration_microbatch(model, tokens, images) for tokens, images in points]
    timed = time_chains(torch, timer, specs, chain, modules, mbs, torch_dtype, where, settings, agreement)
    out: list[tuple[LayerPoint, list[float]]] = []
    for (tokens, images), mb, (fwd, bwd, fed) in zip(points, mbs, timed):
        kinds = None if images == 1 else PER_IMAGE_KINDS
        for k, index in enumerate(chain):
            layer, kind = model.layers[index], specs[index].kind
            if kinds is not None and kind not in kinds or ep > 1 and kind != "moe_block":  # the routed experts' kind
                continue
            work = estimate_arch_work(kind, layer.cost.dims_dict(), mb, dtype_bytes=DTYPE_BYTES[dtype],
                                      tp_degree=tp, ep_degree=ep, rope="none")  # the runtime applies no RoPE
            bwd_flops = work.wgrad_flops + (work.dgrad_flops if fed[k] else 0.0)
            bwd_bytes = work.wgrad_bytes + (work.dgrad_bytes if fed[k] else 0.0)
            count = images if kind in IMAGE_STREAM_KINDS else 1
            blank = Spread(0.0, 0.0, 0, 0.0)
            out.append((LayerPoint(layer.name, kind, tokens, "fwd", work.fwd_flops, work.fwd_bytes, blank, count,
                                   tp, ep=ep), fwd[k]))
            out.append((LayerPoint(layer.name, kind, tokens, "bwd", bwd_flops, bwd_bytes, blank, count, tp,
                                   fed[k], ep), bwd[k]))
            if images == 1 and tp == ep == 1:
                progress(f"layer {layer.name} {tokens} tokens")
    for skipped in settings.calibration_tokens[len(tokens_timed):] if tp == ep == 1 else ():
        for index in chain:
            progress(f"layer {model.layers[index].name} {skipped} tokens (skipped)")
    return out


def _sizes_within_limit(torch, timer: Timer, model: Model, specs, chain: list[int], modules: list, dtype, where,
                        settings: SweepSettings, agreement: Agreement) -> list[int]:
    """The calibration sizes to time: in increasing order, at least the first
    :data:`MIN_CALIBRATION_SIZES`, then up to and including the first at which one layer's forward
    plus backward (one pass after a warm-up, one image) takes longer than
    ``settings.calibration_max_point_s`` on some rank."""
    out = []
    for repeat, tokens in enumerate(settings.calibration_tokens):
        mb = calibration_microbatch(model, tokens)
        fed = [False] * len(chain)
        for _ in range(2):  # a warm-up pass, then the timed one
            fwd: list[list[float]] = [[] for _ in chain]
            bwd: list[list[float]] = [[] for _ in chain]
            agreement.barrier()
            _chain_once(torch, timer, specs, chain, modules, mb, dtype, where, repeat, fed, fwd, bwd)
        out.append(tokens)
        if len(out) < MIN_CALIBRATION_SIZES:  # the same count on every rank: all skip the vote alike
            continue
        too_long = any(f[0] + b[0] > settings.calibration_max_point_s for f, b in zip(fwd, bwd))
        if not agreement.all_stop(not too_long):  # some rank's point took too long: every rank stops growing
            break
    return out


def chain_modules(torch: ModuleType, device: str, model: Model, dtype: str, tp_mesh=None, expert_shard=None) -> list:
    """The runtime's modules of the calibration chain (:func:`calibration_layers`), all trainable;
    split over ``tp_mesh`` (the runtime's tensor-parallel plans) when one is given, the MoE layers holding
    ``expert_shard``'s routed experts when one is given."""
    from mpipe_tune.runtime import blueprint, build_layer, parallelize_layer

    specs = blueprint(model)
    torch_dtype, where = getattr(torch, TORCH_DTYPES[dtype]), torch.device(device)
    modules = []
    for i in calibration_layers(model):
        spec = replace(specs[i], trainable=True)
        module = build_layer(spec, seed=0, dtype=torch_dtype, device=where, expert_shard=expert_shard)
        modules.append(parallelize_layer(module, spec, tp_mesh) if tp_mesh is not None else module)
    return modules


def is_stable(previous: Sequence[float] | None, current: Sequence[float], tolerance: float) -> bool:
    """Every median within ``tolerance`` (relative) of the previous batch's.

    >>> is_stable(None, [1.0], 0.02), is_stable([1.0, 2.0], [1.01, 2.0], 0.02), is_stable([1.0], [1.05], 0.02)
    (False, True, False)
    """
    return previous is not None and all(abs(c - p) <= tolerance * p for p, c in zip(previous, current))


def repeat_until_stable(run_batch: Callable[[], list[list[float]]], settings: SweepSettings,
                        agreement: Agreement) -> list[list[float]]:
    """Call ``run_batch`` (``settings.repeats`` more samples for each quantity) until every quantity's
    median is stable (:func:`is_stable`) on every rank, or ``settings.calibration_max_repeats``
    samples were taken; returns all samples per quantity."""
    samples: list[list[float]] | None = None
    previous = None
    while True:
        batch = run_batch()
        samples = batch if samples is None else [s + b for s, b in zip(samples, batch)]
        medians = [float(np.median(s)) for s in samples]
        done = is_stable(previous, medians, settings.calibration_tolerance) or \
            len(samples[0]) >= settings.calibration_max_repeats
        if agreement.all_stop(done):
            return samples
        previous = medians


def time_chains(torch, timer: Timer, specs, chain: list[int], modules: list, mbs: Sequence[Microbatch], dtype,
                where, settings: SweepSettings, agreement: Agreement,
                ) -> list[tuple[list[list[float]], list[list[float]], list[bool]]]:
    """Per microbatch of ``mbs``, per chained layer, its forward and backward seconds over the repeats,
    and whether it was fed a tensor by the layer before it (and so computes an input gradient).

    The microbatches are interleaved: every repeat passes through the chain once at each in turn, each
    pass after a barrier, so that a drift of the machine's speed during the calibration reaches every
    size alike (timed one size after another, each size's medians were of its own minutes, and the
    speed probe at one size, :mod:`~mpipe_tune.profiler._together`, spoke for that size's alone)."""
    n = len(chain)
    fed = [[False] * n for _ in mbs]
    drawn = [0]  # repeats so far: each gets fresh inputs

    def batch(repeats: int, keep: bool) -> list[list[float]]:
        per_mb: list[list[list[float]]] = [[[] for _ in range(2 * n)] for _ in mbs]
        for _ in range(repeats):
            for j, mb in enumerate(mbs):
                agreement.barrier()
                _chain_once(torch, timer, specs, chain, modules, mb, dtype, where, drawn[0], fed[j],
                            per_mb[j][:n], per_mb[j][n:])
            drawn[0] += 1
        return [quantity for samples in per_mb for quantity in samples] if keep else []

    batch(max(1, settings.warmup), keep=False)
    samples = repeat_until_stable(lambda: batch(settings.repeats, keep=True), settings, agreement)
    per_mb = [samples[2 * n * j:2 * n * (j + 1)] for j in range(len(mbs))]
    return [(quantities[:n], quantities[n:], fed[j]) for j, quantities in enumerate(per_mb)]


def _chain_once(torch, timer: Timer, specs, chain: list[int], modules: list, mb: Microbatch, dtype, where,
                repeat: int, fed: list[bool], fwd: list[list[float]], bwd: list[list[float]]) -> None:
    """One training forward through the chain and the backward back, each layer's call timed."""
    from mpipe_tune.runtime import output_shape, MicrobatchInputs

    n = len(chain)
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
        fwd[k].append(seconds)
    grad = None
    for k in reversed(range(n)):
        x, y = saved[k]
        out_grad = None if y.dim() == 0 else (grad if grad is not None else torch.ones_like(y))
        seconds = timer.seconds_per_call(lambda: torch.autograd.backward(y, out_grad))
        bwd[k].append(seconds)
        grad = None
        if x is not None and fed[k]:
            grad = x.grad if x.grad is not None else torch.zeros_like(x)


def calibration_microbatch(model: Model, tokens: int, images: int = 1) -> Microbatch:
    """A microbatch of ``tokens`` text tokens and about ``tokens`` ViT patches, in one image or split
    as evenly as whole image tokens allow into ``images`` (at most one per image token).

    >>> from mpipe_tune.inputs import load_model
    >>> calibration_microbatch(load_model("tiny-vit-llm"), 64)
    Microbatch(image_tokens=16, text_tokens=64, images=(), texts=())
    >>> calibration_microbatch(load_model("tiny-vit-llm"), 64, images=3).images
    (6, 5, 5)
    """
    merge = next((layer.cost.dims_dict()["merge_factor"] for layer in model.layers
                  if isinstance(layer.cost, ArchCost) and "merge_factor" in layer.cost.dims_dict()), 1)
    image_tokens = max(1, math.ceil(tokens / merge))
    if images == 1:
        return Microbatch(image_tokens=image_tokens, text_tokens=tokens)
    count = min(images, image_tokens)
    sizes = tuple(image_tokens // count + (1 if i < image_tokens % count else 0) for i in range(count))
    return Microbatch(image_tokens=image_tokens, text_tokens=tokens, images=sizes)


@dataclass(frozen=True)
class LayerFit:
    """``overhead_s + (images - 1) * image_overhead_s + max(W / (efficiency * F), D / B)`` fitted to one
    phase of one layer kind."""

    efficiency: float
    overhead_s: float
    rms_relative_error: float
    """Root mean square of ``(predicted - measured) / measured`` over the points."""
    predicted_s: tuple[float, ...]
    image_overhead_s: float = 0.0
    """Fixed seconds per image beyond the first (0 unless points of several images were fitted)."""


MIN_SIZES_FOR_OVERHEAD = 3
"""Distinct work sizes a group of points needs before a per-call overhead is fitted besides the
efficiency (two parameters from two sizes would follow any noise exactly)."""


def fit_layer_timing(flops: Sequence[float], bytes_moved: Sequence[float], times_s: Sequence[float], *,
                     peak_flops_per_s: float, bytes_per_s: float,
                     extra_images: Sequence[int] | None = None) -> LayerFit:
    """The efficiency in (0, 1], overhead >= 0 and (with ``extra_images``, each point's images less
    one, not all equal) per-image overhead >= 0 minimising the relative error against ``times_s``.

    For each efficiency on a logarithmic grid from 1e-6 to 1 (0.1% steps) the best overheads have a
    closed form (relative least squares, each clipped at 0); the triple with the smallest error wins.
    With fewer than :data:`MIN_SIZES_FOR_OVERHEAD` distinct work sizes (FLOPs and bytes: an embedding's forward has
    no FLOPs at any size) the overheads are 0. Where no point has FLOPs the efficiency changes nothing and is 1.

    >>> f = fit_layer_timing([1e9, 2e9, 4e9], [0, 0, 0], [0.011, 0.021, 0.041],
    ...                      peak_flops_per_s=1e11, bytes_per_s=1e10)
    >>> round(f.efficiency, 2), round(f.overhead_s, 4), round(f.rms_relative_error, 4)
    (1.0, 0.001, 0.0)
    >>> f = fit_layer_timing([1e9, 2e9, 4e9, 1e9, 2e9, 4e9], [0] * 6, [0.011, 0.021, 0.041, 0.017, 0.027, 0.047],
    ...                      peak_flops_per_s=1e11, bytes_per_s=1e10, extra_images=[0, 0, 0, 3, 3, 3])
    >>> round(f.overhead_s, 4), round(f.image_overhead_s, 4), round(f.rms_relative_error, 4)
    (0.001, 0.002, 0.0)
    """
    t = np.asarray(times_s, dtype=float)
    w = np.asarray(flops, dtype=float)
    assert t.ndim == 1 and len(t) >= 1 and np.all(t > 0) and w.shape == t.shape, (w, t)
    c = np.zeros_like(t) if extra_images is None else np.asarray(extra_images, dtype=float)
    grid = np.geomspace(1e-6, 1.0, 13_817)  # ratio 1.001 between neighbours
    roof = np.maximum(w[None, :] / (grid[:, None] * peak_flops_per_s),
                      np.asarray(bytes_moved, dtype=float)[None, :] / bytes_per_s)
    overhead = np.zeros(len(grid))
    per_image = np.zeros(len(grid))
    sizes = {(f, d) for f, d in zip(w.tolist(), np.asarray(bytes_moved, dtype=float).tolist())}
    if len(sizes) >= MIN_SIZES_FOR_OVERHEAD:
        overhead, per_image = _overheads(t, roof, c if len(np.unique(c)) > 1 else None)
    predicted = roof + overhead[:, None] + per_image[:, None] * c[None, :]
    errors = np.sqrt(np.mean(((predicted - t) / t) ** 2, axis=1))
    best = int(np.argmin(errors)) if w.any() else len(grid) - 1  # no FLOPs: every efficiency fits alike
    return LayerFit(float(grid[best]), float(overhead[best]), float(errors[best]),
                    tuple(float(x) for x in predicted[best]), float(per_image[best]))


def _overheads(t: np.ndarray, roof: np.ndarray, c: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per grid row, the overhead ``a >= 0`` and per-image overhead ``b >= 0`` minimising
    ``sum(((t - roof - a - b c) / t)^2)`` (``b = 0`` without ``c``): the free least-squares solution
    where both are >= 0, else the better of the one-parameter solutions on the boundary."""
    weight = 1.0 / t**2
    r = t[None, :] - roof
    only_a = np.maximum(0.0, (r * weight).sum(axis=1) / weight.sum())
    if c is None:
        return only_a, np.zeros_like(only_a)
    swc, swcc = (weight * c).sum(), (weight * c * c).sum()
    sw = weight.sum()
    swr, swcr = (r * weight).sum(axis=1), (r * weight * c).sum(axis=1)
    det = sw * swcc - swc * swc
    free_a, free_b = (swcc * swr - swc * swcr) / det, (sw * swcr - swc * swr) / det
    only_b = np.maximum(0.0, swcr / swcc)
    candidates = [(np.maximum(free_a, 0.0), np.maximum(free_b, 0.0)), (only_a, np.zeros_like(only_a)),
                  (np.zeros_like(only_b), only_b)]
    errors = [(((r - a[:, None] - b[:, None] * c[None, :]) ** 2) * weight).sum(axis=1) for a, b in candidates]
    valid = (free_a >= 0) & (free_b >= 0)
    errors[0] = np.where(valid, errors[0], np.inf)
    choice = np.argmin(np.stack(errors), axis=0)
    a = np.choose(choice, [cand[0] for cand in candidates])
    b = np.choose(choice, [cand[1] for cand in candidates])
    return a, b
