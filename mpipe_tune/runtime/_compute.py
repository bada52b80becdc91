"""What a rank does for each compute event, real or emulated.

:class:`RealCompute` runs the rank's slabs of the MLLM with autograd. :class:`EmulatedCompute`
builds no model and sleeps for each compute event's predicted duration (``predicted.durations_s``
of the plan), so that the executor's transfers and waits can be timed against the prediction with
many ranks on few cores. Both answer the same calls from :class:`~mpipe_tune.runtime._executor.Executor`.

Data parallelism: replica ``d`` trains its own microbatches, of the plan's stored shapes, numbered
``d * M + m`` (their synthetic inputs and their losses are keyed by that number), so the ``dp``
replicas together train ``dp * M`` distinct microbatches. A reduce event sums the gradients of its
layers over its real process group (:mod:`mpipe_tune.runtime._mesh`): every trained weight's gradient
is that of the summed loss over all of them, as in the single-process reference. With expert
parallelism a rank's routed experts already hold the gradient of every row its expert group sent them
(the backward's all-to-alls bring it), and are summed over the experts' own data-parallel group. With context parallelism the ``cp`` ranks of a replica share its
microbatches, each computing its share of every decoder sequence (:mod:`~mpipe_tune.runtime._ring_attention`)
and the loss of its positions; the DataGroup reduce (dp x cp ranks) sums their gradients. With ZeRO-1 a
data-parallel reduce is a reduce-scatter, each rank keeping its shard of the summed gradients, and the update
all-gathers the weights, as a distributed optimizer does (the bytes :mod:`~mpipe_tune.cost._durations` prices).

A microbatch without images skips the encoder: the image-stream layers of a slab (patch embedding,
ViT blocks, merger, projector) are not called on it, their output is the empty tensor of the last
skipped layer's shape, and their backward is nothing. This is what the cost model charges (a layer
whose stream has no tokens costs nothing, :mod:`mpipe_tune.cost._arch`), and what a trainer does
with a text-only batch; the gradients are those of calling them on empty inputs (zero).

An encoder backward on another rank than its microbatch's encode (full recomputation,
:mod:`mpipe_tune.algebra._encoder_backward`): the owner's encode records no autograd (its stage has
no backward there), and the rank that runs the backward first re-runs the encode from the
microbatch's own synthetic images (drawn there, the same tensors) with autograd, then
back-propagates the gradient the Scatter brought; its weight gradients join the replica reduce as
any encoder backward's do.

A split backward (the zero-bubble skeletons): the ``Bwd`` computes only the gradient of the stage's
input, keeping the autograd graph, and the ``Wgrad`` later runs the graph again for the slab's
weight gradients (``torch.autograd.backward`` with ``inputs=`` each time). Eager autograd has no
way to stop half-way and resume, so the ``Wgrad`` recomputes the input-gradient path inside the slab
as well: the gradients equal an unsplit step's, the time is not a fused split's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpipe_tune.algebra import Action, Bwd, DpReduce, Fwd, Group, ReduceGrad, Reshard, Wgrad
from mpipe_tune.inputs import IMAGE_STREAM_KINDS
from mpipe_tune.runtime import _encoder_groups as encoder_groups
from mpipe_tune.runtime._blueprint import output_shape
from mpipe_tune.runtime._data import MicrobatchInputs
from mpipe_tune.runtime._full_shard import is_fully_sharded, reduce_gradients, reshard, unshard, unsharded_parameters
from mpipe_tune.runtime._mesh import (
    ALL_GATHER_INTO, REDUCE_SCATTER_FROM, RankMesh, all_reduce_bucketed, local_tensor, unflatten_into,
)
from mpipe_tune.runtime._mllm import LayerStack
from mpipe_tune.runtime._plan_view import PlanView
from mpipe_tune.runtime._tensor_parallel import tp_context


class RealCompute:
    def __init__(self, view: PlanView, mesh: RankMesh, stack: LayerStack, *, seed: int, dtype: torch.dtype,
                 device: torch.device, lr: float) -> None:
        self.view = view
        self.mesh = mesh
        self.rank = mesh.pp_rank
        self._first_mb = mesh.dp_rank * view.num_microbatches
        self.stack = stack
        self.seed = seed
        self.dtype = dtype
        self.device = device
        self.lr = lr
        self._text_start = next((s.index for s in stack.specs if s.kind not in IMAGE_STREAM_KINDS), len(stack.specs))
        """The first layer that is not image-stream (the encoder's layers come first)."""
        self._encoder_end = view.model.encoder_end
        """The first layer after the encoder block (the projector): encoder groups gather before it."""
        self.fully_sharded = is_fully_sharded(view.candidate.zero_stage, mesh)
        """ZeRO-2 and 3: the layers are FSDP units (:mod:`~mpipe_tune.runtime._full_shard`), which
        reduce-scatter the data-parallel gradients themselves."""
        self.keeps_weights = self.fully_sharded and not view.candidate.reshards_after_forward
        """ZeRO-2, and ZeRO-3 keeping the weights: the gathered parameters are kept until the stage's reduce."""
        self.syncs_once = self.keeps_weights and view.candidate.zero_stage == 3
        """ZeRO-3 keeping the weights: the gradients are reduce-scattered once, by the stage's reduce event."""
        self.scatters_gradients = view.candidate.zero_stage == 1 and not self.fully_sharded
        """ZeRO-1 (a distributed optimizer): a data-parallel reduce reduce-scatters its gradients into this
        rank's shard of them, and the update all-gathers the updated weights (:class:`GradientShard`)."""
        self._flat = FlatBuffers()
        """ZeRO-1's flat gradient and weight buffers, kept from step to step."""
        self.begin_step(view)

    def begin_step(self, view: PlanView | None = None) -> None:
        """A new step, of ``view`` when given (a step of its own: another owner map or other
        microbatches, :mod:`mpipe_tune.runtime._steps`), else of the same view as the last one."""
        if view is not None:
            self.view = view
            self._loss_sources = frozenset(view.loss_source.values())
            self._bwd_of: dict[tuple[int, int], int] = {
                (e.region, e.mb): i for i in view.nodes[self.rank] if isinstance(e := view.events[i], Bwd)
            }
            self._split = frozenset((e.region, e.mb) for i in view.nodes[self.rank]
                                    if isinstance(e := view.events[i], Wgrad))
            """(region, mb) whose backward is split: its Bwd leaves the weight gradients to a Wgrad."""
        self._inputs: dict[int, MicrobatchInputs] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        """A split backward's (output, output gradient; None from the loss), from its Bwd to its Wgrad."""
        self.losses: dict[int, float] = {}
        self._shards: list[GradientShard] = []
        """ZeRO-1: this step's reduce-scattered gradient shards, in reduce order."""
        self.stack.zero_grads()

    def _microbatch(self, m: int) -> MicrobatchInputs:
        if m not in self._inputs:
            self._inputs[m] = MicrobatchInputs(self.view.microbatches[m], self._first_mb + m, self.seed, self.dtype,
                                               self.device)
        return self._inputs[m]

    def forward(self, index: int, event: Fwd, x: torch.Tensor | None) -> torch.Tensor:
        start, stop = self.view.slab(event.region, event.rank)
        track = self.view.records_autograd(event)
        if x is not None:
            bwd = self._bwd_of.get((event.region, event.mb))
            x = x.detach().requires_grad_(bwd is not None and self.view.needs_input_grad(bwd))
        h = x
        if self.view.microbatches[event.mb].image_tokens == 0 and start < self._text_start:
            start, h = self._skip_encoder(event.mb, start, stop)
        with torch.set_grad_enabled(track), tp_context(self.mesh.tp_mesh):
            if self.mesh.encoder_mesh is not None and start < self._encoder_end:
                start, h = self._encode_in_groups(event.mb, start, stop, h)
            y = self.stack.run(start, stop, h, self._microbatch(event.mb)) if start < stop else h
        if track:
            self._saved[(event.region, event.mb)] = (x, y)
        if index in self._loss_sources:
            self._outputs[index] = y
        return y.detach()

    def _encode_in_groups(self, m: int, start: int, stop: int, h: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        """The slab's encoder layers on this rank's encoder group's images, then every group's features
        gathered in image order (:mod:`~mpipe_tune.runtime._encoder_groups`): where the run resumes."""
        layout, inputs = self.view.layout, self._microbatch(m)
        group, groups = self.mesh.encoder_group_index, layout.encoder_groups
        end = min(stop, self._encoder_end)
        h = self.stack.run(start, end, h, encoder_groups.subset_inputs(inputs, group, groups))
        last = self.stack.specs[end - 1]
        rows_per_token = output_shape(last, self.view.microbatches[m])[0] // max(1, self.view.microbatches[m].image_tokens)
        h = encoder_groups.gather_features(h, inputs, group, groups, rows_per_token, self.mesh.mesh["tp"].get_group(),
                                           layout.coordinates(self.mesh.rank)[2], layout.encoder_tp)
        return end, h

    def _skip_encoder(self, m: int, start: int, stop: int) -> tuple[int, torch.Tensor]:
        """Microbatch ``m`` has no images: where the slab's run resumes (the first text layer, or
        ``stop``) and the skipped image-stream layers' output, an empty tensor of the last one's shape."""
        resume = min(self._text_start, stop)
        shape = output_shape(self.stack.specs[resume - 1], self.view.microbatches[m])
        return resume, torch.empty(shape, dtype=self.dtype, device=self.device)

    def loss(self, index: int) -> None:
        """Record the microbatch's loss; with context parallelism each rank holds its positions' share,
        summed over the ring (one scalar all-reduce) so that every rank records the whole loss."""
        source = self.view.loss_source[index]
        loss = self._outputs.pop(source).detach()
        if self.mesh.cp_group is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.mesh.cp_group)
        self.losses[self._first_mb + self.view.events[source].mb] = float(loss)

    def backward(self, index: int, event: Bwd, grad: torch.Tensor | None) -> torch.Tensor | None:
        if (event.region, event.mb) not in self._saved:  # an encoder backward moved off its owner: encode here
            assert self.view.slab(event.region, event.rank)[0] == 0, f"{event} has no forward on rank {self.rank}"
            self.forward(index, Fwd(event.region, event.rank, event.mb), None)
        x, y = self._saved.pop((event.region, event.mb))
        split = (event.region, event.mb) in self._split
        if split:  # the weight gradients wait for the Wgrad; without an input gradient to send, so does all
            self._pending[(event.region, event.mb)] = (y, grad)
        if y.requires_grad and not (split and not self.view.needs_input_grad(index)):
            # not when every layer of the slab was skipped (an encoder slab, no images)
            assert grad is not None or index in self.view.loss_fed, f"{event} has no output gradient"
            with tp_context(self.mesh.tp_mesh):
                torch.autograd.backward(y, grad, inputs=[x] if split else None, retain_graph=split)
        if not self.view.needs_input_grad(index):
            return None
        assert x is not None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def weight_grad(self, index: int, event: Wgrad) -> None:
        """The weight gradients of a split backward: the slab's trainable parameters, from the graph and
        output gradient its Bwd kept."""
        y, grad = self._pending.pop((event.region, event.mb))
        if not y.requires_grad:
            return
        layers = range(*self.view.slab(event.region, event.rank))
        if self.fully_sharded:  # the graph holds the whole (all-gathered) parameters, freed since its Bwd
            parameters = unsharded_parameters(self.stack.modules[i] for i in layers if i in self.stack.modules)
        else:
            parameters = list(self.stack.trainable_parameters(layers))
        with tp_context(self.mesh.tp_mesh):
            torch.autograd.backward(y, grad, inputs=parameters)

    @torch.no_grad()
    def reduce(self, index: int, event: DpReduce) -> None:
        """Sum the gradients of the event's layers over its group; a sharded routed expert's over its
        own data-parallel group (the ranks holding the same experts) instead. Sequence-parallel norms'
        gradients are first summed over the tensor-parallel group (each rank's is its rows' share).

        Fully sharded (ZeRO-3), FSDP2 has already summed every microbatch's gradients over the data-parallel
        (and the experts' data-parallel) group into this rank's shards: a DataGroup reduce sums nothing
        more, and a ReplicaGroup reduce (the replicated encoder, sharded alike on every pipeline rank)
        sums the shards over the pipeline dimension only (kept weights were reduce-scattered and freed by
        the stage's sharding actions before: :meth:`act`)."""
        layers = range(*self.view.reduce_layers(event, self.rank))
        for part, mesh in ((range(layers.start, min(layers.stop, self._encoder_end)), self.mesh.encoder_tp_mesh),
                           (range(max(layers.start, self._encoder_end), layers.stop), self.mesh.tp_mesh)):
            own_rows = self.stack.sequence_parallel_parameters(part)
            if own_rows:  # sequence-parallel norms: each tp rank holds its rows' share (Megatron-LM's all-reduce)
                all_reduce_bucketed([local_tensor(p.grad) for p in own_rows], mesh.get_group())
        encoders = self.mesh.encoder_replica_group
        if encoders is not None:  # each encoder group holds its own images' gradient of the encoder
            own = [local_tensor(p.grad) for p in self.stack.trainable_parameters(
                range(layers.start, min(layers.stop, self._encoder_end)))]
            if own:
                all_reduce_bucketed(own, encoders)
        if self.fully_sharded:
            group = self.mesh.pp_group if event.group is Group.REPLICA else None
            if group is not None:
                all_reduce_bucketed([local_tensor(p.grad) for p in self.stack.trainable_parameters(layers)], group)
            return
        group = self.mesh.reduce_group(event.group)
        if group is None:
            return  # a group of one member (a DataGroup at dp = 1): nothing to reduce
        rest, experts = self.stack.split_routed_experts(layers)
        self._sum(rest, group, event.group is Group.DATA)
        expert_group = self.mesh.expert_data_group
        if experts and expert_group is not None:
            self._sum(experts, expert_group, True)

    def _sum(self, parameters, group: dist.ProcessGroup, shards: bool) -> None:
        """Sum the parameters' gradients over ``group``: with ZeRO-1, where the update shards them over that
        group (``shards``), a reduce-scatter into this rank's shard, as a distributed optimizer does (the
        update all-gathers the weights); else an all-reduce."""
        if shards and self.scatters_gradients:
            self._shards.extend(GradientShard.scatter(parameters, group, self._flat))
        else:
            all_reduce_bucketed([local_tensor(p.grad) for p in parameters], group)

    def act(self, action: Action) -> None:
        """A sharding action of one of the rank's stages (ZeRO-2, ZeRO-3 keeping the weights): gather its
        layers' weights, reduce-scatter the gradients its backwards accumulated (stage 3), or free them."""
        if not self.keeps_weights:
            return  # one data-parallel rank: nothing is sharded
        modules = [self.stack.modules[i] for i in range(*self.view.slab(action.region, action.rank))
                   if i in self.stack.modules]
        if isinstance(action, ReduceGrad):
            reduce_gradients(modules)
        elif isinstance(action, Reshard):
            reshard(modules)
        else:
            unshard(modules)

    def restore_gradients(self) -> None:
        """ZeRO-1: every reduce-scattered gradient put back whole (the shards all-gathered), for a gradient dump to
        read; the update reads only the shards."""
        for shard in self._shards:
            shard.gather_gradients()

    def update(self) -> None:
        """Plain SGD; with ZeRO-1 (the plan's ``zero_stage``) each rank updates its shard of the weights
        it shares with its data-parallel group and all-gathers the rest (:func:`sharded_sgd_update`); with
        ZeRO-2 and 3 each rank holds only its shards and updates them."""
        data_group = self.mesh.reduce_group(Group.DATA)
        if self.view.candidate.zero_stage < 1 or data_group is None or self.fully_sharded:
            sgd_update(self.stack.trainable_parameters(), self.lr)
            return
        done = set()
        for shard in self._shards:  # the gradients reduce-scattered by this step's reduces
            shard.update(self.lr)
            done.update(id(p) for p in shard.parameters)
        rest, experts = (
            [p for p in part if id(p) not in done] for part in self.stack.split_routed_experts(self.stack.modules))
        sharded_sgd_update(rest, self.lr, data_group, self._flat)
        if self.mesh.expert_data_group is not None:
            sharded_sgd_update(experts, self.lr, self.mesh.expert_data_group, self._flat)
        else:
            sgd_update(experts, self.lr)


@torch.no_grad()
def sgd_update(parameters, lr: float) -> None:
    """The runtime's optimizer step: plain SGD, ``p -= lr * grad`` per trainable parameter, no state
    (written out: building a torch.optim optimizer imports torch._dynamo, seconds per rank). Each
    parameter reads its weight and gradient and writes its weight; the profiler times this function
    for the profile's ``optimizer_update`` rate."""
    for p in parameters:
        p.add_(p.grad, alpha=-lr)


@torch.no_grad()
def sharded_sgd_update(parameters, lr: float, group: dist.ProcessGroup, buffers: FlatBuffers) -> None:
    """ZeRO-1's update of weights every rank of ``group`` holds whose gradients an all-reduce has already
    summed over it (the replicated encoder's, summed over every pipeline rank too): each rank updates its
    shard of them (:class:`GradientShard`, cut from the summed gradients) and all-gathers the rest."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for params in _by_dtype(parameters):
        grad = buffers.padded("gradients", params, [local_tensor(p.grad) for p in params], size)
        shard = grad.numel() // size
        GradientShard(params, group, grad[rank * shard:(rank + 1) * shard], buffers).update(lr)


class FlatBuffers:
    """Flat buffers kept from step to step, one per use and parameter list, as a trainer keeps its contiguous
    gradient and weight buffers: one allocated anew each step pays its page faults again (the allocator returns
    a large block to the OS when it is freed), on a CPU several times the copy into it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, use: str, parameters, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer of ``numel`` elements of ``like``'s dtype and device for ``use`` of ``parameters``."""
        key = (use, tuple(id(p) for p in parameters))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer

    def padded(self, use: str, parameters, tensors: list[torch.Tensor], size: int) -> torch.Tensor:
        """The tensors (one per parameter) flattened in order into ``use``'s buffer, zero-padded to a multiple
        of ``size``."""
        numel = sum(t.numel() for t in tensors)
        flat = self.get(use, parameters, -(-numel // size) * size, tensors[0])
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:numel])
        flat[numel:].zero_()
        return flat


@dataclass
class GradientShard:
    """ZeRO-1 (a distributed optimizer): this rank's shard of the summed gradients of ``parameters`` (one
    dtype), flattened in order and padded to a multiple of the group's size, one shard per rank. Each rank
    applies SGD to its shard of the weights only and an all-gather gives every rank all of them (its
    optimizer state, none for plain SGD, would be the shard's alone)."""

    parameters: list[torch.nn.Parameter]
    group: dist.ProcessGroup
    grad: torch.Tensor
    buffers: FlatBuffers

    @classmethod
    def scatter(cls, parameters, group: dist.ProcessGroup, buffers: FlatBuffers) -> list[GradientShard]:
        """Reduce-scatter the parameters' gradients over ``group``: one shard per dtype."""
        size, shards = dist.get_world_size(group), []
        for params in _by_dtype(parameters):
            flat = buffers.padded("gradients", params, [local_tensor(p.grad) for p in params], size)
            mine = buffers.get("gradient shard", params, flat.numel() // size, flat)
            REDUCE_SCATTER_FROM(mine, flat, group=group)
            shards.append(cls(params, group, mine, buffers))
        return shards

    @torch.no_grad()
    def gather_gradients(self) -> None:
        """Every rank's shard all-gathered into the parameters' gradients (the summed gradients, whole)."""
        flat = torch.empty(self.grad.numel() * dist.get_world_size(self.group), dtype=self.grad.dtype,
                           device=self.grad.device)
        ALL_GATHER_INTO(flat, self.grad, group=self.group)
        unflatten_into(flat, [local_tensor(p.grad) for p in self.parameters])

    @torch.no_grad()
    def update(self, lr: float) -> None:
        """SGD on this rank's shard of the weights, then every rank's shard all-gathered into the weights."""
        weights = [local_tensor(p) for p in self.parameters]
        flat = self.buffers.padded("weights", self.parameters, weights, dist.get_world_size(self.group))
        rank, shard = dist.get_rank(self.group), self.grad.numel()
        mine = self.buffers.get("weight shard", self.parameters, shard, flat)
        torch.add(flat[rank * shard:(rank + 1) * shard], self.grad, alpha=-lr, out=mine)
        ALL_GATHER_INTO(flat, mine, group=self.group)
        unflatten_into(flat, weights)


def _by_dtype(parameters) -> list[list[torch.nn.Parameter]]:
    """The parameters grouped by dtype, each group in the given order."""
    groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in parameters:
        groups.setdefault(p.dtype, []).append(p)
    return list(groups.values())


class EmulatedCompute:
    """Sleeps for each compute event's predicted seconds; a reduce is a real one-element all-reduce over
    its group (the join of its members, as the shared event is in the order graph) followed by its
    predicted seconds."""

    def __init__(self, view: PlanView, mesh: RankMesh, device: torch.device) -> None:
        self.view = view
        self.mesh = mesh
        self.device = device
        self.losses: dict[int, float] = {}

    def begin_step(self, view: PlanView | None = None) -> None:
        if view is not None:
            self.view = view

    def _sleep(self, index: int, started: float) -> None:
        remaining = started + self.view.durations_s[index] - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def forward(self, index: int, event: Fwd, x: None) -> None:
        self._sleep(index, time.perf_counter())

    def loss(self, index: int) -> None:
        pass

    def backward(self, index: int, event: Bwd, grad: None) -> None:
        self._sleep(index, time.perf_counter())

    def weight_grad(self, index: int, event: Wgrad) -> None:
        self._sleep(index, time.perf_counter())

    def act(self, action) -> None:
        """Sharding actions take no time of their own here (the plan file's event seconds hold their actions')."""

    def reduce(self, index: int, event: DpReduce) -> None:
        group = self.mesh.reduce_group(event.group)
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        self._sleep(index, time.perf_counter())

    def update(self) -> None:
        pass
