"""The plan an export writes, as every target reads it: :class:`ExportPlan` (a stored plan with its
derivation, read once by :func:`read_export_plan`), its pipeline stages (:func:`wavefront_stages`), and
:class:`Output`, one file of an export. Below :mod:`._refusals`, :mod:`._target` and every target's module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.algebra import (
    moved_count, Degrees, wavefront_stages as derive_stages, Bwd, Fwd, Wgrad, ArchCost, Model, ByLayer,
    ByMicrobatch, Plan, Layout, Skeleton,
)
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import BEST, MPIPE_RR, PlanFile, Section, resolve

EMBEDDING_KIND = "embedding"
LM_HEAD_KIND = "lm_head"
PROJECTOR_BLOCK = "projector"


@dataclass(frozen=True)
class ExportLayer:
    name: str
    block: str
    kind: str | None
    """The architecture kind (``embedding``, ``dense_block``, ``lm_head``, ...); None for a layer
    given by explicit costs."""
    trainable: bool


@dataclass(frozen=True)
class ExportRegion:
    index: int
    """1-based, as in the paper."""
    skeleton: Skeleton
    layers: tuple[int, int]
    """The region's layers [start, stop)."""
    slabs: tuple[tuple[int, int], ...]
    """Sharded: rank -> its slab [start, stop); empty for a Replicated region."""
    owners: tuple[int, ...]
    """Replicated: microbatch -> the rank that runs it; empty for a Sharded region."""

    @property
    def is_sharded(self) -> bool:
        return self.skeleton.layout is Layout.SHARDED


@dataclass(frozen=True)
class ExportPlan:
    """One plan of a plan file as the writers read it."""

    name: str
    """``best`` or the stored plan's name (``megatron``, ...)."""
    names: tuple[str, ...]
    """Every plan the file holds (the closest-plan hints name one of them)."""
    pp: int
    tp: int
    dp: int
    dtype: str
    recompute: bool
    """Full recomputation (one more forward per backward)."""
    num_microbatches: int
    regions: tuple[ExportRegion, ...]
    orders: tuple[tuple[Fwd | Bwd | Wgrad, ...], ...]
    """Per pipeline rank, its compute events in the order it runs them (a zero-bubble skeleton's
    split backward as a ``Bwd``, the input gradient, and a later ``Wgrad``)."""
    layers: tuple[ExportLayer, ...]
    num_vision_layers: int
    """The layers before the first backbone (``llm``) layer: the encoder and its projector."""
    text_tokens: tuple[int, ...]
    """Per microbatch, the backbone's sequence length."""
    stage_order: tuple[tuple[int, int], ...] = ()
    """The Sharded (region, rank) stages in wavefront order: stage index = position (every region's
    ranks in increasing order, ``zbv``'s second region in decreasing order, a V)."""
    ep: int = 1
    """Expert-parallel degree, carved from the dp x cp ranks."""
    cp: int = 1
    sequence_parallel: bool = False
    selective_recompute: bool = False
    """Recomputation of the attention core only (Megatron-LM's selective granularity)."""
    zero_stage: int = 0
    """1: the optimizer state sharded over the data-parallel ranks (a distributed optimizer); 2: the
    gradients too; 3: the weights too (FSDP's full sharding)."""
    reshard_after_forward: bool = True
    """At stage 3, FSDP's reshard policy as planned (the candidate's, its default resolved): True gathers
    the weights for every forward and backward, False keeps them through the step."""
    encoder_tp: int | None = None
    """The encoder's own tensor-parallel degree below ``tp``; None: ``tp``."""
    moe_layers: tuple[tuple[int, int], ...] = ()
    """Per MoE decoder layer, (its number among the decoder layers, its routed expert count)."""
    moe_top_k: int = 0

    @property
    def schedule(self) -> str:
        return ",".join(r.skeleton.value for r in self.regions)

    @property
    def sharded(self) -> tuple[ExportRegion, ...]:
        return tuple(r for r in self.regions if r.is_sharded)

    @property
    def num_chunks(self) -> int:
        """Virtual stages per rank: the Sharded regions woven into one wavefront."""
        return len(self.sharded)

    @property
    def is_v(self) -> bool:
        """Whether the stages sit in a V (``zbv``: rank r holds stages r and 2P-1-r)."""
        return any(r.skeleton is Skeleton.ZBV for r in self.sharded)

    @property
    def splits_backward(self) -> bool:
        return any(r.skeleton.splits_backward for r in self.sharded)

    @property
    def num_devices(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    def stage_index(self, region: int, rank: int) -> int:
        """The stage's position in the wavefront: rank + (j - 1) x P for ``region`` the j-th Sharded
        region, 2P - 1 - rank for ``zbv``'s second."""
        return self.stage_order.index((region, rank))

    def distributed_optimizer_note(self) -> tuple[str, ...]:
        """The header line of a stage-2 plan for a trainer that writes it as its distributed optimizer
        (Megatron-LM and MindSpeed-MM: their torch FSDP2 path is ZeRO-3 only)."""
        if self.zero_stage != 2:
            return ()
        return ("# ZeRO-2 as planned is written as the distributed optimizer (--use-distributed-optimizer), which "
                "shards the optimizer state and reduce-scatters the gradients once a step into a whole gradient "
                "buffer (ZeRO-1's memory and timing); re-plan with --zero 1 for a matching prediction",)

    def data_sharding_note(self, trainer: str) -> tuple[str, ...]:
        """The header line for a trainer that runs the data axis FSDP-sharded (ZeRO-3) where the plan
        was predicted at a lower ZeRO stage (nothing at stage 3, or without data parallelism)."""
        if self.zero_stage >= 3 or self.dp * self.cp < 2:
            return ()
        if self.zero_stage == 2:
            return (f"{trainer} has no ZeRO-2: its FSDP runs the data axis with the weights gathered once and kept "
                    f"(reshard after forward never), which under pipeline parallelism reduce-scatters the gradients "
                    f"once a step where the plan was predicted reduce-scattering them every microbatch (ZeRO-2); "
                    f"re-plan with --zero 3-keep for a matching prediction",)
        return (f"{trainer} runs the data axis sharded (FSDP, ZeRO-3: weights, gradients and optimizer state over "
                f"{self.dp * self.cp} ranks) while the plan was predicted at ZeRO-{self.zero_stage}; re-plan with "
                f"--zero 3 for a matching prediction",)

    @property
    def torch_fsdp2_blockers(self) -> tuple[str, ...]:
        """What in the plan Megatron-LM's ``validate_args`` refuses beside ``--use-torch-fsdp2`` (pipeline and
        expert parallelism, fp16: megatron/training/arguments.py lines 1034-1047 at d98e8a6, 513-526 at
        core_v0.12.1, which MindSpeed-MM runs on); empty when its ZeRO-3 can run the plan."""
        return tuple(what for what, on in (("pipeline parallelism", self.pp > 1), ("expert parallelism", self.ep > 1),
                                           ("fp16", self.dtype == "fp16")) if on)

    def validate_torch_fsdp2(self, trainer: str, fsdp2: str) -> None:
        """One line naming the closest plan (the same at ZeRO stage 1) where ``trainer``'s FSDP2 (``fsdp2``:
        how it names it) cannot run this stage-3 plan (:attr:`torch_fsdp2_blockers`)."""
        without = self.torch_fsdp2_blockers
        if without:
            raise MpipeError(f"{trainer} cannot express {self.describe()} at ZeRO stage 3: its {fsdp2} refuses "
                             f"{' and '.join(without)}; the closest plan it can express: the same at ZeRO stage 1",
                             quantities=("ZeRO stage",))

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.pp, self.tp, self.dp, self.ep, self.cp, self.encoder_tp)

    def describe(self) -> str:
        """The plan's name, schedule, degrees and microbatches in the candidate's text form's words."""
        return f"plan '{self.name}' <{self.schedule}> {self.degrees} M={self.num_microbatches}"


def read_export_plan(path: str | os.PathLike, name: str | None = None) -> ExportPlan:
    """The plan ``name`` (default: the best) of plan file ``path``, resolved on the model it names
    (:func:`~mpipe_tune.plan_file._resolve`: its hashes and stored order checked)."""
    resolved = resolve(path, name)
    return export_plan(resolved.section, resolved.plan, resolved.model, name=name or BEST, names=resolved.file.names)


def plan_from_record(record: dict[str, Any], model: Model, *, name: str = BEST,
                     names: tuple[str, ...] = (BEST,)) -> ExportPlan:
    """An :class:`ExportPlan` from one top-level plan record in its stored form (``plan_record``'s or
    ``select_plan``'s result), resolved on its model."""
    resolved = resolve(PlanFile.from_dict(record, path=f"record of plan '{name}'"), model=model)
    return export_plan(resolved.section, resolved.plan, model, name=name, names=names)


def export_plan(section: Section, plan: Plan, model: Model, *, name: str = BEST,
                names: tuple[str, ...] = (BEST,)) -> ExportPlan:
    """An :class:`ExportPlan` of a plan's stored section and ``plan``, its derivation on ``model``."""
    c = section.candidate
    moved = moved_count(c.encoder_backward_ranks, c.owner_map or ())
    if moved:
        raise MpipeError(f"plan '{name}' runs {moved} encoder backward(s) on other ranks than their owners (full "
                         f"recomputation), which no export writes (hyper-parallel's Mpipe schedule runs each on its "
                         f"owner); " + (f"export the file's stored plan '{MPIPE_RR}' (its baseline), " if MPIPE_RR
                                        in names else "") + "re-plan with encoder-backward placement cooldown, or "
                         "run this one with 'mpipe-tune run'", quantities=("stored plan", "encoder-backward placement"))
    regions = tuple(
        ExportRegion(p.region, plan.schedule.skeletons[p.region - 1], p.layers,
                     slabs=p.owner.slabs if isinstance(p.owner, ByLayer) else (),
                     owners=p.owner.owners if isinstance(p.owner, ByMicrobatch) else ())
        for p in plan.placement
    )
    orders = tuple(tuple(e for e in plan.nodes(rank) if isinstance(e, (Fwd, Bwd, Wgrad)))
                   for rank in range(plan.num_ranks))
    layers = tuple(ExportLayer(u.name, u.block, u.cost.kind if isinstance(u.cost, ArchCost) else None, u.trainable)
                   for u in model.layers)
    sharded = [r for r in regions if r.is_sharded]
    stage_order = tuple(derive_stages(sharded[0].skeleton, [r.index for r in sharded], c.pp)) if sharded else ()
    moe = [u.cost.dims_dict() for u in model.layers[model.backbone_start:]
           if isinstance(u.cost, ArchCost) and u.cost.kind not in (EMBEDDING_KIND, LM_HEAD_KIND)]
    return ExportPlan(
        name=name, names=tuple(names), pp=c.pp, tp=c.tp, dp=c.dp, dtype=c.dtype, recompute=c.recompute is True,
        num_microbatches=c.num_microbatches, regions=regions, orders=orders, layers=layers,
        num_vision_layers=model.backbone_start,
        text_tokens=tuple(mb.text_tokens for mb in section.workload.microbatches),
        stage_order=stage_order, ep=c.ep, cp=c.cp, sequence_parallel=c.sequence_parallel,
        selective_recompute=c.recompute == "selective", zero_stage=c.zero_stage, encoder_tp=c.encoder_tp,
        reshard_after_forward=c.reshards_after_forward,
        moe_layers=tuple((k, int(d["experts"])) for k, d in enumerate(moe) if "experts" in d),
        moe_top_k=max((int(d.get("top_k", 0)) for d in moe if "experts" in d), default=0),
    )


# ---- the stages of an all-Sharded wavefront ------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One (region, rank) of the wavefront, numbered as torch and Megatron-LM number virtual stages."""

    index: int
    layers: tuple[int, int]
    vision: tuple[int, ...]
    """Vision-tower layers (encoder, projector) in it."""
    decoders: tuple[int, ...]
    """Numbers (0-based, among the backbone's decoder layers) of its decoder layers."""


def wavefront_stages(plan: ExportPlan) -> tuple[Stage, ...]:
    """The Sharded regions' stages in stage-index order."""
    vision_stop = plan.num_vision_layers
    decoder_number: dict[int, int] = {}
    for i, u in enumerate(plan.layers[vision_stop:], start=vision_stop):
        if u.kind not in (EMBEDDING_KIND, LM_HEAD_KIND):
            decoder_number[i] = len(decoder_number)
    stages = []
    for region in plan.sharded:
        for rank, (start, stop) in enumerate(region.slabs):
            stages.append(Stage(plan.stage_index(region.index, rank), (start, stop),
                                tuple(range(start, min(stop, vision_stop))),
                                tuple(decoder_number[i] for i in range(start, stop) if i in decoder_number)))
    return tuple(sorted(stages, key=lambda s: s.index))


def frozen_blocks(plan: ExportPlan) -> tuple[str, ...]:
    """Blocks whose layers are all frozen, in model order."""
    blocks = dict.fromkeys(u.block for u in plan.layers)
    return tuple(b for b in blocks if not any(u.trainable for u in plan.layers if u.block == b))


@dataclass(frozen=True)
class Output:
    """One file of an export: its path (None: standard output) and text."""

    path: Path | None
    text: str
