"""The MLLM as a dict of per-layer modules, and the single-process reference step.

A rank builds only the layers it holds (:meth:`PlanView.layers_of`); the reference builds them all.
Gradient names are ``"<layer index>.<parameter name>"`` so that a rank's gradients and the
reference's can be compared one to one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mpipe_tune.algebra import TORCH_DTYPE_NAMES
from mpipe_tune.inputs import Microbatch
from mpipe_tune.runtime._blueprint import LayerSpec
from mpipe_tune.runtime._data import MicrobatchInputs
from mpipe_tune.runtime._experts import ExpertShard
from mpipe_tune.runtime._layers import build_layer
from mpipe_tune.runtime._ring_attention import Ring
from mpipe_tune.runtime._tensor_parallel import full_gradient, is_sequence_parallel

DTYPES = {name: getattr(torch, TORCH_DTYPE_NAMES[name]) for name in ("fp64", "fp32", "bf16", "fp16")}
"""The compute dtypes the runtime's layers run in, as torch dtypes."""


@dataclass
class LayerStack:
    """The modules of some layers of a model, keyed by model layer index."""

    specs: tuple[LayerSpec, ...]
    modules: dict[int, nn.Module]

    @classmethod
    def build(cls, specs: Sequence[LayerSpec], indices: Iterable[int], *, seed: int, dtype: torch.dtype,
              device: torch.device, tp_mesh: DeviceMesh | None = None,
              expert_shard: ExpertShard | None = None, encoder_tp_mesh: DeviceMesh | None = None,
              encoder_end: int = 0, ring: Ring | None = None, sequence_parallel: bool = False) -> LayerStack:
        """The layers ``indices`` of ``specs``; with a ``tp_mesh`` of more than one rank each is split over
        it (:mod:`~mpipe_tune.runtime._tensor_parallel`: run steps inside its ``tp_context(tp_mesh)``);
        with an ``expert_shard`` each MoE layer holds only that rank's routed experts; the encoder's layers
        (before ``encoder_end``) are split over ``encoder_tp_mesh`` instead of ``tp_mesh``; with a ``ring``
        (context parallelism) the decoder's layers hold this rank's share of each sequence, and with
        ``sequence_parallel`` (and a ``tp_mesh``) its tensor-parallel rank's rows of that."""
        modules = {i: build_layer(specs[i], seed=seed, dtype=dtype, device=device,
                                  tp_mesh=encoder_tp_mesh if i < encoder_end else tp_mesh, expert_shard=expert_shard,
                                  ring=ring, sequence_parallel=sequence_parallel)
                   for i in sorted(set(indices))}
        return cls(tuple(specs), modules)

    def run(self, start: int, stop: int, x: torch.Tensor | None, inputs: MicrobatchInputs) -> torch.Tensor:
        for i in range(start, stop):
            x = self.modules[i](x, inputs)
        return x

    def trainable_parameters(self, layers: Iterable[int] | None = None) -> list[nn.Parameter]:
        """Trainable parameters of the given layers (default: every layer held). A tensor-parallel split
        parameter is a DTensor and so is its ``.grad``: reduce and update its ``to_local()`` shard."""
        chosen = self.modules if layers is None else [i for i in layers if i in self.modules]
        return [p for i in sorted(chosen) for p in self.modules[i].parameters() if p.requires_grad]

    def sequence_parallel_parameters(self, layers: Iterable[int]) -> list[nn.Parameter]:
        """The trainable parameters of ``layers`` whose gradient each tensor-parallel rank holds only
        for its own rows (sequence parallelism's norms, :func:`~mpipe_tune.runtime._tensor_parallel.is_sequence_parallel`)."""
        return [p for p in self.trainable_parameters(layers) if is_sequence_parallel(p)]

    def is_routed_expert(self, layer: int, name: str) -> bool:
        """Whether parameter ``name`` of layer ``layer`` belongs to a routed expert sharded over an
        expert-parallel group (reduced over the experts' own data-parallel group)."""
        mlp = getattr(self.modules[layer], "mlp", None)
        return getattr(mlp, "shard", None) is not None and name.startswith("mlp.experts.")

    def split_routed_experts(self, layers: Iterable[int]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The trainable parameters of ``layers`` as (the rest, the sharded routed experts')."""
        rest, experts = [], []
        for i in sorted(i for i in set(layers) if i in self.modules):
            for name, p in self.modules[i].named_parameters():
                if p.requires_grad:
                    (experts if self.is_routed_expert(i, name) else rest).append(p)
        return rest, experts

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's whole gradient, by ``"<layer index>.<parameter name>"``. Split
        parameters' are gathered (:func:`full_gradient`): every rank of a tensor-parallel group must call it."""
        return {f"{i}.{name}": full_gradient(p).detach().cpu().clone()
                for i, m in self.modules.items() for name, p in m.named_parameters() if p.requires_grad}

    def held_weights(self) -> dict[str, dict[str, torch.Tensor | tuple[int, ...]]]:
        """Every parameter, by ``"<layer index>.<parameter name>"``: its whole value (``"weight"``, a
        split or sharded one's gathered: every rank of its mesh must call it) and the shape of what this
        rank holds of it (``"held_shape"``)."""
        return {f"{i}.{name}": {"weight": (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone(),
                                "held_shape": tuple((p.to_local() if isinstance(p, DTensor) else p).shape)}
                for i, m in self.modules.items() for name, p in m.named_parameters()}

    def zero_grads(self) -> None:
        """Every trainable parameter gets a zero gradient (not None), so reduces see fixed shapes even
        when a rank ran no microbatch through a layer."""
        for p in self.trainable_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


def reference_step(
    specs: Sequence[LayerSpec], microbatches: Sequence[Microbatch], *, seed: int,
    dtype: torch.dtype = torch.float64, device: torch.device = torch.device("cpu"),
) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of the whole model in one process: the summed loss over the microbatches and every
    trainable parameter's gradient (of that sum)."""
    stack = LayerStack.build(specs, range(len(specs)), seed=seed, dtype=dtype, device=device)
    stack.zero_grads()
    total = 0.0
    for m, mb in enumerate(microbatches):
        loss = stack.run(0, len(specs), None, MicrobatchInputs(mb, m, seed, dtype, device))
        loss.backward()
        total += float(loss.detach())
    return total, stack.named_gradients()
