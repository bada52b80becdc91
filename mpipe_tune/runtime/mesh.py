"""A rank's place in the plan's device mesh, on torch's own ``DeviceMesh``, and its gradient reduces.

The mesh has dimensions ``("pp", "dp", "tp")`` of the plan's degrees, row-major over the global
ranks exactly as :class:`~mpipe_tune.runtime.layout.ParallelLayout` numbers them (tensor parallelism
innermost). From it a rank takes:

- ``tp_mesh``: the 1-D mesh of its tensor-parallel group, handed to ``torch.distributed.tensor.parallel``;
- the DataGroup of a Sharded region's reduce: the ``dp`` ranks that hold the same slab (same pp and
  tp coordinates);
- the ReplicaGroup of the replicated encoder's reduce: all ``pp * dp`` ranks of its tp coordinate
  (the ``pp`` and ``dp`` dimensions flattened), since every pipeline rank of every replica holds it.

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

from mpipe_tune.algebra.events import Group
from mpipe_tune.runtime.layout import MESH_DIMS, ParallelLayout

BUCKET_BYTES = 25 * 2**20
"""Gradients are all-reduced in flat buckets of at most this many bytes (one bucket at least per tensor)."""


@dataclass(frozen=True)
class RankMesh:
    layout: ParallelLayout
    rank: int
    """Global rank."""
    mesh: DeviceMesh
    replica_mesh: DeviceMesh
    """The ``pp`` and ``dp`` dimensions flattened into one (the ReplicaGroup)."""

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

    def peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's (dp, tp) coordinate."""
        return self.layout.peer(self.rank, pp_rank)

    def reduce_group(self, group: Group) -> dist.ProcessGroup | None:
        """The process group a DpReduce of ``group`` reduces over; ``None`` when it has one member."""
        if group is Group.REPLICA:
            return self.replica_mesh.get_group() if self.layout.pp * self.layout.dp > 1 else None
        return self.mesh["dp"].get_group() if self.layout.dp > 1 else None


_MESHES: dict[tuple[str, ParallelLayout], RankMesh] = {}


def rank_mesh(layout: ParallelLayout, device_type: str) -> RankMesh:
    """This process's :class:`RankMesh` for ``layout`` (built on first use; every rank must call it)."""
    key = (device_type, layout)
    if key not in _MESHES:
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
        replica = mesh["pp", "dp"]._flatten(f"replica_{layout.pp}x{layout.dp}x{layout.tp}")
        _MESHES[key] = RankMesh(layout, dist.get_rank(), mesh, replica)
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
    offset = 0
    for t in bucket:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
