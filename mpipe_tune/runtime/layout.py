"""Where a plan's ranks sit: the (pp, dp, tp) grid of devices, as plain data (no torch).

The cost model lays devices out with tensor parallelism innermost, then data, then pipeline
(:mod:`mpipe_tune.cost.durations`), so that a tensor-parallel group stays inside a node. The
runtime uses the same row-major order for its ``DeviceMesh`` of shape ``(pp, dp, tp)``:

>>> layout = ParallelLayout(pp=2, dp=2, tp=2)
>>> layout.world_size
8
>>> layout.coordinates(5)
(1, 0, 1)
>>> layout.global_rank(pp_rank=1, dp_rank=0, tp_rank=1)
5

Every (dp, tp) coordinate runs the plan's per-rank order of its pipeline rank on its own data
replica; a point-to-point transfer between pipeline ranks ``a`` and ``b`` stays within one
(dp, tp) coordinate (:meth:`ParallelLayout.peer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpipe_tune.errors import MpipeError

MESH_DIMS = ("pp", "dp", "tp")
"""The runtime's DeviceMesh dimension names, outermost first."""


@dataclass(frozen=True)
class ParallelLayout:
    pp: int
    """Pipeline ranks (the plan's P)."""
    dp: int
    """Data-parallel replicas of the whole pipeline."""
    tp: int
    """Tensor-parallel ranks of every stage."""

    @classmethod
    def of_candidate(cls, candidate: dict[str, Any]) -> ParallelLayout:
        return cls(int(candidate["pp"]), int(candidate.get("dp", 1)), int(candidate.get("tp", 1)))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of global rank ``rank``."""
        assert 0 <= rank < self.world_size, rank
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def peer(self, rank: int, pp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` in ``rank``'s (dp, tp) coordinate."""
        _, dp_rank, tp_rank = self.coordinates(rank)
        return self.global_rank(pp_rank, dp_rank, tp_rank)

    def __str__(self) -> str:
        return f"pp{self.pp} x dp{self.dp} x tp{self.tp}"

    def validate_world_size(self, world_size: int, where: str) -> None:
        if world_size != self.world_size:
            raise MpipeError(
                f"{where} is laid out {self} = {self.world_size} ranks but the world size is {world_size}; launch "
                f"{self.world_size} processes (torchrun --nproc-per-node {self.world_size} on one node) or re-plan "
                f"for {world_size} devices"
            )
