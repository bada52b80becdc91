"""Exports of a plan to other trainers: each writer a pure function of one typed :class:`ExportPlan`.

:func:`read_export_plan` reads one plan of a plan file (the best or a stored baseline) and the model
it was made for into an :class:`ExportPlan`; the writers read nothing else. Each returns text:

``torch-csv``
    The per-rank compute actions in the CSV that ``torch.distributed.pipelining``'s
    ``_PipelineScheduleRuntime._load_csv`` reads (torch 2.13, ``schedules.py``): one row per pipeline
    rank, cells ``{stage}F{mb}`` / ``{stage}B{mb}`` (``_Action``'s text form; ``B`` the full backward,
    and a zero-bubble skeleton's split backward as ``{stage}I{mb}``, the input gradient, and a later
    ``{stage}W{mb}``, the weight gradient), in the rank's order from ``order.nodes``; stage index =
    rank + (j - 1) x P for the j-th Sharded region (``zbv``'s second: 2P - 1 - rank, a V), the stage
    placement torch infers from the rows. Plans whose regions are all Sharded only.
``torchtitan``
    A torchtitan job config (TOML, ``--job.config_file``; field names of
    ``torchtitan/config/job_config.py`` at v0.2.2, the last release that reads TOML):
    ``[parallelism]`` ``pipeline_parallel_degree``, ``tensor_parallel_degree``,
    ``context_parallel_degree``, ``expert_parallel_degree`` (torchtitan carves ep from
    dp_shard x cp x tp, so ours, from dp x cp, fits), ``data_parallel_shard_degree`` (FSDP:
    torchtitan's DDP does not compose with PP), ``data_parallel_replicate_degree``,
    ``pipeline_parallel_schedule`` (``PipelineScheduleSingle``, ``PipelineScheduleMulti`` or, for a V,
    ``ZBVZeroBubble``: with a CSV it only sets the stage style, ``stage_ids_this_rank``),
    ``pipeline_parallel_schedule_csv``, ``pipeline_parallel_microbatch_size`` and
    ``module_fqns_per_model_part`` (each stage's modules, in the names of torchtitan's Llama-3 and of its
    ``vlm`` experiment: ``encoder``, ``projector``, ``tok_embeddings``, ``layers.N``, ``norm``,
    ``output``); ``[training]`` ``local_batch_size``, ``global_batch_size``, ``seq_len``,
    ``mixed_precision_param``; ``[activation_checkpoint]`` ``mode``. The CSV goes beside it.
``torchtitan-0.3``
    The same job in torchtitan 0.3's command-line form (``torchtitan/config/manager.py``, which reads no
    TOML): ``--module`` and ``--config`` (a registered config function: torchtitan's smallest llama3 or
    deepseek_v3 one, to be replaced by the user's), ``--parallelism.*`` and ``--training.*`` overrides
    (``enable_sequence_parallel`` as the plan says, ``disable_cuda_graphs`` with PP), the
    ``activation-checkpoint:MODE`` subcommand last. The CSV goes beside it.
``megatron``
    Megatron-LM launch arguments (``megatron/training/arguments.py`` and the config dataclasses it
    turns into flags): ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
    ``--num-layers``, ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` decoder layer,
    ``L`` loss, ``|`` between stages; ``E`` always on the first stage and ``L`` on the last; its stage
    count over P is the virtual-stage count, so no VPP flag is given),
    ``--microbatch-group-size-per-virtual-pipeline-stage`` (interleaving in rounds other than P),
    ``--micro-batch-size``, ``--global-batch-size``, ``--seq-length`` (a multiple of 2 x cp with cp),
    ``--bf16``/``--fp16``, ``--context-parallel-size``, ``--sequence-parallel``,
    ``--expert-model-parallel-size`` with ``--num-experts``, ``--moe-router-topk`` and
    ``--moe-layer-freq``, ``--use-distributed-optimizer`` (ZeRO-1),
    ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`` or
    ``--recompute-granularity selective --recompute-modules core_attn``, a note to set
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tp or cp > 1, and
    ``--freeze-ViT``/``--freeze-LM`` of ``examples/multimodal`` (whose LLaVA model builds the vision
    encoder inside the first pipeline stage). Data parallelism is what the world size leaves.
``hyper-parallel``
    A hyper-parallel trainer YAML: :mod:`mpipe_tune.report.export_hyper_parallel`.
``mindspeed-mm``
    MindSpeed-MM's model.json layout and launch arguments: :mod:`mpipe_tune.report.export_mindspeed`.

Where a format cannot express a plan (a transpose region for torch-csv, torchtitan and Megatron-LM,
GPipe for Megatron-LM, an owner map hyper-parallel has no mode for, a zero-bubble skeleton's split
backward for Megatron-LM and hyper-parallel, the encoder's own tp for any of them, ep, cp, sequence
parallelism or selective recomputation for hyper-parallel, an encoder backward moved off its owner for
any of them), the writer raises one
:class:`~mpipe_tune.errors.MpipeError` line that says why and names the closest plan it can express.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.algebra.events import Fwd, Wgrad
from mpipe_tune.algebra.order import num_rounds
from mpipe_tune.algebra.schedule import Skeleton
from mpipe_tune.errors import MpipeError
from mpipe_tune.report.export_hyper_parallel import to_hyper_parallel
from mpipe_tune.report.export_mindspeed import mindspeed_outputs
from mpipe_tune.report.export_plan import (
    PROJECTOR_BLOCK, ExportPlan, Output, frozen_blocks, stored_hint, validate_all_sharded, validate_vision_first,
    wavefront_stages,
)
from mpipe_tune.search.baselines import REFERENCE


_ONE_SLAB_STAGES = "and a torch.distributed.pipelining stage is one slab on one rank"


# ---- torch.distributed.pipelining CSV ------------------------------------------------------------


def to_torch_csv(plan: ExportPlan) -> str:
    """One row per pipeline rank of ``{stage}F{mb}`` / ``{stage}B{mb}`` cells, in the rank's order; a
    split backward as ``{stage}I{mb}`` (input gradient) and a later ``{stage}W{mb}`` (weight gradient)."""
    validate_all_sharded(plan, "torch-csv", _ONE_SLAB_STAGES)
    split = {(e.region, e.rank, e.mb) for order in plan.orders for e in order if isinstance(e, Wgrad)}
    rows, counts = [], {}
    for rank, order in enumerate(plan.orders):
        row = []
        for event in order:
            stage = plan.stage_index(event.region, rank)
            if isinstance(event, Fwd):
                op = "F"
            elif isinstance(event, Wgrad):
                op = "W"
            else:
                op = "I" if (event.region, event.rank, event.mb) in split else "B"
            kind = "B" if op in "BI" else op  # one backward (full or input part) per forward
            counts[stage, kind] = counts.get((stage, kind), 0) + 1
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


@dataclass(frozen=True)
class TitanJob:
    """What both torchtitan config generations say about a plan, in torchtitan's field names."""

    parallelism: dict[str, Any]
    training: dict[str, Any]
    activation_checkpoint: str
    """``none``, ``full`` or ``selective``."""
    notes: tuple[str, ...]


def _titan_job(plan: ExportPlan, csv_path: str) -> TitanJob:
    validate_all_sharded(plan, "torchtitan", _ONE_SLAB_STAGES)
    if plan.encoder_tp is not None:
        raise MpipeError(f"torchtitan cannot express {plan.describe()}: it runs the encoder at tp {plan.encoder_tp}, "
                         f"and torchtitan has one tensor-parallel degree for the whole model; the closest plan it can "
                         f"express: the same plan with the encoder at tp {plan.tp} (re-plan without encoder tensor "
                         f"parallelism)", quantities=("encoder tensor parallelism",))
    stages = wavefront_stages(plan)
    validate_vision_first(plan, stages, "torchtitan")
    last = len(stages) - 1
    parts = []
    for s in stages:
        vision_blocks = dict.fromkeys(PROJECTOR_BLOCK if plan.layers[i].block == PROJECTOR_BLOCK else "encoder"
                                      for i in s.vision)
        parts.append([*vision_blocks, *(["tok_embeddings"] if s.index == 0 else []),
                      *(f"layers.{k}" for k in s.decoders), *(["norm", "output"] if s.index == last else [])])
    frozen = frozen_blocks(plan)
    notes = [f"launch on {plan.num_devices} devices; each pipeline rank runs its row of {csv_path}",
             "(the CSV path is read relative to the folder torchtitan starts in)"]
    if frozen:
        notes.append(f"torchtitan has no setting that freezes modules: freeze {', '.join(frozen)} in the model code")
    if plan.selective_recompute:
        notes.append("the plan recomputes the attention core; torchtitan's selective mode is its op-level policy")
    notes += plan.data_sharding_note("torchtitan")
    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": plan.pp,
        "tensor_parallel_degree": plan.tp,
        "context_parallel_degree": plan.cp,
        "expert_parallel_degree": plan.ep,
        "data_parallel_shard_degree": plan.dp,
        "data_parallel_replicate_degree": 1,
        # ZeRO-3 as the plan has it: every layer frees its gathered weights after its forward (torchtitan's
        # "default" keeps them under PP)
        **({"fsdp_reshard_after_forward": "always"} if plan.zero_stage >= 3 else {}),
        "pipeline_parallel_schedule": _titan_schedule(plan),
        "pipeline_parallel_schedule_csv": csv_path,
        "pipeline_parallel_microbatch_size": 1,
        "module_fqns_per_model_part": parts,
    }
    seq_len = max(plan.text_tokens)
    if plan.cp > 1:  # torchtitan's context parallelism shards the sequence in 2 x cp chunks (head-tail)
        seq_len = -(-seq_len // (2 * plan.cp)) * 2 * plan.cp
    training: dict[str, Any] = {
        "local_batch_size": plan.num_microbatches,
        "global_batch_size": plan.num_microbatches * plan.dp,
        "seq_len": seq_len,
        **({"mixed_precision_param": _TITAN_DTYPES[plan.dtype]} if plan.dtype in _TITAN_DTYPES else {}),
    }
    mode = "full" if plan.recompute else "selective" if plan.selective_recompute else "none"
    return TitanJob(parallelism, training, mode, tuple(notes))


def to_torchtitan(plan: ExportPlan, csv_path: str) -> str:
    """The TOML job config (torchtitan 0.2.x) that runs the CSV at ``csv_path`` with the plan's degrees
    and microbatches."""
    job = _titan_job(plan, csv_path)
    par = dict(job.parallelism)
    parts = par.pop("module_fqns_per_model_part")
    if plan.tp > 1 and not plan.sequence_parallel:
        notes = (*job.notes, "torchtitan 0.2.x always runs sequence parallelism with tp > 1 (the plan does not)")
    else:
        notes = job.notes
    lines = [
        f"# torchtitan job config for mpipe-tune {plan.describe()} (torchtitan v0.2.x, --job.config_file)",
        *(f"# {n}" for n in notes),
        "",
        "[parallelism]",
        *(f"{k} = {_toml(v)}" for k, v in par.items()),
        "module_fqns_per_model_part = [",
        *(f"  {_toml(p)}," for p in parts),
        "]",
        "",
        "[training]",
        *(f"{k} = {_toml(v)}" for k, v in job.training.items()),
        "",
        "[activation_checkpoint]",
        f"mode = {_toml(job.activation_checkpoint)}",
        *(['selective_ac_option = "op"'] if job.activation_checkpoint == "selective" else []),
    ]
    return "\n".join(lines) + "\n"


TITAN_MODULES = {"dense": ("llama3", "llama3_debugmodel"), "moe": ("deepseek_v3", "deepseek_v3_debugmodel")}
"""torchtitan 0.3's ``--module``/``--config`` (a ``config_registry`` function) per backbone type: the
release's smallest registered config of a dense and of a MoE backbone, for the user to replace with
their model's."""


def to_torchtitan_args(plan: ExportPlan, csv_path: str) -> str:
    """torchtitan 0.3's command-line form (``torchtitan/config/manager.py``: ``--module`` and
    ``--config`` pick a registered config function, ``--section.field value`` overrides it, the
    activation-checkpoint choice is a ``activation-checkpoint:MODE`` subcommand, last), one argument per
    line after ``#`` comments."""
    job = _titan_job(plan, csv_path)
    module, config = TITAN_MODULES["moe" if plan.moe_layers else "dense"]
    par = dict(job.parallelism)
    parts = par.pop("module_fqns_per_model_part")
    args = [f"# torchtitan 0.3 arguments for mpipe-tune {plan.describe()}",
            *(f"# {n}" for n in job.notes),
            f"# --config names torchtitan's smallest {module} config: replace it with your model's config function",
            f"--module {module}", f"--config {config}",
            *(f"--parallelism.{k} {shlex.quote(str(v))}" for k, v in par.items()),
            "--parallelism.module_fqns_per_model_part " + " ".join(shlex.quote(",".join(p)) for p in parts),
            "--parallelism.enable_sequence_parallel" if plan.sequence_parallel
            else "--parallelism.no-enable-sequence-parallel",
            *(f"--training.{k} {shlex.quote(str(v))}" for k, v in job.training.items()),
            *(["--training.disable_cuda_graphs"] if plan.pp > 1 else []),  # its CUDA graphs refuse PP
            f"activation-checkpoint:{job.activation_checkpoint}"]
    return "\n".join(args) + "\n"


_TITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _titan_schedule(plan: ExportPlan) -> str:
    """The schedule name that sets torchtitan's stage style (its CSV runs on ``_PipelineScheduleRuntime``
    whatever the name): ``ZBVZeroBubble`` places a V (stages r and 2P-1-r on rank r), the others a
    loop of ``num_chunks`` stages per rank."""
    if plan.is_v:
        return "ZBVZeroBubble"
    return "PipelineScheduleSingle" if plan.num_chunks == 1 else "PipelineScheduleMulti"


def _toml(value: Any) -> str:
    """A TOML string, integer or array of strings (JSON's escapes are TOML's basic-string escapes)."""
    return json.dumps(value, ensure_ascii=True)


# ---- Megatron-LM ---------------------------------------------------------------------------------


def to_megatron(plan: ExportPlan) -> str:
    """Megatron-LM arguments, one per line (comments start with ``#``)."""
    validate_all_sharded(plan, "Megatron-LM", "and Megatron-LM builds the vision encoder inside the first "
                                              "pipeline stage only")
    if plan.regions[0].skeleton is Skeleton.GPIPE:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it has no GPipe schedule, its pipelines run "
                         f"1F1B; the closest plan it can express: the same cut and slabs under 1f1b"
                         f"{stored_hint(plan, REFERENCE) if plan.name == 'gpipe' else ''}", quantities=("stored plan",))
    if plan.splits_backward:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: its pipelines run full backwards, not the "
                         f"split input/weight backwards of a zero-bubble skeleton; the closest plan it can express: "
                         f"the same cut and slabs under 1f1b{stored_hint(plan, REFERENCE)}, or export this one in export "
                         f"format torch-csv or torchtitan", quantities=("stored plan", "export format"))
    if plan.encoder_tp is not None:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it runs the encoder at tp {plan.encoder_tp}, "
                         f"and Megatron-LM has one tensor-parallel size for the whole model; the closest plan it can "
                         f"express: the same plan with the encoder at tp {plan.tp} (re-plan without encoder tensor "
                         f"parallelism)", quantities=("encoder tensor parallelism",))
    stages = wavefront_stages(plan)
    validate_vision_first(plan, stages, "Megatron-LM")
    fsdp = _megatron_fsdp(plan)
    v, P, M = plan.num_chunks, plan.pp, plan.num_microbatches
    group = M // num_rounds(P, M)
    if v > 1 and group < P:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it interleaves only M >= P microbatches "
                         f"(M={M}, P={P}); the closest plan it can express: the same plan at M={P}")
    last = len(stages) - 1
    layout = "|".join(("E" if s.index == 0 else "") + _runs("t", len(s.decoders)) + ("L" if s.index == last else "")
                      for s in stages)
    num_decoders = sum(len(s.decoders) for s in stages)
    seq_len = max(plan.text_tokens)
    if plan.cp > 1:  # arguments.py validate_args: seq-length a multiple of 2 x context-parallel-size
        seq_len = -(-seq_len // (2 * plan.cp)) * 2 * plan.cp
    args = [
        f"# Megatron-LM arguments for mpipe-tune {plan.describe()}",
        f"# launch on {plan.num_devices} GPUs: the data-parallel size {plan.dp} is what the world size leaves",
        *([f"# export CUDA_DEVICE_MAX_CONNECTIONS=1 before launch: Megatron-LM's tensor- and context-parallel "
           f"layers rely on it to order their communication before Blackwell"]
          if (plan.tp > 1 or plan.cp > 1) and not fsdp else []),
        *(["# leave CUDA_DEVICE_MAX_CONNECTIONS unset or above 1: --use-torch-fsdp2 refuses 1 (Megatron-LM then "
           "only warns about tp or cp > 1)", "# --untie-embeddings-and-output-weights: --use-torch-fsdp2 requires "
           "it; tie them in the model code if your model does"] if fsdp else []),
        f"--tensor-model-parallel-size {plan.tp}",
        f"--pipeline-model-parallel-size {P}",
        *([f"--context-parallel-size {plan.cp}"] if plan.cp > 1 else []),
        *(["--sequence-parallel"] if plan.sequence_parallel and plan.tp > 1 else []),
        *_megatron_moe(plan),
        *(["--use-distributed-optimizer"] if plan.zero_stage in (1, 2) else []),
        *fsdp,
        f"--num-layers {num_decoders}",
        f"--pipeline-model-parallel-layout {shlex.quote(layout)}",
        *([f"--microbatch-group-size-per-virtual-pipeline-stage {group}"] if v > 1 and group != P else []),
        "--micro-batch-size 1",
        f"--global-batch-size {M * plan.dp}",
        f"--seq-length {seq_len}",
        *({"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(plan.dtype, [])),
        *(["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
          if plan.recompute else []),
        *(["--recompute-granularity selective", "--recompute-modules core_attn"] if plan.selective_recompute else []),
        *_megatron_freeze(plan),
    ]
    return "\n".join(args) + "\n"


MEGATRON_FSDP_FLAGS = ("--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--ckpt-format torch_dist",
                       "--untie-embeddings-and-output-weights")
"""Megatron-LM's torch FSDP2 (ZeRO-3) and what ``validate_args`` asserts beside it (arguments.py at d98e8a6,
lines 1031-1049): no distributed optimizer, no gradient-accumulation fusion, a torch_dist or torch_dcp
checkpoint, untied embedding and output weights, no fp16, CUDA_DEVICE_MAX_CONNECTIONS not 1."""


def _megatron_fsdp(plan: ExportPlan) -> list[str]:
    """The ZeRO-3 flags of a stage-3 plan, or one line naming the closest plan where Megatron-LM's torch
    FSDP2 cannot run it (pipeline or expert parallelism, fp16: arguments.py at d98e8a6, 1034-1047)."""
    if plan.zero_stage < 3:
        return []
    plan.validate_torch_fsdp2("Megatron-LM", "torch FSDP2 (--use-torch-fsdp2)")
    return list(MEGATRON_FSDP_FLAGS)


def _megatron_moe(plan: ExportPlan) -> list[str]:
    """``--num-experts``, ``--moe-router-topk``, ``--moe-layer-freq`` (a pattern when some decoder
    layers are dense) and ``--expert-model-parallel-size``."""
    if not plan.moe_layers:
        return []
    counts = sorted({n for _, n in plan.moe_layers})
    if len(counts) > 1:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: its MoE layers have {counts} routed experts, "
                         f"and Megatron-LM's --num-experts is one count for every MoE layer")
    moe = {k for k, _ in plan.moe_layers}
    num_decoders = sum(len(s.decoders) for s in wavefront_stages(plan))
    flags = [int(k in moe) for k in range(num_decoders)]
    args = [f"--num-experts {counts[0]}", f"--moe-router-topk {plan.moe_top_k}"]
    if 0 in flags:
        runs, start = [], 0
        for k in range(1, num_decoders + 1):
            if k == num_decoders or flags[k] != flags[start]:
                runs.append(f"[{flags[start]}]*{k - start}")
                start = k
        args.append(f"--moe-layer-freq {shlex.quote('(' + '+'.join(runs) + ')')}")
    if plan.ep > 1:
        args.append(f"--expert-model-parallel-size {plan.ep}")
    return args


def _runs(symbol: str, count: int) -> str:
    return "" if count == 0 else symbol if count == 1 else f"{symbol}*{count}"


def _megatron_freeze(plan: ExportPlan) -> list[str]:
    frozen = set(frozen_blocks(plan))
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


# ---- the format table ----------------------------------------------------------------------------


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
                         "give the TOML's path as the output file, e.g. job.toml (the CSV goes beside it)",
                         quantities=("output file",))
    if out.suffix.lower() != ".toml":
        raise MpipeError(f"the torchtitan job config {out} must end in .toml (its schedule CSV goes beside it, "
                         f"as {out.with_suffix('.csv').name}); e.g. {out.stem or 'job'}.toml")
    csv_path = out.with_suffix(".csv")
    return (Output(out, to_torchtitan(plan, str(csv_path))), Output(csv_path, to_torch_csv(plan)))


def _hyper_parallel(plan: ExportPlan, out: Path | None) -> tuple[Output, ...]:
    return (Output(out, to_hyper_parallel(plan)),)


def _torchtitan_args_outputs(plan: ExportPlan, out: Path | None) -> tuple[Output, ...]:
    if out is None or out.suffix.lower() == ".csv":
        raise MpipeError("the torchtitan-0.3 export is two files, the arguments and the schedule CSV they name; "
                         "give the arguments' path as the output file, e.g. job.args (the CSV goes beside it)",
                         quantities=("output file",))
    csv_path = out.with_suffix(".csv")
    return (Output(out, to_torchtitan_args(plan, str(csv_path))), Output(csv_path, to_torch_csv(plan)))


def _mindspeed_mm(plan: ExportPlan, out: Path | None) -> tuple[Output, ...]:
    return mindspeed_outputs(plan, out)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("torch-csv", "torch.distributed.pipelining schedule CSV (compute actions per rank)",
           _single(to_torch_csv)),
    Format("torchtitan", "torchtitan 0.2.x TOML job config and the CSV it runs (needs --out)", _torchtitan_outputs),
    Format("torchtitan-0.3", "torchtitan 0.3 arguments (--module/--config and overrides) and the CSV they run "
           "(needs --out)", _torchtitan_args_outputs),
    Format("megatron", "Megatron-LM launch arguments", _single(to_megatron)),
    Format("hyper-parallel", "hyper-parallel trainer YAML (Mpipe transpose schedule arguments)", _hyper_parallel),
    Format("mindspeed-mm", "MindSpeed-MM model.json layout and launch arguments (needs --out)", _mindspeed_mm),
)}


def export_outputs(plan: ExportPlan, fmt: str, out: Path | None) -> tuple[Output, ...]:
    """The files (or the standard output text) of ``plan`` in format ``fmt``."""
    if fmt not in FORMATS:
        raise MpipeError(f"export format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    return FORMATS[fmt].render(plan, out)
