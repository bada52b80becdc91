"""Calibration under run conditions: every local rank times at once, as the stages of a run do.

A plan's ranks share the host: on a CPU every rank is a process on its own share of the cores,
contending for caches and memory bandwidth with the others; on a node of accelerators each has its
device but they share the host. Timing one layer chain in one process sees none of that. So
:func:`calibrate_together` starts ``nproc`` ranks with the runtime's own launcher
(:func:`~mpipe_tune.runtime._launch.launch_local`: one thread per CPU rank, as in a run), and every
rank times the calibration chain (:func:`~mpipe_tune.profiler._calibrate.layer_samples`) at the same
time, each repeat after a barrier, until every rank's medians are stable; the samples of all ranks
are pooled per point. With an even number of ranks (and a model the runtime can split in two), they
then time the chain again split over pairs of neighbouring ranks (tensor parallelism of degree 2,
the runtime's layout: tp innermost), for the profile's ``tp_overhead_s`` and ``tp_slowdown``, and, where the
model has MoE layers whose routed experts split in two, once more with each pair's MoE layers spreading their
experts over the pair (expert parallelism of degree 2, the runtime's all-to-all dispatch), for the profile's
``ep_overhead_s`` and ``ep_slowdown``: what a layer's calls took beyond the cost model's price there (its
all-to-alls among it) is what the run's calls take too, waits for the pair's other rank included. The
ranks then time the runtime's optimizer update (:func:`~mpipe_tune.runtime._compute.sgd_update`) on
the chain's weights the same way, for the profile's ``optimizer_update_bytes_per_s``.

The speed probe (:func:`speed_probe_s`) is a short fixed timing of the same chain at one size: the
forward plus backward seconds of one pass, median over a few repeats, all ranks at once. Taken at
profile time (it is the sum of the calibration medians at that size) and again before a measured run
and after each of its steps (:func:`probed_run_jobs`), the ratio says how much faster or slower the machine runs now than when it
was profiled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mpipe_tune.algebra import Model
from mpipe_tune.profiler._calibrate import (
    Agreement, LayerPoint, calibration_layers, calibration_microbatch, chain_modules, layer_samples,
    repeat_until_stable, time_chains,
)
from mpipe_tune.profiler._device import Timer, calls_for
from mpipe_tune.profiler._roofline import TORCH_DTYPES
from mpipe_tune.profiler._settings import SweepSettings, sweep_settings
from mpipe_tune.profiler._stats import Spread, summarize

UPDATE_LR = 1e-12
"""The learning rate of the timed updates (they change the weights, so barely)."""


@dataclass(frozen=True)
class UpdatePoint:
    """The optimizer update timed on the calibration chain's weights: bytes read and written per call."""

    size_bytes: float
    seconds: Spread

    @property
    def bytes_per_s(self) -> float:
        return self.size_bytes / self.seconds.median


def calibrate_together(device: str, nproc: int, model: Model, dtype: str, settings: SweepSettings,
                       progress: Callable[[str], None], *, timeout_s: float = 600.0,
                       ) -> tuple[list[LayerPoint], UpdatePoint]:
    """The layer points and the update point of ``model``'s chain timed by ``nproc`` ranks at once,
    every rank's samples pooled (see the module docstring)."""
    from mpipe_tune.runtime import launch_local

    pooled, update = launch_local(_calibrate_rank, (model, dtype, settings), nproc, device,
                                  timeout_s=timeout_s, deadline_s=timeout_s)
    points = [replace(point, seconds=summarize(samples)) for point, samples in pooled]
    timed = [p for p in points if p.phase == "fwd" and p.images == 1 and p.tp == p.ep == 1]
    for point in timed:
        progress(f"layer {point.layer_name} {point.tokens} tokens")
    for _ in range(len(calibration_layers(model)) * len(settings.calibration_tokens) - len(timed)):
        progress("layer sizes skipped (too long)")
    split_sizes = {p.tokens for p in points if p.tp > 1}
    if split_sizes and len(split_sizes) < len(settings.calibration_tokens):
        skipped = [t for t in settings.calibration_tokens if t not in split_sizes]
        progress(f"split layer sizes {', '.join(map(str, skipped))} tokens skipped (too long)")
    return points, UpdatePoint(update[0], summarize(update[1]))


def _calibrate_rank(ctx, model: Model, dtype: str, settings: SweepSettings):
    import torch
    import torch.distributed as dist

    agreement = distributed_agreement(dist)
    samples = layer_samples(torch, ctx.device_kind, model, dtype, settings, lambda _: None, agreement)
    tp_mesh = tp_calibration_mesh(ctx, model)
    if tp_mesh is not None:
        samples += layer_samples(torch, ctx.device_kind, model, dtype, settings, lambda _: None, agreement, tp_mesh)
    expert_shard = ep_calibration_shard(ctx, model)
    if expert_shard is not None:
        samples += layer_samples(torch, ctx.device_kind, model, dtype, settings, lambda _: None, agreement,
                                 expert_shard=expert_shard)
    modules = chain_modules(torch, ctx.device_kind, model, dtype)
    size_bytes, update_s = time_update(torch, ctx.device_kind, modules, settings, agreement)
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((samples, update_s), gathered, dst=0)
    if ctx.rank != 0:
        return None
    pooled = [(point, [t for rank_samples, _ in gathered for t in rank_samples[k][1]])
              for k, (point, _) in enumerate(samples)]
    return pooled, (size_bytes, [t for _, rank_update in gathered for t in rank_update])


TP_CALIBRATION_DEGREE = 2
"""The tensor- and expert-parallel degree the ranks calibrate split layers at (pairs of neighbouring ranks)."""


def tp_calibration_mesh(ctx, model: Model):
    """The 1-D mesh of this rank's pair for the split calibration, or None: an odd number of ranks, or
    a model whose heads or widths the runtime cannot split in two."""
    from torch.distributed.device_mesh import init_device_mesh

    from mpipe_tune.errors import MpipeError
    from mpipe_tune.runtime import blueprint, validate_tensor_parallel

    tp = TP_CALIBRATION_DEGREE
    if ctx.world_size < tp or ctx.world_size % tp:
        return None
    specs = blueprint(model)
    try:
        validate_tensor_parallel(tuple(specs[i] for i in calibration_layers(model)), tp)
    except MpipeError:
        return None
    mesh = init_device_mesh(ctx.device_kind, (ctx.world_size // tp, tp), mesh_dim_names=("rest", "tp"))
    return mesh["tp"]


def ep_calibration_shard(ctx, model: Model):
    """This rank's :class:`~mpipe_tune.runtime.ExpertShard` of its pair for the expert-parallel calibration, or
    None: an odd number of ranks, or a model without MoE layers whose routed experts split in two."""
    from torch.distributed.device_mesh import init_device_mesh

    from mpipe_tune.cost import expert_parallel_fits
    from mpipe_tune.runtime import ExpertShard

    ep = TP_CALIBRATION_DEGREE
    if ctx.world_size < ep or ctx.world_size % ep or not expert_parallel_fits(model, ep):
        return None
    pair = init_device_mesh(ctx.device_kind, (ctx.world_size // ep, ep), mesh_dim_names=("rest", "ep"))["ep"]
    return ExpertShard(pair.get_group(), pair.get_local_rank(), ep)


def distributed_agreement(dist) -> Agreement:
    """Barrier and unanimous stop over the default process group."""
    import torch

    def all_stop(stop: bool) -> bool:
        flag = torch.tensor([1 if stop else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return Agreement(barrier=dist.barrier, all_stop=all_stop)


def time_update(torch, device: str, modules: list, settings: SweepSettings,
                agreement: Agreement = Agreement()) -> tuple[float, list[float]]:
    """(bytes per call, seconds per repeat) of the runtime's optimizer update on ``modules``' weights:
    every weight and its gradient read, the weight written."""
    from mpipe_tune.runtime import sgd_update

    parameters = [p for m in modules for p in m.parameters()]
    for p in parameters:
        p.grad = torch.randn_like(p)
    size_bytes = float(sum(3 * p.numel() * p.element_size() for p in parameters))
    timer = Timer(torch, device)
    step = lambda: sgd_update(parameters, UPDATE_LR)  # noqa: E731
    for _ in range(max(1, settings.warmup)):
        step()
    calls = calls_for(timer.seconds_per_call(step), settings.min_repeat_s, 64)

    def batch() -> list[list[float]]:
        out = []
        for _ in range(settings.repeats):
            agreement.barrier()
            out.append(timer.seconds_per_call(step, calls))
        return [out]

    [samples] = repeat_until_stable(batch, settings, agreement)
    return size_bytes, samples


# ------------------------------------------------------------------------------------------ probe


PROBE_REPEATS = 5


def speed_probe_s(torch, device: str, model: Model, dtype: str, tokens: int, agreement: Agreement = Agreement(),
                  modules: list | None = None) -> float:
    """Seconds of one forward plus backward pass through the calibration chain at ``tokens`` (one
    image), median over :data:`PROBE_REPEATS` repeats after one warm-up, each after a barrier."""
    from mpipe_tune.runtime import blueprint

    modules = modules or chain_modules(torch, device, model, dtype)
    settings = replace(sweep_settings(device, quick=True), warmup=1, repeats=PROBE_REPEATS,
                       calibration_max_repeats=PROBE_REPEATS)  # one batch: a fixed timing
    [(fwd, bwd, _)] = time_chains(torch, Timer(torch, device), blueprint(model), calibration_layers(model), modules,
                                  [calibration_microbatch(model, tokens)], getattr(torch, TORCH_DTYPES[dtype]),
                                  torch.device(device), settings, agreement)
    return float(sum(np.median(s) for s in fwd + bwd))


def profile_probe_s(profile, tokens: int) -> float | None:
    """The speed probe at profile time: the sum of the profile's calibration medians at ``tokens``
    (one image), forward and backward, over its kinds' layers (every layer of the chain), or None
    when the profile was not calibrated at that size."""
    total, found = 0.0, False
    for kind in profile.efficiency:
        origin = profile.provenance[f"efficiency.{kind}"]
        if kind == "default" or "median_s" not in origin:
            continue
        images = origin.get("images", [1] * len(origin["tokens"]))
        for n, count, seconds in zip(origin["tokens"], images, origin["median_s"]):
            if n == tokens and count == 1:
                total, found = total + seconds, True
    return total if found else None


def probed_run_jobs(ctx, jobs: list, model: Model, dtype: str, tokens: int) -> list[dict[str, Any]] | None:
    """:func:`~mpipe_tune.runtime._worker.run_jobs` with the speed probe taken by every rank at once
    before each job and after each of its steps (outside the timed steps: each starts after a
    barrier); each result gains ``probe_before_s``, ``probe_after_s`` (after the last step) and
    ``probe_steps_s`` (after every step), each the mean over the ranks, as the profile's figure pools
    them."""
    import torch
    import torch.distributed as dist

    from mpipe_tune.runtime import run_job

    agreement = distributed_agreement(dist)
    modules = chain_modules(torch, ctx.device_kind, model, dtype)

    def probe() -> float:
        seconds = torch.tensor([speed_probe_s(torch, ctx.device_kind, model, dtype, tokens, agreement, modules)],
                               dtype=torch.float64)
        dist.all_reduce(seconds)
        return float(seconds.item()) / ctx.world_size

    results = []
    for job in jobs:
        before = probe()
        after_steps: list[float] = []
        result = run_job(ctx, job, lambda _step: after_steps.append(probe()))
        if result is not None:
            result = {**result, "probe_before_s": before, "probe_after_s": after_steps[-1],
                      "probe_steps_s": after_steps}
        results.append(result)
    return results if ctx.rank == 0 else None
