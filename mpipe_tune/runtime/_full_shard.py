"""ZeRO stages 2 and 3 of a rank's layers with torch FSDP2's ``fully_shard``.

At a plan's ``zero_stage`` 2 or 3 every layer module a rank holds is ``fully_shard``-ed on the data-parallel
dimension of its mesh (:attr:`~mpipe_tune.runtime._mesh.RankMesh.data_mesh`, dp x cp flattened; FSDP2
composes it with the tensor-parallel dimension of a split layer's DTensor parameters into a 2-D
sharding). What a step gathers and reduce-scatters follows the plan's stage and reshard policy
(:attr:`~mpipe_tune.algebra._candidate.Candidate.reshards_after_forward`), as the cost model prices it
(:mod:`mpipe_tune.cost._sharding_events`):

- stage 3 resharding after forward (FSDP2's defaults): each layer's parameters are all-gathered before
  its forward and freed after it, all-gathered again for its backward, and its gradients are
  reduce-scattered after every microbatch's backward into the rank's shard;
- stage 2: the parameters are gathered by the first forward of the step and kept (FSDP2's
  ``reshard_after_forward=False`` and ``set_reshard_after_backward(False)``); every backward
  reduce-scatters its gradients;
- stage 3 keeping the weights (torch pipelining's UNSHARD / RESHARD / REDUCE_GRAD): gathered by the
  first forward and kept, the gradients accumulated whole by every backward
  (``set_requires_gradient_sync(False)``), then reduce-scattered once after the stage's last backward,
  the plan's ``reducegrad`` action (:func:`reduce_gradients`, what torch's ``perform_reduce_grad`` does).

The plan's program carries the stage's sharding actions (:mod:`mpipe_tune.algebra._sharding`): the
executor runs :func:`unshard` before the stage's first forward, :func:`reduce_gradients` after its last
backward (stage 3) and :func:`reshard` after that. Gradients are summed, not
averaged: the runtime's gradients are those of the summed loss. The routed experts of an expert-parallel MoE layer
are their own unit on the experts' data-parallel group (``edp``, the ranks that hold the same
experts), as torchtitan shards them; with one rank in that group they stay whole, outside the layer's
unit. Frozen layers are sharded too and have no gradient. The replicated encoder (a transpose plan)
is sharded the same way on every pipeline rank, so its replicas' shards line up and the replica reduce
sums the shards over the pipeline dimension only (:attr:`~mpipe_tune.runtime._mesh.RankMesh.pp_group`).

Between steps a rank holds only its shard: a parameter is a DTensor sharded on the data dimension
(``Shard(0)``, with the tensor-parallel placement beside it), its ``.grad`` the same, and the update
(plain SGD) applies to the local shards. What the runtime does itself at stage 3
(:class:`~mpipe_tune.runtime._compute.RealCompute`): no data-parallel all-reduce (FSDP's reduce-scatter
did it), the tensor-parallel sum of the sequence-parallel norms' gradients, the encoder groups' sum and
the replica sum over pipeline ranks on the local shards.

A split backward (the zero-bubble skeletons) computes the input gradient first (FSDP2's post-backward
then reduce-scatters nothing and reshards) and the weight gradients later: :func:`unsharded_parameters`
all-gathers the slab's units again and returns their whole parameters, the ones the kept autograd graph
uses, as the ``inputs`` of that second pass; FSDP2's end-of-backward callback reduce-scatters them.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from mpipe_tune.runtime._mesh import RankMesh


def is_fully_sharded(zero_stage: int, mesh: RankMesh) -> bool:
    """Whether a rank's layers are FSDP units: stage 2 or 3 with more than one data-parallel rank
    (with one, they are the unsharded stage 0)."""
    return zero_stage >= 2 and mesh.layout.dp * mesh.layout.cp > 1


def shard_layers(modules: dict[int, nn.Module], mesh: RankMesh, *, reshard_after_forward: bool = True,
                 sync_once: bool = False) -> None:
    """``fully_shard`` every module of ``modules`` in place (its routed experts first, as their own unit
    on their data-parallel group, or left out of the layer's unit when that group has one rank); without
    ``reshard_after_forward`` the gathered parameters are kept through the backward too, and with
    ``sync_once`` the backwards accumulate the gradients whole for :func:`reduce_gradients`."""
    for module in modules.values():
        sequence_parallel = {name for name, p in module.named_parameters() if getattr(p, "sequence_parallel", False)}
        ignored: set[nn.Parameter] = set()
        experts = _routed_experts(module)
        if experts is not None:
            if mesh.expert_data_group is not None:
                _shard(experts, mesh.expert_mesh["edp"], reshard_after_forward, sync_once)
            else:
                ignored = set(experts.parameters())
        _shard(module, mesh.data_mesh, reshard_after_forward, sync_once, ignored)
        for name, p in module.named_parameters():  # the sharded parameters are new objects: keep the mark
            if name in sequence_parallel:
                p.sequence_parallel = True


def _shard(module: nn.Module, mesh, reshard_after_forward: bool, sync_once: bool,
           ignored: set[nn.Parameter] | None = None) -> None:
    # each layer is an FSDP root (the runtime calls layers, not a model), and FSDP2 keeps a root's
    # parameters whole after its forward unless told: the policy is set on every layer
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None)
    if not reshard_after_forward:  # kept through the step: resharded by the stage's reduce (:func:`reshard`)
        module.set_reshard_after_backward(False)
    if sync_once:  # accumulated whole, reduce-scattered by the stage's reduce (:func:`reduce_gradients`)
        module.set_requires_gradient_sync(False)
    module.set_gradient_divide_factor(1.0)  # the sum over the group (FSDP2 averages by default)
    # a plain SUM reduce-scatter: for fp32 and bf16 FSDP2 would scale inside the collective (PREMUL_SUM),
    # which gloo lacks
    module.set_force_sum_reduction_for_comms(True)
    # a unit whose parameters one rank did not use (an expert no token of its microbatch chose) still
    # joins its group's reduce-scatter, with zeros
    module.set_reduce_scatter_unused_params(True)


def _routed_experts(module: nn.Module) -> nn.Module | None:
    """A MoE layer's routed experts when they are sharded over an expert-parallel group."""
    mlp = getattr(module, "mlp", None)
    return mlp.experts if getattr(mlp, "shard", None) is not None else None


def reduce_gradients(modules: Iterable[nn.Module]) -> None:
    """Stage 3 keeping the weights, after a stage's last backward (its reduce event, the plan's REDUCE_GRAD):
    reduce-scatter the gradients its backwards accumulated whole into the shards, as torch pipelining's
    ``perform_reduce_grad`` does (each FSDP state's post-backward run by hand, then its end-of-backward
    callback), and leave the units accumulating again for the next step."""
    for module in modules:  # each layer is an FSDP root; its routed experts, an inner unit, are in its states
        module.set_requires_gradient_sync(True)
        root = fully_shard.state(module)
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root._root_post_backward_final_callback()
        module.set_requires_gradient_sync(False)


def unshard(modules: Iterable[nn.Module]) -> None:
    """Gather the parameters of ``modules``' FSDP units now (torch pipelining's UNSHARD; a no-op for a unit
    already gathered); they stay gathered until :func:`reshard`."""
    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.unshard()


def reshard(modules: Iterable[nn.Module]) -> None:
    """Free the gathered parameters of ``modules``' FSDP units (a no-op for a unit already sharded): each
    parameter is its shard again, its gradient the reduce-scattered shard."""
    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def unsharded_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The trainable whole parameters of ``modules``' FSDP units, all-gathered now (every rank of each
    unit's group must call it, in the same order): the tensors a kept autograd graph differentiates."""
    modules = list(modules)
    unshard(modules)
    return [p for module in modules for p in module.parameters() if p.requires_grad]
