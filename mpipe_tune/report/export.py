"""Exports of a plan to other trainers: each writer a pure function of one typed :class:`ExportPlan`.

:func:`read_export_plan` reads one plan of a plan file (the best or a stored baseline) and the model
it was made for into an :class:`ExportPlan`; the writers read nothing else. Each returns text:

``torch-csv``
    The per-rank compute actions in the CSV that ``torch.distributed.pipelining``'s
    ``_PipelineScheduleRuntime._load_csv`` reads (torch 2.13, ``schedules.py``): one row per pipeline
    rank, cells ``{stage}F{mb}`` / ``{stage}B{mb}`` (``_Action``'s text form; ``B`` is the full
    backward: a plan has no split input/weight backward), in the rank's order from ``order.nodes``;
    stage index = rank + (j - 1) x P for the j-th Sharded region, the loop-style stage placement torch
    infers from the rows. Plans whose regions are all Sharded only.
``torchtitan``
    A torchtitan job config (TOML, ``--job.config_file``; field names of
    ``torchtitan/config/job_config.py`` at v0.2.2, the last release that reads TOML):
    ``[parallelism]`` ``pipeline_parallel_degree``, ``tensor_parallel_degree``,
    ``data_parallel_shard_degree`` (FSDP: torchtitan's DDP does not compose with PP),
    ``data_parallel_replicate_degree``, ``pipeline_parallel_schedule`` (``PipelineScheduleSingle`` or
    ``PipelineScheduleMulti``: with a CSV it only sets the stage style, loop),
    ``pipeline_parallel_schedule_csv``, ``pipeline_parallel_microbatch_size`` and
    ``module_fqns_per_model_part`` (each stage's modules, in the names of torchtitan's Llama-3 and of its
    ``vlm`` experiment: ``encoder``, ``projector``, ``tok_embeddings``, ``layers.N``, ``norm``,
    ``output``); ``[training]`` ``local_batch_size``, ``global_batch_size``, ``seq_len``,
    ``mixed_precision_param``; ``[activation_checkpoint]`` ``mode``. The CSV goes beside it.
``megatron``
    Megatron-LM launch arguments (``megatron/training/arguments.py`` and the config dataclasses it
    turns into flags): ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
    ``--num-layers``, ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` decoder layer,
    ``L`` loss, ``|`` between stages; ``E`` always on the first stage and ``L`` on the last; its stage
    count over P is the virtual-stage count, so no VPP flag is given),
    ``--microbatch-group-size-per-virtual-pipeline-stage`` (interleaving in rounds other than P),
    ``--micro-batch-size``, ``--global-batch-size``, ``--seq-length``, ``--bf16``/``--fp16``,
    ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``, and
    ``--freeze-ViT``/``--freeze-LM`` of ``examples/multimodal`` (whose LLaVA model builds the vision
    encoder inside the first pipeline stage). Data parallelism is what the world size leaves.
``hyper-parallel``
    A hyper-parallel trainer YAML: :mod:`mpipe_tune.report.export_hyper_parallel`.

Where a format cannot express a plan (a transpose region for torch-csv, torchtitan and Megatron-LM,
GPipe for Megatron-LM, an owner map hyper-parallel has no mode for, a zero-bubble skeleton's split
backward for any of them, an encoder backward moved off its owner for any of them), the writer raises one
:class:`~mpipe_tune.errors.MpipeError` line that says why and names the closest plan it can express.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.algebra.encoder_backward import moved_count
from mpipe_tune.algebra.events import Bwd, Fwd
from mpipe_tune.algebra.model import ArchCost, Model
from mpipe_tune.algebra.order import num_rounds
from mpipe_tune.algebra.placement import ByLayer, ByMicrobatch
from mpipe_tune.algebra.plan import Plan
from mpipe_tune.algebra.schedule import Layout, Skeleton
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import (
    BEST, all_plan_names, derive_stored, load_plan, load_plan_model, select_plan, stored_candidate,
    validate_derivation, workload_of,
)
from mpipe_tune.search.baselines import REFERENCE

EMBEDDING_KIND = "embedding"
LM_HEAD_KIND = "lm_head"
PROJECTOR_BLOCK = "projector"
MPIPE_RR = "mpipe-rr"
"""The stored baseline of ``<transpose,1f1b>`` with round-robin owners."""


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
    num_microbatches: int
    regions: tuple[ExportRegion, ...]
    orders: tuple[tuple[Fwd | Bwd, ...], ...]
    """Per pipeline rank, its compute events in the order it runs them."""
    layers: tuple[ExportLayer, ...]
    num_vision_layers: int
    """The layers before the first backbone (``llm``) layer: the encoder and its projector."""
    text_tokens: tuple[int, ...]
    """Per microbatch, the backbone's sequence length."""

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

    def stage_index(self, region: int, rank: int) -> int:
        """rank + (j - 1) x P, for ``region`` the j-th Sharded region."""
        j = next(k for k, r in enumerate(self.sharded, start=1) if r.index == region)
        return rank + (j - 1) * self.pp

    def describe(self) -> str:
        return (f"plan '{self.name}' <{self.schedule}> pp{self.pp} tp{self.tp} dp{self.dp} "
                f"M={self.num_microbatches}")


def read_export_plan(path: str | os.PathLike, name: str | None = None) -> ExportPlan:
    """The plan ``name`` (default: the best) of plan file ``path``, with the model it names
    (loaded from its spec, checked against the file's model hash)."""
    where = f"plan file {path}"
    record = load_plan(path)
    selected = select_plan(record, name, where=where)
    wanted = record["inputs"]["model"]
    model = load_plan_model(record, where=where)
    if model.content_hash() != wanted["hash"]:
        raise MpipeError(f"{where}: the model '{wanted['spec']}' has changed since the plan was made (content hash "
                         f"differs); re-plan it with 'mpipe-tune plan'")
    label = where + (f", plan '{name}'" if name else "")
    plan = derive_stored(selected, model, where=label)
    validate_derivation(selected, plan, where=label)
    return export_plan(selected, plan, model, name=name or BEST, names=all_plan_names(record))


def plan_from_record(record: dict[str, Any], model: Model, *, name: str = BEST,
                     names: tuple[str, ...] = (BEST,)) -> ExportPlan:
    """An :class:`ExportPlan` from one top-level plan record (``select_plan``'s result) and its model:
    its candidate derived on the model."""
    return export_plan(record, derive_stored(record, model, where=f"plan '{name}'"), model, name=name, names=names)


def export_plan(record: dict[str, Any], plan: Plan, model: Model, *, name: str = BEST,
                names: tuple[str, ...] = (BEST,)) -> ExportPlan:
    """An :class:`ExportPlan` of a plan record's candidate and ``plan``, its derivation on ``model``."""
    c = stored_candidate(record, where=f"plan '{name}'")
    beyond = [f"{key} {value}" for key, value in (("ep", c.ep), ("cp", c.cp)) if value > 1]
    beyond += ["sequence parallelism"] * c.sequence_parallel + ["selective recomputation"] * (
        c.recompute == "selective") + [f"encoder tp {c.encoder_tp}"] * (c.encoder_tp is not None)
    split = sorted({s.value for s in plan.schedule.skeletons if s.splits_backward})
    if split:
        raise MpipeError(f"plan '{name}' uses the zero-bubble skeleton {', '.join(split)}, whose split input- and "
                         f"weight-gradient backwards no export writes yet; export a 1f1b plan such as the file's "
                         f"'megatron' baseline (--plan megatron), or run this one with 'mpipe-tune run'")
    moved = moved_count(c.encoder_backward_ranks, c.owner_map or ())
    if moved:
        raise MpipeError(f"plan '{name}' runs {moved} encoder backward(s) on other ranks than their owners (full "
                         f"recomputation), which no export writes (hyper-parallel's Mpipe schedule runs each on its "
                         f"owner); " + (f"export the file's '{MPIPE_RR}' baseline (--plan {MPIPE_RR}), " if MPIPE_RR
                                        in names else "") + "re-plan with --encoder-backward cooldown, or run "
                         "this one with 'mpipe-tune run'")
    if beyond:
        raise MpipeError(f"plan '{name}' uses {', '.join(beyond)}; export writes pp x dp x tp plans with no or full "
                         f"recomputation and the encoder at the plan's tp; re-plan with --ep 1 --cp 1 (no sequence "
                         f"parallelism, no --encoder-tp, --recompute off or on)")
    regions = tuple(
        ExportRegion(p.region, plan.schedule.skeletons[p.region - 1], p.layers,
                     slabs=p.owner.slabs if isinstance(p.owner, ByLayer) else (),
                     owners=p.owner.owners if isinstance(p.owner, ByMicrobatch) else ())
        for p in plan.placement
    )
    orders = tuple(tuple(e for e in plan.nodes(rank) if isinstance(e, (Fwd, Bwd))) for rank in range(plan.num_ranks))
    layers = tuple(ExportLayer(u.name, u.block, u.cost.kind if isinstance(u.cost, ArchCost) else None, u.trainable)
                   for u in model.layers)
    return ExportPlan(
        name=name, names=tuple(names), pp=c.pp, tp=c.tp, dp=c.dp, dtype=c.dtype, recompute=bool(c.recompute),
        num_microbatches=c.num_microbatches, regions=regions, orders=orders, layers=layers,
        num_vision_layers=model.backbone_start,
        text_tokens=tuple(mb.text_tokens for mb in workload_of(record).microbatches),
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
    for j, region in enumerate(plan.sharded):
        for rank, (start, stop) in enumerate(region.slabs):
            stages.append(Stage(rank + j * plan.pp, (start, stop), tuple(range(start, min(stop, vision_stop))),
                                tuple(decoder_number[i] for i in range(start, stop) if i in decoder_number)))
    return tuple(sorted(stages, key=lambda s: s.index))


def _closest(plan: ExportPlan, name: str, otherwise: str) -> str:
    """How to get the stored plan ``name`` when the file holds it, else ``otherwise``."""
    if name in plan.names and name != plan.name:
        return f"export the file's '{name}' plan (--plan {name})"
    return otherwise


def _hint(plan: ExportPlan, name: str) -> str:
    """`` (--plan NAME)`` when the file holds the stored plan ``name``."""
    return f" (--plan {name})" if name in plan.names and name != plan.name else ""


def _encoder_first(plan: ExportPlan) -> str:
    """The closest all-Sharded plan: the encoder inside the first stage (Megatron-LM style)."""
    stored = _closest(plan, REFERENCE, f"<1f1b> with no cut, stored by 'mpipe-tune plan' as baseline '{REFERENCE}' "
                                       f"(or 'mpipe-tune predict --schedule 1f1b --cut \"\"')")
    return f"the same model with the encoder inside the first stage: {stored}"


def _validate_all_sharded(plan: ExportPlan, target: str, why: str) -> None:
    """Every region Sharded; ``why`` says why ``target`` cannot run a transpose."""
    for region in plan.regions:
        if not region.is_sharded:
            raise MpipeError(
                f"{target} cannot express {plan.describe()}: region {region.index} is a transpose (its layers on "
                f"every rank, each microbatch run by its owner), {why}; the closest plan it can express: "
                f"{_encoder_first(plan)}")


_ONE_SLAB_STAGES = "and a torch.distributed.pipelining stage is one slab on one rank"


def _validate_vision_first(plan: ExportPlan, stages: tuple[Stage, ...], target: str) -> None:
    """The vision tower in the first stage, as Megatron-LM's LLaVA and torchtitan's VLM build it."""
    spread = [s.index for s in stages[1:] if s.vision]
    if spread:
        raise MpipeError(
            f"{target} builds the vision encoder inside the first pipeline stage, but {plan.describe()} puts encoder "
            f"layers in stage(s) {', '.join(map(str, spread))} too; the closest plan it can express: "
            f"{_encoder_first(plan)}")


# ---- torch.distributed.pipelining CSV ------------------------------------------------------------


def to_torch_csv(plan: ExportPlan) -> str:
    """One row per pipeline rank of ``{stage}F{mb}`` / ``{stage}B{mb}`` cells, in the rank's order."""
    _validate_all_sharded(plan, "torch-csv", _ONE_SLAB_STAGES)
    rows, counts = [], {}
    for rank, order in enumerate(plan.orders):
        row = []
        for event in order:
            stage, op = plan.stage_index(event.region, rank), "F" if isinstance(event, Fwd) else "B"
            counts[stage, op] = counts.get((stage, op), 0) + 1
            row.append(f"{stage}{op}{event.mb}")
        rows.append(row)
    for stage in range(plan.pp * plan.num_chunks):
        if counts.get((stage, "B"), 0) != counts.get((stage, "F"), 0):
            raise MpipeError(f"torch-csv cannot express {plan.describe()}: stage {stage} runs no backward (its layers "
                             f"and all before them are frozen), and torch's schedule runtime needs one backward per "
                             f"forward; unfreeze a layer of it, or plan with that stage's layers merged into the next")
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


# ---- torchtitan ----------------------------------------------------------------------------------


def to_torchtitan(plan: ExportPlan, csv_path: str) -> str:
    """The TOML job config that runs the CSV at ``csv_path`` with the plan's degrees and microbatches."""
    _validate_all_sharded(plan, "torchtitan", _ONE_SLAB_STAGES)
    stages = wavefront_stages(plan)
    _validate_vision_first(plan, stages, "torchtitan")
    last = len(stages) - 1
    parts = []
    for s in stages:
        vision_blocks = dict.fromkeys(PROJECTOR_BLOCK if plan.layers[i].block == PROJECTOR_BLOCK else "encoder"
                                      for i in s.vision)
        parts.append([*vision_blocks, *(["tok_embeddings"] if s.index == 0 else []),
                      *(f"layers.{k}" for k in s.decoders), *(["norm", "output"] if s.index == last else [])])
    frozen = _frozen_blocks(plan)
    lines = [
        f"# torchtitan job config for mpipe-tune {plan.describe()} (torchtitan v0.2.x, --job.config_file)",
        f"# launch on {plan.pp * plan.tp * plan.dp} devices; each pipeline rank runs its row of {csv_path}",
        "# (the CSV path is read relative to the folder torchtitan starts in)",
        *([f"# torchtitan has no setting that freezes modules: freeze {', '.join(frozen)} in the model code"]
          if frozen else []),
        "",
        "[parallelism]",
        f"pipeline_parallel_degree = {plan.pp}",
        f"tensor_parallel_degree = {plan.tp}",
        f"data_parallel_shard_degree = {plan.dp}",
        "data_parallel_replicate_degree = 1",
        f"pipeline_parallel_schedule = {_toml(_titan_schedule(plan))}",
        f"pipeline_parallel_schedule_csv = {_toml(csv_path)}",
        "pipeline_parallel_microbatch_size = 1",
        "module_fqns_per_model_part = [",
        *(f"  {_toml(p)}," for p in parts),
        "]",
        "",
        "[training]",
        f"local_batch_size = {plan.num_microbatches}",
        f"global_batch_size = {plan.num_microbatches * plan.dp}",
        f"seq_len = {max(plan.text_tokens)}",
        *([f"mixed_precision_param = {_toml(_TITAN_DTYPES[plan.dtype])}"] if plan.dtype in _TITAN_DTYPES else []),
        "",
        "[activation_checkpoint]",
        f"mode = {_toml('full' if plan.recompute else 'none')}",
    ]
    return "\n".join(lines) + "\n"


_TITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _titan_schedule(plan: ExportPlan) -> str:
    return "PipelineScheduleSingle" if plan.num_chunks == 1 else "PipelineScheduleMulti"


def _toml(value: Any) -> str:
    """A TOML string or array of strings (JSON's escapes are TOML's basic-string escapes)."""
    return json.dumps(value, ensure_ascii=True)


# ---- Megatron-LM ---------------------------------------------------------------------------------


def to_megatron(plan: ExportPlan) -> str:
    """Megatron-LM arguments, one per line (comments start with ``#``)."""
    _validate_all_sharded(plan, "Megatron-LM", "and Megatron-LM builds the vision encoder inside the first "
                                              "pipeline stage only")
    if plan.regions[0].skeleton is Skeleton.GPIPE:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it has no GPipe schedule, its pipelines run "
                         f"1F1B; the closest plan it can express: the same cut and slabs under 1f1b"
                         f"{_hint(plan, REFERENCE) if plan.name == 'gpipe' else ''}")
    stages = wavefront_stages(plan)
    _validate_vision_first(plan, stages, "Megatron-LM")
    v, P, M = plan.num_chunks, plan.pp, plan.num_microbatches
    group = M // num_rounds(P, M)
    if v > 1 and group < P:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it interleaves only M >= P microbatches "
                         f"(M={M}, P={P}); the closest plan it can express: the same plan at M={P}")
    last = len(stages) - 1
    layout = "|".join(("E" if s.index == 0 else "") + _runs("t", len(s.decoders)) + ("L" if s.index == last else "")
                      for s in stages)
    num_decoders = sum(len(s.decoders) for s in stages)
    args = [
        f"# Megatron-LM arguments for mpipe-tune {plan.describe()}",
        f"# launch on {P * plan.tp * plan.dp} GPUs: the data-parallel size {plan.dp} is what the world size leaves",
        f"--tensor-model-parallel-size {plan.tp}",
        f"--pipeline-model-parallel-size {P}",
        f"--num-layers {num_decoders}",
        f"--pipeline-model-parallel-layout {shlex.quote(layout)}",
        *([f"--microbatch-group-size-per-virtual-pipeline-stage {group}"] if v > 1 and group != P else []),
        "--micro-batch-size 1",
        f"--global-batch-size {M * plan.dp}",
        f"--seq-length {max(plan.text_tokens)}",
        *({"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(plan.dtype, [])),
        *(["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
          if plan.recompute else []),
        *_megatron_freeze(plan),
    ]
    return "\n".join(args) + "\n"


def _runs(symbol: str, count: int) -> str:
    return "" if count == 0 else symbol if count == 1 else f"{symbol}*{count}"


def _megatron_freeze(plan: ExportPlan) -> list[str]:
    frozen = set(_frozen_blocks(plan))
    lines = []
    if "encoder" in frozen:
        lines.append("--freeze-ViT")
    if PROJECTOR_BLOCK in frozen:
        lines.append("# the projector is frozen in the plan; examples/multimodal has no flag for it "
                     "(its model.py passes freeze_vision_projection=False)")
    if "llm" in frozen:
        lines.append("--freeze-LM")
    if lines:
        lines.insert(0, "# freezing flags of examples/multimodal (multimodal_args.py)")
    return lines


def _frozen_blocks(plan: ExportPlan) -> tuple[str, ...]:
    """Blocks whose layers are all frozen, in model order."""
    blocks = dict.fromkeys(u.block for u in plan.layers)
    return tuple(b for b in blocks if not any(u.trainable for u in plan.layers if u.block == b))


# ---- the format table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One file of an export: its path (None: standard output) and text."""

    path: Path | None
    text: str


@dataclass(frozen=True)
class Format:
    name: str
    help: str
    render: Callable[[ExportPlan, Path | None], tuple[Output, ...]]


def _single(writer: Callable[[ExportPlan], str]) -> Callable[[ExportPlan, Path | None], tuple[Output, ...]]:
    return lambda plan, out: (Output(out, writer(plan)),)


def _torchtitan_outputs(plan: ExportPlan, out: Path | None) -> tuple[Output, ...]:
    if out is None:
        raise MpipeError("the torchtitan export is two files, the TOML job config and the schedule CSV it names; "
                         "give the TOML's path with --out, e.g. --out job.toml (the CSV goes beside it)")
    if out.suffix.lower() != ".toml":
        raise MpipeError(f"the torchtitan job config {out} must end in .toml (its schedule CSV goes beside it, "
                         f"as {out.with_suffix('.csv').name}); e.g. --out {out.stem or 'job'}.toml")
    csv_path = out.with_suffix(".csv")
    return (Output(out, to_torchtitan(plan, str(csv_path))), Output(csv_path, to_torch_csv(plan)))


def _hyper_parallel(plan: ExportPlan, out: Path | None) -> tuple[Output, ...]:
    # imported here: the writer's module imports this one's plan types
    from mpipe_tune.report.export_hyper_parallel import to_hyper_parallel
    return (Output(out, to_hyper_parallel(plan)),)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("torch-csv", "torch.distributed.pipelining schedule CSV (compute actions per rank)",
           _single(to_torch_csv)),
    Format("torchtitan", "torchtitan TOML job config and the CSV it runs (needs --out)", _torchtitan_outputs),
    Format("megatron", "Megatron-LM launch arguments", _single(to_megatron)),
    Format("hyper-parallel", "hyper-parallel trainer YAML (Mpipe transpose schedule arguments)", _hyper_parallel),
)}


def export_outputs(plan: ExportPlan, fmt: str, out: Path | None) -> tuple[Output, ...]:
    """The files (or the standard output text) of ``plan`` in format ``fmt``."""
    if fmt not in FORMATS:
        raise MpipeError(f"export format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    return FORMATS[fmt].render(plan, out)
