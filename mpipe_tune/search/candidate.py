"""A planning candidate: one point of the search space, as plain data.

A candidate fixes everything ``derive`` and the cost model need except the workload: the cut, the
skeleton list (normal form), the pipeline / tensor / data degrees (and the expert- and
context-parallel ones), the microbatch count, the owner policy of the transposed region, the memory
policy (recomputation, ZeRO stage, sequence parallelism), and optionally explicit ByLayer slab counts
(the baselines give them; searched candidates leave them ``None``, meaning slabs balanced by expected
layer cost). Fields added after the first plan files default to what those files meant.

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
from mpipe_tune.cost.layers import normalize_recompute, recompute_granularity


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
    recompute: bool | str = False
    """Activation recomputation: ``False`` (none), ``"selective"`` (the attention core) or ``True``
    (full: less memory, one more forward per backward); ``"none"``/``"full"`` read as the booleans."""
    label: str = ""
    """A baseline's name (``megatron``, ...); empty for searched candidates."""
    ep: int = 1
    """Expert-parallel degree, carved from the data- (and context-) parallel ranks."""
    cp: int = 1
    """Context-parallel degree: ``pp * tp * cp * dp`` devices."""
    zero_stage: int = 1
    """1: distributed optimizer (ZeRO-1, optimizer state sharded over the data-parallel ranks); 0: none."""
    sequence_parallel: bool = False
    """Sequence parallelism with tp (Megatron-LM's)."""
    encoder_tp: int | None = None
    """The encoder block's own tensor-parallel degree, a divisor of ``tp`` (the other ``tp /
    encoder_tp`` ranks of each group encode other images); ``None`` (stored for ``tp`` itself): ``tp``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", normalize_recompute(self.recompute))
        if self.encoder_tp == self.tp:
            object.__setattr__(self, "encoder_tp", None)

    @property
    def setting(self) -> tuple:
        """What a step's prediction depends on besides the schedule, the slabs and the step:
        (tp, dp, M, recompute, ep, cp, ZeRO stage, sequence parallelism, encoder tp)."""
        return (self.tp, self.dp, self.num_microbatches, self.recompute, self.ep, self.cp, self.zero_stage,
                self.sequence_parallel, self.encoder_tp)

    @property
    def num_devices(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    def parsed(self) -> tuple[Cut, Schedule]:
        return Cut(self.cut), parse_schedule(self.schedule)

    @property
    def has_transpose(self) -> bool:
        return Skeleton.TRANSPOSE.value in self.schedule.split(",")

    @property
    def degrees(self) -> str:
        """``pp4 tp2 dp8``, with ``ep`` and ``cp`` where they are above 1 (``pp4 tp2 dp8 ep4``) and the
        encoder's own tensor-parallel degree where it is set (``pp4 tp4 dp2 etp1``)."""
        extra = "".join(f" {name}{value}" for name, value in (("ep", self.ep), ("cp", self.cp)) if value > 1)
        extra += f" etp{self.encoder_tp}" if self.encoder_tp is not None else ""
        return f"pp{self.pp} tp{self.tp} dp{self.dp}{extra}"

    def __str__(self) -> str:
        cut = ",".join(map(str, self.cut)) or "-"
        owners = f"  owners {self.owner_policy}" if self.owner_policy else ""
        slabs = "  slabs " + "/".join("-".join(map(str, c)) for c in self.slab_counts) if self.slab_counts else ""
        granularity = recompute_granularity(self.recompute)
        recompute = {"none": "", "full": "  recompute"}.get(granularity, f"  recompute {granularity}")
        memory = ("  zero0" if self.zero_stage == 0 else "") + ("  sp" if self.sequence_parallel else "")
        return (f"<{self.schedule}> cut {cut}  {self.degrees}  M={self.num_microbatches}{owners}{slabs}{recompute}"
                f"{memory}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule, "cut": list(self.cut), "pp": self.pp, "tp": self.tp, "dp": self.dp,
            "ep": self.ep, "cp": self.cp, "encoder_tp": self.tp if self.encoder_tp is None else self.encoder_tp,
            "microbatches": self.num_microbatches, "owner_policy": self.owner_policy,
            "slab_counts": [list(c) for c in self.slab_counts] if self.slab_counts else None,
            "recompute": self.recompute, "zero_stage": self.zero_stage, "sequence_parallel": self.sequence_parallel,
            "label": self.label,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        slabs = data.get("slab_counts")
        return cls(
            schedule=data["schedule"], cut=tuple(data["cut"]), pp=int(data["pp"]), tp=int(data["tp"]),
            dp=int(data["dp"]), num_microbatches=int(data["microbatches"]), owner_policy=data.get("owner_policy"),
            slab_counts=tuple(tuple(c) for c in slabs) if slabs else None, recompute=data.get("recompute", False),
            label=data.get("label", ""), ep=int(data.get("ep", 1)), cp=int(data.get("cp", 1)),
            zero_stage=int(data.get("zero_stage", 1)), sequence_parallel=bool(data.get("sequence_parallel", False)),
            encoder_tp=int(data["encoder_tp"]) if data.get("encoder_tp") is not None else None,
        )
