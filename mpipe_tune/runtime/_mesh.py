"""A rank's place in the plan's device mesh, on torch's own ``DeviceMesh``, and its gradient reduces.

As torchtitan builds its meshes, a 1-D world mesh is unflattened into views of the same devices,
row-major over the global ranks exactly as :class:`~mpipe_tune.runtime._layout.ParallelLayout`
numbers them (tensor parallelism innermost): the dense mesh ``("pp", "dp", "cp", "tp")`` and, with
expert parallelism, the expert mesh ``("pp", "edp", "ep", "tp")``. From them a rank takes:

- ``tp_mesh``: the 1-D mesh of its tensor-parallel group, handed to ``torch.distributed.tensor.parallel``;
- the DataGroup of a Sharded region's reduce: the ``dp * cp`` ranks that hold the same slab (same pp
  and tp coordinates; ``dp`` and ``cp`` flattened);
- the ReplicaGroup of the replicated encoder's reduce: all ``pp * dp * cp`` ranks of its tp
  coordinate, since every pipeline rank of every replica holds it;
- ``cp_group``: the context-parallel ring its decoder layers pass keys and values round
  (:mod:`~mpipe_tune.runtime._ring_attention`);
- ``ep_group``: the expert-parallel group its MoE layers dispatch tokens over (all-to-all), and
  ``expert_data_group``: the ``dp * cp / ep`` ranks holding the same experts, over which the routed
  experts' gradients are reduced (the rest of a DataGroup reduce goes over the whole DataGroup).

Meshes are built once per layout and process (building one is a collective of every rank) and kept
for later jobs of the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from mpipe_tune.algebra import Group
from mpipe_tune.runtime._layout import EXPERT_MESH_DIMS, MESH_DIMS, ParallelLayout

ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""All-gather into one flat tensor: torch 2.13's ``all_gather_single``, ``all_gather_into_tensor`` before it
(deprecated from 2.13, with a warning each call)."""
REDUCE_SCATTER_FROM = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""Reduce-scatter from one flat tensor: torch 2.13's ``reduce_scatter_single``, ``reduce_scatter_tensor`` before it."""

BUCKET_BYTES = 25 * 2**20
"""Gradients are all-reduced in flat buckets of at most this many bytes (one bucket at least per tensor)."""


@dataclass(frozen=True)
class RankMesh:
    layout: ParallelLayout
    rank: int
    """Global rank."""
    mesh: DeviceMesh
    replica_mesh: DeviceMesh
    """The ``pp``, ``dp`` and ``cp`` dimensions flattened into one (the ReplicaGroup)."""
    data_mesh: DeviceMesh
    """The ``dp`` and ``cp`` dimensions flattened into one (the DataGroup)."""
    expert_mesh: DeviceMesh | None = None
    """``("pp", "edp", "ep", "tp")`` when ep > 1."""
    encoder_mesh: DeviceMesh | None = None
    """The tp dimension as ``("etg", "etp")`` (encoder groups, the encoder's own tp) when encoder_tp < tp."""

    @property
    def encoder_tp_mesh(self) -> DeviceMesh | None:
        """The encoder's tensor-parallel group as a 1-D mesh (``tp_mesh`` itself without encoder groups)."""
        if self.encoder_mesh is None:
            return self.tp_mesh
        return self.encoder_mesh["etp"] if (self.layout.encoder_tp or self.layout.tp) > 1 else None

    @property
    def encoder_group_index(self) -> int:
        """Which encoder group of its tp group this rank is in."""
        return self.layout.coordinates(self.rank)[2] // (self.layout.encoder_tp or self.layout.tp)

    @property
    def encoder_replica_group(self) -> dist.ProcessGroup | None:
        """The ranks at this rank's place in the other encoder groups; ``None`` without encoder groups."""
        return self.encoder_mesh["etg"].get_group() if self.encoder_mesh is not None else None

    @property
    def pp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel group as a 1-D mesh; ``None`` when tp = 1."""
        return self.mesh["tp"] if self.layout.tp > 1 else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline ranks of this rank's (dp, cp, tp) coordinate; ``None`` when pp = 1."""
        return self.mesh["pp"].get_group() if self.layout.pp > 1 else None

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank(self.rank)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group (the ``cp`` ranks of one (pp, dp, tp) coordinate); ``None`` when cp = 1."""
        return self.mesh["cp"].get_group() if self.layout.cp > 1 else None

    def cp_neighbour(self, offset: int) -> int:
        """Global rank of context-parallel rank ``cp_rank + offset`` (mod cp) in this rank's coordinate."""
        pp_rank, dp_rank, tp_rank = self.layout.coordinates(self.rank)
        return self.layout.global_rank(pp_rank, dp_rank, tp_rank, (self.cp_rank + offset) % self.layout.cp)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group of this rank's MoE layers; ``None`` when ep = 1."""
        return self.expert_mesh["ep"].get_group() if self.expert_mesh is not None else None

    @property
    def expert_data_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold this rank's experts (``dp * cp / ep``); ``None`` with one member or ep = 1."""
        if self.expert_mesh is None or self.layout.expert_shape[1] == 1:
            return None
        return self.expert_mesh["edp"].get_group()

    def peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's (dp, cp, tp) coordinate."""
        return self.layout.peer(self.rank, pp_rank)

    def reduce_group(self, group: Group) -> dist.ProcessGroup | None:
        """The process group a DpReduce of ``group`` reduces over; ``None`` when it has one member."""
        replicas = self.layout.dp * self.layout.cp
        if group is Group.REPLICA:
            return self.replica_mesh.get_group() if self.layout.pp * replicas > 1 else None
        return self.data_mesh.get_group() if replicas > 1 else None


_MESHES: dict[tuple[str, ParallelLayout], RankMesh] = {}


def rank_mesh(layout: ParallelLayout, device_type: str) -> RankMesh:
    """This process's :class:`RankMesh` for ``layout`` (built on first use; every rank must call it)."""
    key = (device_type, layout)
    if key not in _MESHES:
        world = init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("world",))
        mesh = world._unflatten(0, layout.shape, MESH_DIMS)
        name = "x".join(map(str, layout.shape))
        replica = mesh["pp", "dp", "cp"]._flatten(f"replica_{name}")
        data = mesh["dp", "cp"]._flatten(f"data_{name}")
        experts = world._unflatten(0, layout.expert_shape, EXPERT_MESH_DIMS) if layout.ep > 1 else None
        groups = layout.encoder_groups
        encoder = (mesh._unflatten("tp", (groups, layout.tp // groups), ("etg", "etp")) if groups > 1 else None)
        _MESHES[key] = RankMesh(layout, dist.get_rank(), mesh, replica, data, experts, encoder)
    return _MESHES[key]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank reduces and updates); a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def all_reduce_bucketed(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup,
                        bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``tensors`` in place over ``group``: consecutive tensors of one dtype share a flat bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0].dtype):
            _reduce_bucket(bucket, group)
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        _reduce_bucket(bucket, group)


def _reduce_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat, group=group)
    unflatten_into(flat, bucket)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat``'s leading elements into the tensors, in order (the inverse of flattening them into it)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
