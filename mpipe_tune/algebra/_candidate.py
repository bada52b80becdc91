"""A planning candidate: one point of the search space, as plain data.

A candidate fixes everything ``derive`` and the cost model need except the workload: the cut, the
skeleton list (normal form), the pipeline / tensor / data degrees (and the expert- and
context-parallel ones, and the encoder's own tensor-parallel degree), the microbatch count, the owners
of the transposed region (a policy, an explicit map, or both: the map a policy chose for one step),
where each rank runs the encoder backwards it owns (a placement, and for ``optimised`` its slots),
the memory policy (recomputation, ZeRO stage, sequence parallelism), the compute dtype, the frozen
blocks, and optionally explicit ByLayer slab counts (the baselines give them; searched candidates
leave them ``None``, meaning slabs balanced by expected layer cost). Fields added after the first plan
files default to what those files meant.

It lives in the algebra, below the cost model and the search: the CLI parses its flags into one,
the search samples them, ``predict`` takes one and plan.json stores one (:meth:`Candidate.to_dict`).

>>> c = Candidate("transpose,1f1b", (9,), pp=4, tp=1, dp=1, num_microbatches=8, owner_policy="greedy")
>>> str(c)
'<transpose,1f1b> cut 9  pp4 tp1 dp1  M=8  owners greedy'
>>> Candidate.parse(str(c)) == c and Candidate.from_dict(c.to_dict()) == c
True
>>> c.degrees
Degrees(pp=4, tp=1, dp=1, ep=1, cp=1, encoder_tp=None)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mpipe_tune.algebra._candidate_text import (
    DTYPE_BYTES, RECOMPUTE_GRANULARITIES, format_candidate, normalize_recompute, parse_candidate_fields,
    recompute_granularity,
)
from mpipe_tune.algebra._degrees import Degrees
from mpipe_tune.algebra._derive import Owners, derive
from mpipe_tune.algebra._encoder_backward import COOLDOWN, EncoderBackward, validate_placement
from mpipe_tune.algebra._model import Model
from mpipe_tune.algebra._plan import Plan
from mpipe_tune.algebra._schedule import Cut, Schedule, Skeleton, parse_schedule
from mpipe_tune.errors import MpipeError

__all__ = ["DTYPE_BYTES", "GRAD_REDUCE_DTYPES", "MAX_DEVICES", "MOE_DISPATCHERS", "RECOMPUTE_GRANULARITIES", "ROUND_ROBIN",
           "ZERO_SETTINGS", "ZERO_STAGES", "Candidate", "Degrees", "default_cut", "default_reshard_after_forward",
           "normalize_recompute", "recompute_granularity", "validate_zero_stage"]
MAX_DEVICES = 1 << 16
"""The most devices a problem or a candidate may have (65536): more than any pipeline-parallel training job spans."""
ROUND_ROBIN = "round-robin"
"""The static owner policy: microbatch m on rank m mod P."""
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
"""The dtypes frameworks reduce data-parallel gradients in (``CostOptions.grad_reduce_dtype``)."""
MOE_DISPATCHERS = ("alltoall", "allgather")
"""Megatron-Core's MoE token dispatchers the cost model runs (``CostOptions.moe_dispatcher``, :mod:`mpipe_tune.cost._moe`),
its default first."""
KERNEL_MODES = ("eager", "fused", "compiled", "graphs")
"""How a trainer launches its kernels (``CostOptions.kernel_mode``, :mod:`mpipe_tune.cost._kernel_model`)."""
DEFAULT_KERNEL_MODE = "fused"
"""Megatron-LM's: Transformer Engine's fused kernels, issued one by one from Python."""

ZERO_STAGES = (0, 1, 2, 3)
"""The ZeRO stages a candidate takes: 0 (none), 1 (optimizer state sharded over the data-parallel ranks), 2
(gradients too: reduce-scattered after every backward, the weights gathered once a step) and 3 (the weights
too, torch FSDP2's full sharding per layer, with a reshard policy: :attr:`Candidate.reshard_after_forward`)."""


def validate_zero_stage(value: object, where: str = "the ZeRO stage") -> int:
    """``value`` as a ZeRO stage of :data:`ZERO_STAGES`, or one line naming the allowed values."""
    if isinstance(value, bool) or value not in ZERO_STAGES:
        raise MpipeError(f"{where} is {value!r}, but it must be one of {', '.join(map(str, ZERO_STAGES))}")
    return int(value)


ZERO_SETTINGS = {"0": (0, None), "1": (1, None), "2": (2, None), "3": (3, None), "3-reshard": (3, True),
                 "3-keep": (3, False)}
"""The words of a ZeRO setting on the command line: (stage, :attr:`Candidate.reshard_after_forward`)."""


def default_reshard_after_forward(pp: int) -> bool:
    """Whether ZeRO-3 reshards a stage's weights after each forward when the candidate does not say:
    at ``pp = 1`` yes (FSDP2's default), under pipeline parallelism no (torchtitan's default there,
    ``fsdp_reshard_after_forward = "default"``: the gathered weights are kept through the step).

    >>> default_reshard_after_forward(1), default_reshard_after_forward(4)
    (True, False)
    """
    return pp == 1


def default_cut(model: Model, num_regions: int) -> Cut:
    """One region: no cut. Two regions: the boundary before the first backbone layer
    (:attr:`Model.backbone_start`). More regions need their boundaries given."""
    if num_regions == 1:
        return Cut(())
    if num_regions == 2 and model.backbone_start:
        return Cut((model.backbone_start,))
    if num_regions == 2:  # no encoder in front of the backbone: no boundary to default to
        raise MpipeError(f"a schedule of 2 regions needs a cut, and model '{model.name}' has no encoder before its "
                         f"backbone to cut at: give the cut N (0 < N < {model.num_layers}) or a one-region "
                         f"schedule (`mpipe-tune predict --schedule 1f1b`)", quantities=("cut",))
    raise MpipeError(f"a schedule of {num_regions} regions needs a cut of {num_regions - 1} boundaries "
                     f"(model '{model.name}' has {model.num_layers} layers): give the cut as "
                     f"{num_regions - 1} increasing layer indices", quantities=("cut",))


_UNSET: Any = object()
"""A keyword a caller left out (``encoder_tp=None`` means "equal to tp")."""


@dataclass(frozen=True, init=False)
class Candidate:
    """One point of the search space: everything ``derive`` and the cost model need besides the
    workload (see the module docstring). Its degrees are one :class:`~mpipe_tune.algebra._degrees.Degrees`
    record, read through :attr:`pp`, :attr:`tp`, ... as well; it is built with them as keywords
    (``Candidate("1f1b", (), pp=4, tp=1, dp=2, num_microbatches=8)``) or with ``degrees=``, and its
    text form (``str``) parses back (:meth:`parse`)."""

    schedule: str
    """Skeleton list in its text form, e.g. ``"transpose,1f1b"``; always in normal form."""
    cut: tuple[int, ...]
    """Interior boundaries, one fewer than the skeletons."""
    degrees: Degrees
    """The parallel degrees (pp, tp, dp, ep, cp and the encoder's tp)."""
    num_microbatches: int
    """Microbatches per pipeline replica per step."""
    owner_policy: str | None = None
    """ByMicrobatch policy of the transposed region (``round-robin``, ``greedy``, ``optimal``);
    ``None`` for schedules without a transpose (and for an explicit :attr:`owner_map` alone)."""
    slab_counts: tuple[tuple[int, ...], ...] | None = None
    """Per Sharded region, each rank's layer count; ``None``: balanced by expected layer cost."""
    recompute: bool | str = False
    """Activation recomputation: ``False`` (none), ``"selective"`` (the attention core) or ``True``
    (full: less memory, one more forward per backward); ``"none"``/``"full"`` read as the booleans."""
    label: str = ""
    """A baseline's name (``megatron``, ...); empty for searched candidates."""
    zero_stage: int = 1
    """1: distributed optimizer (ZeRO-1, optimizer state sharded over the data-parallel ranks); 2: gradients
    sharded too (reduce-scattered after every microbatch's backward, the weights gathered once a step); 3:
    weights sharded too (torch FSDP2's ``fully_shard`` per layer, :mod:`mpipe_tune.cost._sharding_events`); 0: none
    (:data:`ZERO_STAGES`)."""
    reshard_after_forward: bool | None = None
    """At ZeRO stage 3, the reshard policy (FSDP2's ``reshard_after_forward``): ``True`` gathers each layer's
    weights before every forward and again before every backward, ``False`` gathers a stage's weights once
    before its first forward of the step and keeps them until its last backward, whose gradients are
    reduce-scattered once (torch pipelining's UNSHARD / RESHARD / REDUCE_GRAD actions, what torchtitan runs
    under pipeline parallelism); ``None``: the default for the pipeline degree
    (:func:`default_reshard_after_forward`). Always ``None`` at the other stages."""
    sequence_parallel: bool = False
    """Sequence parallelism with tp (Megatron-LM's)."""
    owner_map: tuple[int, ...] | None = None
    """Explicit ByMicrobatch owners of the transposed region, the rank of microbatch 0, 1, ...; it wins
    over :attr:`owner_policy` (which then records how it was chosen). ``None``: the policy decides."""
    dtype: str = "bf16"
    """Compute and activation dtype (a key of :data:`DTYPE_BYTES`)."""
    frozen: tuple[str, ...] = ()
    """Blocks whose layers are frozen (``Model.with_frozen``), e.g. ``("encoder",)``."""
    encoder_backward: str = COOLDOWN
    """Where each rank runs the encoder backwards it owns (:mod:`~mpipe_tune.algebra._encoder_backward`):
    ``cooldown``, ``earliest`` or ``optimised``; it moves nothing without a trainable transposed region."""
    encoder_backward_slots: tuple[int, ...] | None = None
    """Explicit slots of the encoder backwards, one per microbatch (what ``optimised`` chose for one
    step); ``None``: the placement decides."""
    encoder_backward_ranks: tuple[int, ...] | None = None
    """The rank that runs each microbatch's encoder backward, with explicit slots (what ``optimised``
    chose under full recomputation, :attr:`moves_encoder_backward`); ``None``: every owner its own."""

    def __init__(self, schedule: str, cut: tuple[int, ...], pp: int | None = None, tp: int | None = None,
                 dp: int | None = None, num_microbatches: int | None = None, owner_policy: str | None = None,
                 slab_counts: tuple[tuple[int, ...], ...] | None = None, recompute: bool | str = False,
                 label: str = "", ep: int | None = None, cp: int | None = None, zero_stage: int = 1,
                 sequence_parallel: bool = False, encoder_tp: int | None = _UNSET,
                 owner_map: tuple[int, ...] | None = None, dtype: str = "bf16", frozen: tuple[str, ...] = (),
                 encoder_backward: str = COOLDOWN, encoder_backward_slots: tuple[int, ...] | None = None,
                 encoder_backward_ranks: tuple[int, ...] | None = None, reshard_after_forward: bool | None = None, *,
                 degrees: Degrees | None = None) -> None:
        given = {name: value for name, value in (("pp", pp), ("tp", tp), ("dp", dp), ("ep", ep), ("cp", cp))
                 if value is not None}
        if encoder_tp is not _UNSET:
            given["encoder_tp"] = encoder_tp
        if degrees is None:
            assert pp is not None, "a candidate needs its pipeline degree (pp=, or degrees=)"
            degrees = Degrees(**given)
        elif given:
            degrees = replace(degrees, **given)
        assert num_microbatches is not None, "a candidate needs its microbatch count"
        for name, value in (("schedule", schedule), ("cut", cut), ("degrees", degrees),
                            ("num_microbatches", num_microbatches), ("owner_policy", owner_policy),
                            ("slab_counts", slab_counts), ("recompute", normalize_recompute(recompute)),
                            ("label", label), ("zero_stage", zero_stage), ("sequence_parallel", sequence_parallel),
                            ("owner_map", owner_map), ("dtype", dtype), ("frozen", frozen),
                            ("encoder_backward", encoder_backward), ("encoder_backward_slots", encoder_backward_slots),
                            ("encoder_backward_ranks", encoder_backward_ranks),
                            ("reshard_after_forward", reshard_after_forward if zero_stage == 3 else None)):
            object.__setattr__(self, name, value)

    @property
    def pp(self) -> int:
        return self.degrees.pp

    @property
    def tp(self) -> int:
        return self.degrees.tp

    @property
    def dp(self) -> int:
        return self.degrees.dp

    @property
    def ep(self) -> int:
        """Expert-parallel degree, carved from the data- (and context-) parallel ranks."""
        return self.degrees.ep

    @property
    def cp(self) -> int:
        """Context-parallel degree: ``pp * tp * cp * dp`` devices."""
        return self.degrees.cp

    @property
    def encoder_tp(self) -> int | None:
        """The encoder block's own tensor-parallel degree, a divisor of ``tp``; ``None``: ``tp``."""
        return self.degrees.encoder_tp

    def validate(self) -> None:
        """One-line :class:`MpipeError` naming the quantity, for what holds of a candidate on its own
        (what needs the model or the workload is checked by ``derive`` and the cost model)."""
        self.degrees.validate()
        value = self.num_microbatches
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MpipeError(f"the microbatch count M is {value!r}, but M must be an integer >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise MpipeError(f"dtype {self.dtype!r} is not a known dtype; use one of {', '.join(DTYPE_BYTES)}")
        validate_zero_stage(self.zero_stage)
        if self.owner_map is not None and not self.has_transpose:
            raise MpipeError(f"the owner map {','.join(map(str, self.owner_map))} is given, but schedule "
                             f"<{self.schedule}> has no transpose region, so no microbatch has an owner; drop the "
                             f"owners or use a schedule with transpose")
        validate_placement(self.encoder_backward)
        if self.encoder_backward != COOLDOWN and not self.has_transpose:
            raise MpipeError(f"the encoder backward placement {self.encoder_backward!r} is given, but schedule "
                             f"<{self.schedule}> has no transpose region, so no rank owns an encoder backward; use "
                             f"cooldown or a schedule with transpose")
        if self.encoder_backward_ranks is not None and recompute_granularity(self.recompute) != "full":
            raise MpipeError(f"the encoder backward ranks run encoder backwards on other ranks than their owners, "
                             f"which re-run the encode from the microbatch's images and so need full recomputation, "
                             f"but the recomputation is {recompute_granularity(self.recompute)!r}; recompute fully "
                             f"or drop the ranks")

    @property
    def reshards_after_forward(self) -> bool:
        """Whether a ZeRO-3 plan gathers its weights again for every forward and backward
        (:attr:`reshard_after_forward`, its default resolved); False at the other stages."""
        if self.zero_stage != 3:
            return False
        policy = self.reshard_after_forward
        return default_reshard_after_forward(self.pp) if policy is None else policy

    @property
    def moves_encoder_backward(self) -> bool:
        """Whether encoder backwards may run off their owners: full recomputation (every layer keeps only
        its input and re-runs its forward, so another rank can re-run a whole encode from the images;
        selective recomputation keeps the rest of the owner's activations for its own backward)."""
        return recompute_granularity(self.recompute) == "full"

    def model_of(self, model: Model) -> Model:
        """``model`` with this candidate's frozen blocks frozen (the model itself when none are)."""
        return model.with_frozen(self.frozen) if self.frozen else model

    def derive(self, model: Model, layer_weights: tuple[float, ...] | None = None) -> Plan:
        """``derive`` of this candidate on ``model`` (its frozen blocks frozen); slabs left ``None`` are
        balanced by ``layer_weights`` (default: one per layer), a missing owner map is round-robin."""
        cut, schedule = self.parsed()
        owners = Owners(slab_counts=self.slab_counts, microbatch=self.owner_map, layer_weights=layer_weights)
        return derive(cut, schedule, self.model_of(model), self.pp, self.num_microbatches, owners,
                      EncoderBackward(self.encoder_backward, self.encoder_backward_slots, self.encoder_backward_ranks))

    @property
    def setting(self) -> tuple:
        """What a step's prediction depends on besides the schedule, the slabs and the step:
        (tp, dp, M, recompute, ep, cp, ZeRO stage, sequence parallelism, encoder tp, whether ZeRO-3 reshards
        after forward)."""
        return (self.tp, self.dp, self.num_microbatches, self.recompute, self.ep, self.cp, self.zero_stage,
                self.sequence_parallel, self.encoder_tp, self.reshards_after_forward)

    @property
    def num_devices(self) -> int:
        return self.degrees.num_devices

    def parsed(self) -> tuple[Cut, Schedule]:
        return Cut(self.cut), parse_schedule(self.schedule)

    @property
    def has_transpose(self) -> bool:
        return Skeleton.TRANSPOSE.value in self.schedule.split(",")

    def __str__(self) -> str:
        """The text form (:mod:`~mpipe_tune.algebra._candidate_text`), e.g.
        ``<transpose,1f1b> cut 9  pp4 tp1 dp1  M=8  owners greedy``; :meth:`parse` reads it back."""
        return format_candidate(self)

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """The candidate whose text form is ``text`` (the inverse of ``str``; fields left out take their
        defaults), or one line naming the piece that does not parse."""
        return cls(**parse_candidate_fields(text))

    def to_dict(self) -> dict[str, Any]:
        """The stored form (plan.json's ``candidate``, a trial's record): ``slabs`` are the slab counts,
        ``owners`` the owner map (``null`` for none)."""
        return {
            "schedule": self.schedule, "cut": list(self.cut), "pp": self.pp, "tp": self.tp, "dp": self.dp,
            "ep": self.ep, "cp": self.cp, "encoder_tp": self.tp if self.encoder_tp is None else self.encoder_tp,
            "microbatches": self.num_microbatches, "owner_policy": self.owner_policy,
            "owners": list(self.owner_map) if self.owner_map is not None else None,
            "slabs": [list(c) for c in self.slab_counts] if self.slab_counts else None,
            "recompute": self.recompute, "zero_stage": self.zero_stage,
            "reshard_after_forward": self.reshard_after_forward, "sequence_parallel": self.sequence_parallel,
            "dtype": self.dtype, "frozen": list(self.frozen), "label": self.label,
            "encoder_backward": self.encoder_backward,
            "encoder_backward_slots": (list(self.encoder_backward_slots)
                                       if self.encoder_backward_slots is not None else None),
            "encoder_backward_ranks": (list(self.encoder_backward_ranks)
                                       if self.encoder_backward_ranks is not None else None),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        """The inverse of :meth:`to_dict`; fields a record from before them lacks read as what it meant
        (and trial records from before the plan file's names keep theirs: ``slab_counts``)."""
        slabs = data.get("slabs", data.get("slab_counts"))
        owner_map = data.get("owners")
        slots, ranks = data.get("encoder_backward_slots"), data.get("encoder_backward_ranks")
        return cls(
            schedule=data["schedule"], cut=tuple(data["cut"]), pp=int(data["pp"]), tp=int(data["tp"]),
            dp=int(data["dp"]), num_microbatches=int(data["microbatches"]), owner_policy=data.get("owner_policy"),
            slab_counts=tuple(tuple(c) for c in slabs) if slabs else None, recompute=data.get("recompute", False),
            label=data.get("label", ""), ep=int(data.get("ep", 1)), cp=int(data.get("cp", 1)),
            zero_stage=int(data.get("zero_stage", 1)), sequence_parallel=bool(data.get("sequence_parallel", False)),
            encoder_tp=int(data["encoder_tp"]) if data.get("encoder_tp") is not None else None,
            owner_map=tuple(int(r) for r in owner_map) if owner_map is not None else None,
            dtype=str(data.get("dtype", "bf16")), frozen=tuple(data.get("frozen", ())),
            encoder_backward=str(data.get("encoder_backward", COOLDOWN)),
            encoder_backward_slots=tuple(int(k) for k in slots) if slots is not None else None,
            encoder_backward_ranks=tuple(int(r) for r in ranks) if ranks is not None else None,
            reshard_after_forward=(None if data.get("reshard_after_forward") is None
                                   else bool(data["reshard_after_forward"])),
        )
