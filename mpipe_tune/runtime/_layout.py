"""Where a plan's ranks sit: the (pp, dp, cp, tp) grid of devices, as plain data (no torch).

The cost model lays devices out with tensor parallelism innermost, then context, then data, then
pipeline (:mod:`mpipe_tune.cost._durations`), so that a tensor-parallel group stays inside a node. The
runtime uses the same row-major order for its ``DeviceMesh`` of shape ``(pp, dp, cp, tp)``:

>>> layout = ParallelLayout(pp=2, dp=2, tp=2)
>>> layout.world_size
8
>>> layout.coordinates(5)
(1, 0, 1)
>>> layout.global_rank(pp_rank=1, dp_rank=0, tp_rank=1)
5

Every (dp, cp, tp) coordinate runs the plan's per-rank order of its pipeline rank, on its own data
replica (the ``cp`` ranks of a replica share its microbatches); a point-to-point transfer between
pipeline ranks ``a`` and ``b`` stays within one (dp, cp, tp) coordinate (:meth:`ParallelLayout.peer`).

Expert parallelism carves its groups from the ``dp x cp`` ranks of one (pp, tp) coordinate, as the
cost model does (:meth:`~mpipe_tune.cost._layers.CostOptions.validate_degrees`: ``ep`` divides
``dp * cp`` and is a multiple of ``cp``): flattening (dp, cp) to ``f = dp_rank * cp + cp_rank``, an
expert group is ``ep`` consecutive values of ``f`` (so its ``tp * ep`` devices are adjacent) and the
experts' own data-parallel group the ``dp * cp / ep`` ranks ``ep`` apart, the mesh
``(pp, edp, ep, tp)`` over the same devices (torchtitan's sparse mesh with ``etp = tp``):

>>> layout = ParallelLayout(pp=1, dp=4, tp=2, ep=2)
>>> layout.expert_coordinates(5)
(0, 1, 0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipe_tune.algebra import Degrees
from mpipe_tune.errors import MpipeError

MESH_DIMS = ("pp", "dp", "cp", "tp")
"""The runtime's DeviceMesh dimension names, outermost first."""
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")
"""The expert-parallel view of the same devices: ``edp * ep = dp * cp``."""


@dataclass(frozen=True)
class ParallelLayout:
    pp: int
    """Pipeline ranks (the plan's P)."""
    dp: int
    """Data-parallel replicas of the whole pipeline."""
    tp: int
    """Tensor-parallel ranks of every stage."""
    cp: int = 1
    """Context-parallel ranks of every data replica (they share its microbatches)."""
    ep: int = 1
    """Expert-parallel ranks, carved from the ``dp x cp`` ranks."""
    encoder_tp: int | None = None
    """The encoder's own tensor-parallel degree, a divisor of ``tp``; None: ``tp`` (as :class:`Degrees` has it)."""

    @property
    def encoder_groups(self) -> int:
        """Encoder groups per tensor-parallel group (``tp / encoder_tp``), each encoding its own images."""
        return self.tp // self.encoder_tp if self.encoder_tp else 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's shape, in :data:`MESH_DIMS` order."""
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def expert_shape(self) -> tuple[int, int, int, int]:
        """The expert mesh's shape, in :data:`EXPERT_MESH_DIMS` order."""
        return (self.pp, self.dp * self.cp // self.ep, self.ep, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of global rank ``rank`` (its cp rank: :meth:`cp_rank`)."""
        assert 0 <= rank < self.world_size, rank
        return rank // (self.dp * self.cp * self.tp), rank // (self.cp * self.tp) % self.dp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def expert_coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, edp_rank, ep_rank, tp_rank) of global rank ``rank`` in the expert mesh."""
        pp_rank, dp_rank, tp_rank = self.coordinates(rank)
        flat = dp_rank * self.cp + self.cp_rank(rank)
        return pp_rank, flat // self.ep, flat % self.ep, tp_rank

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def peer(self, rank: int, pp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` in ``rank``'s (dp, cp, tp) coordinate."""
        _, dp_rank, tp_rank = self.coordinates(rank)
        return self.global_rank(pp_rank, dp_rank, tp_rank, self.cp_rank(rank))

    def __str__(self) -> str:
        """The degrees' one text form (``pp2 tp2 dp4 ep2``)."""
        return str(Degrees(self.pp, self.tp, self.dp, self.ep, self.cp, self.encoder_tp))

    def validate_world_size(self, world_size: int, where: str) -> None:
        if world_size != self.world_size:
            raise MpipeError(
                f"{where} is laid out {self} = {self.world_size} ranks but the world size is {world_size}; launch "
                f"{self.world_size} processes (torchrun --nproc-per-node {self.world_size} on one node) or re-plan "
                f"for {world_size} devices"
            )
