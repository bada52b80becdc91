"""Rank function of the tensor-parallel layer test: every layer of the test model split over a 1-D mesh
of all ranks, against the same layer built whole, on one input in float64.

A plain module with a unique name (not a conftest.py): the rank processes import it by name to
unpickle the function.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from mpipe_tune.inputs import Microbatch
from mpipe_tune.runtime._blueprint import LayerSpec, blueprint, output_shape
from mpipe_tune.runtime._data import MicrobatchInputs, seed_of
from mpipe_tune.runtime._mllm import LayerStack, reference_step
from mpipe_tune.runtime import tp_context
from mpipe_tune.inputs import load_model

TP_MODEL = str(Path(__file__).with_name("tiny-mla-moe.yaml"))
"""Every kind and attention variant the runtime splits (12 layers)."""
MICROBATCH = Microbatch(3, 8, (1, 2))
"""Two images (one and two merged tokens) in front of an 8-token sequence."""
STEP = (MICROBATCH, Microbatch(0, 6))
"""The whole-model step's microbatches: the second has no image (empty image-stream tensors)."""
_F64 = torch.float64
_CPU = torch.device("cpu")


def _random(shape: tuple[int, ...], *key: object) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed_of(*key)), dtype=_F64)


def compare_split_layers(ctx, model_path: str, mb: Microbatch) -> list[dict[str, dict[str, float]]]:
    """Per rank, per layer name: ``error`` (the largest absolute difference of the output, the input
    gradient and every parameter's full gradient between the split and the whole layer, each run alone
    on ``mb``), ``sharded`` (how many of the split layer's parameters are DTensors sharded over the
    mesh) and ``grads`` (its trainable parameters); and under ``"step"``, the ``error`` of a whole-model
    step of the split layers on :data:`STEP` (summed loss and every gradient) against ``reference_step``."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    specs = blueprint(load_model(model_path))
    layers = range(len(specs))
    whole = LayerStack.build(specs, layers, seed=0, dtype=_F64, device=_CPU)
    split = LayerStack.build(specs, layers, seed=0, dtype=_F64, device=_CPU, tp_mesh=mesh)
    inputs = MicrobatchInputs(mb, 0, 0, _F64, _CPU)
    errors = {}
    with tp_context(mesh):
        for stack in (whole, split):
            stack.zero_grads()
        for spec in specs:
            i = spec.index
            x = None if i == 0 else _random(output_shape(specs[i - 1], mb), "input", i)
            results = []
            for stack in (whole, split):
                x_in = None if x is None else x.clone().requires_grad_()
                y = stack.run(i, i + 1, x_in, inputs)
                cotangent = _random(tuple(y.shape), "cotangent", i)
                (y * cotangent).sum().backward()
                results.append((y.detach(), None if x_in is None else x_in.grad))
            (y_whole, dx_whole), (y_split, dx_split) = results
            # What a pipeline stage sends on: a plain tensor (no DTensor, no all-reduce still in flight).
            assert type(y_split) is torch.Tensor, f"layer {i} hands on a {type(y_split).__name__}"
            assert y_whole.shape == y_split.shape, f"layer {i}: {tuple(y_split.shape)} != {tuple(y_whole.shape)}"
            error = (y_whole - y_split).abs().max()
            if x is not None:
                error = torch.maximum(error, (dx_whole - dx_split).abs().max())
            errors[spec.name] = float(error)
    grads_whole, grads_split = whole.named_gradients(), split.named_gradients()
    assert grads_whole.keys() == grads_split.keys()
    report = {}
    for spec in specs:
        names = [n for n in grads_whole if n.startswith(f"{spec.index}.")]
        assert names, f"layer {spec.index} has no trainable parameters"
        diffs = [float((grads_whole[n] - grads_split[n]).abs().max()) for n in names]
        sharded = sum(isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
                      for p in split.modules[spec.index].parameters())
        report[spec.name] = {"error": max(errors[spec.name], *diffs), "sharded": sharded, "grads": len(names)}
    report["step"] = {"error": _step_error(split, specs, mesh)}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, report)
    return gathered


def _step_error(split: LayerStack, specs: tuple[LayerSpec, ...], mesh: DeviceMesh) -> float:
    ref_loss, ref_grads = reference_step(specs, STEP, seed=0)
    split.zero_grads()
    loss = 0.0
    with tp_context(mesh):
        for m, mb in enumerate(STEP):
            y = split.run(0, len(specs), None, MicrobatchInputs(mb, m, 0, _F64, _CPU))
            y.backward()
            loss += float(y.detach())
    grads = split.named_gradients()
    assert grads.keys() == ref_grads.keys()
    return max(abs(loss - ref_loss), *(float((grads[n] - ref_grads[n]).abs().max()) for n in grads))
