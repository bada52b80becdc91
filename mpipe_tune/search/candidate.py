"""A planning candidate: one point of the search space, as plain data.

A candidate fixes everything ``derive`` and the cost model need except the workload: the cut, the
skeleton list (normal form), the pipeline / tensor / data degrees, the microbatch count, the owner
policy of the transposed region, and optionally explicit ByLayer slab counts (the baselines give
them; searched candidates leave them ``None``, meaning slabs balanced by expected layer cost).

>>> c = Candidate("transpose,1f1b", (9,), pp=4, tp=1, dp=1, num_microbatches=8, owner_policy="greedy")
>>> str(c)
'<transpose,1f1b> cut 9  pp4 tp1 dp1  M=8  owners greedy'
>>> Candidate.from_dict(c.to_dict()) == c
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpipe_tune.algebra.schedule import Cut, Schedule, Skeleton, parse_schedule


@dataclass(frozen=True)
class Candidate:
    schedule: str
    """Skeleton list in its text form, e.g. ``"transpose,1f1b"``; always in normal form."""
    cut: tuple[int, ...]
    """Interior boundaries, one fewer than the skeletons."""
    pp: int
    tp: int
    dp: int
    num_microbatches: int
    """Microbatches per pipeline replica per step."""
    owner_policy: str | None = None
    """ByMicrobatch policy of the transposed region (``round-robin``, ``greedy``, ``optimal``);
    ``None`` for schedules without a transpose."""
    slab_counts: tuple[tuple[int, ...], ...] | None = None
    """Per Sharded region, each rank's layer count; ``None``: balanced by expected layer cost."""
    recompute: bool = False
    """Full activation recomputation (less memory, one more forward per backward)."""
    label: str = ""
    """A baseline's name (``megatron``, ...); empty for searched candidates."""

    @property
    def setting(self) -> tuple[int, int, int, bool]:
        """What a layer table depends on besides the step: (tp, dp, M, recompute)."""
        return (self.tp, self.dp, self.num_microbatches, self.recompute)

    def parsed(self) -> tuple[Cut, Schedule]:
        return Cut(self.cut), parse_schedule(self.schedule)

    @property
    def has_transpose(self) -> bool:
        return Skeleton.TRANSPOSE.value in self.schedule.split(",")

    @property
    def degrees(self) -> str:
        return f"pp{self.pp} tp{self.tp} dp{self.dp}"

    def __str__(self) -> str:
        cut = ",".join(map(str, self.cut)) or "-"
        owners = f"  owners {self.owner_policy}" if self.owner_policy else ""
        slabs = "  slabs " + "/".join("-".join(map(str, c)) for c in self.slab_counts) if self.slab_counts else ""
        recompute = "  recompute" if self.recompute else ""
        return f"<{self.schedule}> cut {cut}  {self.degrees}  M={self.num_microbatches}{owners}{slabs}{recompute}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule, "cut": list(self.cut), "pp": self.pp, "tp": self.tp, "dp": self.dp,
            "microbatches": self.num_microbatches, "owner_policy": self.owner_policy,
            "slab_counts": [list(c) for c in self.slab_counts] if self.slab_counts else None,
            "recompute": self.recompute, "label": self.label,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        slabs = data.get("slab_counts")
        return cls(
            schedule=data["schedule"], cut=tuple(data["cut"]), pp=int(data["pp"]), tp=int(data["tp"]),
            dp=int(data["dp"]), num_microbatches=int(data["microbatches"]), owner_policy=data.get("owner_policy"),
            slab_counts=tuple(tuple(c) for c in slabs) if slabs else None, recompute=bool(data.get("recompute", False)),
            label=data.get("label", ""),
        )
