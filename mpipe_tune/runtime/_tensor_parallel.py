"""Tensor parallelism of the runtime's layer modules, with torch's own ``torch.distributed.tensor.parallel``.

Each kind has a plan (module path -> parallel style) that makes the splits the cost model charges
(:mod:`mpipe_tune.cost._arch_layers`), Megatron-LM style:

- attention: q (and k, v) column-split by heads, the output projection row-split (its all-reduce
  completes the sum); with fewer key/value heads than ranks, k and v stay replicated and each rank
  keeps the key/value head its own query heads use (``kv_repeat``, see below);
- MLA: the down-projections to the q and kv latents replicated, the up-projections column-split by
  heads, the rope key shared by all heads kept per rank like replicated k/v (``rope_repeat``);
- MLP (dense, each routed expert, the shared experts, the ViT's, the merger's, a two-layer
  projector's): up and gate column-split, down row-split;
- replicated: the patch embedding, the norms, the router, a one-layer projector;
- embedding: the table split by vocabulary rows (each rank looks up its rows, an all-reduce sums);
- LM head: the vocabulary projection column-split into vocab-sharded logits (a DTensor) and a
  vocab-parallel cross-entropy (``loss_parallel``), returned as a plain scalar.

Sequence parallelism (the plan's ``sequence_parallel``): what runs between the tensor-parallel regions
(norms, residual adds, a layer's input and output, and so a pipeline transfer) holds the rank's rows of
the sequence, padded at the end to a multiple of tp (:func:`~mpipe_tune.runtime._layers.pad_rows`).
Each region gathers the rows on entry (``PrepareModuleInput`` from ``Shard(0)`` to ``Replicate``) and
its row-split projection reduce-scatters on exit (``RowwiseParallel(output_layouts=Shard(0))``); the
embedding and patch embedding keep their rows of the whole output, the merger gathers them, the LM
head's column-split projection gathers them, a MoE layer gathers on entry and keeps its rows of the
summed output, and a ViT block's per-image attention keeps its rows of each image's all-reduced output.
The norms stay plain modules on the rank's rows, so their weight gradients are each rank's rows' share,
marked (:func:`is_sequence_parallel`) and summed over the tp group before any data-parallel reduce, as
Megatron-LM does (torch's ``SequenceParallel`` style leaves them as ``Partial`` DTensors, which the
runtime's per-shard reduce and update cannot take).

Every rank builds the whole layer from the same seed, so the styles take their shards from the local
weights (``src_data_rank=None``: nothing is broadcast). The parameters of split linears and of the
embedding become DTensors (sharded, or replicated for a row-split bias); those of replicated parts stay
plain tensors. Between modules only plain local tensors flow: a column-split output is the rank's
heads or features, a row-split output the full (all-reduced) tensor, and a layer's output is plain.

Replicated keys/values (``RepeatHeads`` under ``_keep_own_heads``): the full ``[tokens, kv_heads, dim]``
tensor becomes a replicated DTensor, is repeated to one copy per query head and then sharded over the
heads, so a rank keeps exactly the copies its query heads use. In the backward the shard's gradient is
all-gathered, so every rank holds the full gradient of the replicated weights (the sum over the ranks
that share a head), as the single-process reference does.

Using a split layer (see :func:`tp_context` and :func:`full_gradient`):

- run every forward and backward of a training step inside ``with tp_context(tp_mesh):``;
- every rank of the group computes the same input gradients and the same full gradients of plain
  (replicated) parameters, so nothing needs reducing over the tensor-parallel group;
- a DTensor parameter's ``.grad`` is a DTensor of the same placements: its ``to_local()`` is what
  this rank reduces over data-parallel groups and updates; :func:`full_gradient` (a collective over
  the tensor-parallel group) is the whole gradient, to compare with an unsplit layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from mpipe_tune.runtime._blueprint import LayerSpec, validate_tensor_parallel

Plan = dict[str, ParallelStyle]


def _mlp(path: str, *, gated: bool) -> Plan:
    plan: Plan = {f"{path}.up": ColwiseParallel(), f"{path}.down": RowwiseParallel()}
    if gated:
        plan[f"{path}.gate"] = ColwiseParallel()
    return plan


def _keep_own_heads() -> ParallelStyle:
    """A ``RepeatHeads`` of replicated input whose output ``[tokens, heads, dim]`` is kept per rank by heads."""
    return PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Replicate(),
                                    output_layouts=Replicate(), desired_output_layouts=Shard(1))


def _gqa(path: str, kv_heads: int, tp_degree: int) -> Plan:
    plan: Plan = {f"{path}.q": ColwiseParallel(), f"{path}.out": RowwiseParallel()}
    if kv_heads >= tp_degree:
        plan |= {f"{path}.k": ColwiseParallel(), f"{path}.v": ColwiseParallel()}
    else:
        plan[f"{path}.kv_repeat"] = _keep_own_heads()
    return plan


def _mla(path: str) -> Plan:
    return {f"{path}.q_up": ColwiseParallel(), f"{path}.kv_up": ColwiseParallel(),
            f"{path}.rope_repeat": _keep_own_heads(), f"{path}.out": RowwiseParallel()}


def _decoder_attention(d: dict, tp_degree: int) -> Plan:
    return _mla("attn") if d["attention"] == "mla" else _gqa("attn", d["kv_heads"], tp_degree)


def _dense_block(d: dict, tp_degree: int) -> Plan:
    return _decoder_attention(d, tp_degree) | _mlp("mlp", gated=d["activation"] == "swiglu")


def _moe_block(d: dict, tp_degree: int) -> Plan:
    gated = d["activation"] == "swiglu"
    plan = _decoder_attention(d, tp_degree) | _mlp("mlp.experts.*", gated=gated)
    if d["shared_experts"]:
        plan |= _mlp("mlp.shared", gated=gated)
    return plan


def _gather_rows() -> ParallelStyle:
    """A sequence-parallel region's entry: the rank's rows all-gathered into the whole sequence."""
    return PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=True)


def _sequence_parallel_block(kind: str) -> Plan:
    """Sequence parallelism's changes to a decoder block's plan: each tensor-parallel region (attention,
    MLP) all-gathers the rows on entry, and its row-split projection reduce-scatters them on exit
    (Megatron-LM's layout); the MoE layer gathers on entry and keeps its rows of the summed output."""
    plan: Plan = {"attn": _gather_rows(), "attn.out": RowwiseParallel(output_layouts=Shard(0))}
    if kind == "moe_block":
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(0),), use_local_output=True)
    else:
        plan |= {"mlp": _gather_rows(), "mlp.down": RowwiseParallel(output_layouts=Shard(0))}
    return plan


def _sequence_parallel_vit() -> Plan:
    """A ViT block's: its attention runs per image on the gathered rows (its row-split projection
    all-reduces each image's output, as without sequence parallelism) and the rank keeps its rows of
    the result; its MLP as a decoder's."""
    return {"gather": _gather_rows(),
            "keep_rows": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(0),),
                                            use_local_output=True),
            "mlp": _gather_rows(), "mlp.down": RowwiseParallel(output_layouts=Shard(0))}


_SEQUENCE_PARALLEL: dict[str, tuple[Callable[[], Plan], tuple[str, ...]]] = {
    "patch_embed": (lambda: {}, ()),
    "vit_block": (_sequence_parallel_vit, ("norm1", "norm2")),
    "merger": (lambda: {}, ()),
    "embedding": (lambda: {}, ()),
    "dense_block": (lambda: _sequence_parallel_block("dense_block"), ("norm1", "norm2")),
    "moe_block": (lambda: _sequence_parallel_block("moe_block"), ("norm1", "norm2")),
    "lm_head": (lambda: {"proj": ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1),
                                                 use_local_output=False)}, ("norm",)),
}
"""Kind -> (its plan's sequence-parallel replacements, the norms that run on the rank's rows)."""


def _vit_block(d: dict, tp_degree: int) -> Plan:
    return _gqa("attn", d["heads"], tp_degree) | _mlp("mlp", gated=d["activation"] == "swiglu")


def _lm_head(d: dict, tp_degree: int) -> Plan:
    return {"proj": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}


_PLANS = {
    "patch_embed": lambda d, tp: {},
    "vit_block": _vit_block,
    "merger": lambda d, tp: _mlp("mlp", gated=False),
    "projector": lambda d, tp: {} if d["depth"] == 1 else _mlp("net", gated=False),
    "embedding": lambda d, tp: {"table": RowwiseParallel(input_layouts=Replicate())},  # every rank has all ids
    "dense_block": _dense_block,
    "moe_block": _moe_block,
    "lm_head": _lm_head,
}
"""Kind -> (resolved dimensions, tp degree) -> the plan of a module built by ``layers.build_layer``."""


def parallelize_layer(module: nn.Module, spec: LayerSpec, tp_mesh: DeviceMesh, *,
                      sequence_parallel: bool = False) -> nn.Module:
    """Split ``module`` (layer ``spec``, built whole on every rank) over the 1-D ``tp_mesh``, in place;
    with ``sequence_parallel`` a decoder layer (:data:`SEQUENCE_PARALLEL_KINDS`) takes and gives the
    rank's rows of the sequence (see :func:`is_sequence_parallel`).

    Raises :class:`~mpipe_tune.errors.MpipeError` when the mesh's size does not divide the layer's
    heads or widths (:func:`~mpipe_tune.runtime._blueprint.validate_tensor_parallel`).
    """
    tp_degree = tp_mesh.size()
    validate_tensor_parallel((spec,), tp_degree)
    plan = _PLANS[spec.kind](dict(spec.dims), tp_degree)
    if sequence_parallel and spec.kind in _SEQUENCE_PARALLEL:
        changes, norms = _SEQUENCE_PARALLEL[spec.kind]
        plan |= changes()
        for name in norms:
            for p in module.get_submodule(name).parameters():
                p.sequence_parallel = True  # Megatron-LM's mark: its gradient is this rank's rows' share
    if plan:
        parallelize_module(module, tp_mesh, plan, src_data_rank=None)
    if spec.kind == "lm_head":  # the loss of vocab-sharded logits is a replicated DTensor: hand on a plain scalar
        parallelize_module(module, tp_mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                desired_output_layouts=Replicate()))
    if sequence_parallel and spec.kind in ("patch_embed", "embedding"):  # the whole (padded) sequence, the rank's rows out
        parallelize_module(module, tp_mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                desired_output_layouts=Shard(0)))
    if sequence_parallel and spec.kind == "merger":  # the rows gathered before patches are merged
        parallelize_module(module, tp_mesh, PrepareModuleInput(input_layouts=(Shard(0), None),
                                                               desired_input_layouts=(Replicate(), None),
                                                               use_local_output=True))
    module.register_forward_hook(_wait_output)
    return module


def _wait_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A layer hands on a plain tensor: torch returns a row-split output whose all-reduce may still be
    in flight as an ``AsyncCollectiveTensor``, which ``detach()`` keeps and a pipeline send cannot take."""
    return wait_tensor(output) if isinstance(output, AsyncCollectiveTensor) else output  # differentiable


@contextlib.contextmanager
def tp_context(tp_mesh: DeviceMesh | None) -> Iterator[None]:
    """The context every forward and backward of layers split over ``tp_mesh`` must run in.

    It is torch's ``loss_parallel()``: the LM head's cross-entropy of vocab-sharded logits, and its
    backward, run on the shards with small all-reduces instead of gathering the logits. Enter it once
    around the whole step (the loss's backward may run long after its forward); it is process-wide
    and not reentrant. Outside it a split LM head's forward or backward fails (torch: "got mixed
    torch.Tensor and DTensor"). Nothing to do without a mesh of more than one rank.
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        yield
        return
    with loss_parallel():
        yield


SEQUENCE_PARALLEL_KINDS = tuple(_SEQUENCE_PARALLEL)
"""The kinds whose rows sequence parallelism shards (given or taken)."""


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sequence-parallel norm's weight: each rank of the tensor-parallel group
    holds the gradient of its own rows only, and the group's sum is the whole gradient (an all-reduce
    over the group before any data-parallel reduce, as Megatron-LM does for its layer norms)."""
    return getattr(param, "sequence_parallel", False)


def full_gradient(param: torch.Tensor) -> torch.Tensor:
    """The whole gradient of ``param``: a DTensor's gathered over its mesh (a collective every rank of
    the tensor-parallel group must join, in the same order), a plain tensor's as it is."""
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad
