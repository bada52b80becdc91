"""``export --to torchtitan``: a torchtitan job config (TOML, ``--job.config_file``) and the schedule CSV it runs.

Field names of ``torchtitan/config/job_config.py`` at v0.2.2, the last release that reads TOML:
``[parallelism]`` ``pipeline_parallel_degree``, ``tensor_parallel_degree``, ``context_parallel_degree``,
``expert_parallel_degree`` (torchtitan carves ep from dp_shard x cp x tp, so ours, from dp x cp, fits),
``data_parallel_shard_degree`` (FSDP: torchtitan's DDP does not compose with PP),
``data_parallel_replicate_degree``, ``pipeline_parallel_schedule`` (``PipelineScheduleSingle``,
``PipelineScheduleMulti`` or, for a V, ``ZBVZeroBubble``: with a CSV it only sets the stage style,
``stage_ids_this_rank``), ``pipeline_parallel_schedule_csv``, ``pipeline_parallel_microbatch_size`` and
``module_fqns_per_model_part`` (each stage's modules, in the names of torchtitan's Llama-3 and of its ``vlm``
experiment: ``encoder``, ``projector``, ``tok_embeddings``, ``layers.N``, ``norm``, ``output``); ``[training]``
``local_batch_size``, ``global_batch_size``, ``seq_len``, ``mixed_precision_param``;
``[activation_checkpoint]`` ``mode``. The CSV (:mod:`._torch_csv`) goes beside it.

At pp 1 (torchtitan's FSDP-only layout) the job has no pipeline fields and no CSV: each rank runs a microbatch
of one sequence (``local_batch_size`` 1) and accumulates ``global_batch_size`` / (1 x dp) of them; the data axis
is FSDP (``data_parallel_shard_degree``), or DDP (``data_parallel_replicate_degree``) for a ZeRO-0 plan whose
only axis it is.

:class:`TitanJob` is what both torchtitan generations say about a plan; :mod:`._torchtitan_03` writes the
same job as torchtitan 0.3's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpipe_tune.report.exports._plan import PROJECTOR_BLOCK, ExportPlan, Output, frozen_blocks, wavefront_stages
from mpipe_tune.report.exports._refusals import (
    validate_all_sharded, validate_one_tensor_parallel_degree, validate_vision_first,
)
from mpipe_tune.report.exports._target import ExportTarget, TwoFiles
from mpipe_tune.report.exports._torch_csv import ONE_SLAB_STAGES, schedule_csv, validate_schedule_csv

HEAD_MODULE = "output"
"""The output layer's module in torchtitan 0.2.x's Llama-3 (``torchtitan/models/llama3/model.py`` at v0.2.2)."""

@dataclass(frozen=True)
class TitanJob:
    """What both torchtitan config generations say about a plan, in torchtitan's field names."""

    parallelism: dict[str, Any]
    training: dict[str, Any]
    activation_checkpoint: str
    """``none``, ``full`` or ``selective``."""
    notes: tuple[str, ...]


def validate_titan_job(plan: ExportPlan, target: str) -> None:
    """What both torchtitan generations need: every region Sharded, one tensor-parallel degree, the vision
    tower in the first stage, and a schedule CSV torch's runtime runs."""
    validate_all_sharded(plan, target, ONE_SLAB_STAGES)
    validate_one_tensor_parallel_degree(plan, target)
    validate_vision_first(plan, wavefront_stages(plan), target)
    validate_schedule_csv(plan, target)


def titan_job(plan: ExportPlan, csv_path: str, head: str = HEAD_MODULE) -> TitanJob:
    """The job of a plan :func:`validate_titan_job` accepted, its CSV at ``csv_path``, ``head`` the name of
    the output layer's module in the release's models."""
    stages = wavefront_stages(plan)
    last = len(stages) - 1
    parts = []
    for s in stages:
        vision_blocks = dict.fromkeys(PROJECTOR_BLOCK if plan.layers[i].block == PROJECTOR_BLOCK else "encoder"
                                      for i in s.vision)
        parts.append([*vision_blocks, *(["tok_embeddings"] if s.index == 0 else []),
                      *(f"layers.{k}" for k in s.decoders), *(["norm", head] if s.index == last else [])])
    frozen = frozen_blocks(plan)
    if plan.pp > 1:
        notes = [f"launch on {plan.num_devices} devices; each pipeline rank runs its row of {csv_path}",
                 "(the CSV path is read relative to the folder torchtitan starts in)"]
    else:
        notes = [f"launch on {plan.num_devices} devices; no pipeline (pp 1): every rank holds the whole model and "
                 f"accumulates gradients over {plan.num_microbatches} microbatches (global_batch_size over "
                 f"local_batch_size x the data-parallel degree)"]
    if frozen:
        notes.append(f"torchtitan has no setting that freezes modules: freeze {', '.join(frozen)} in the model code")
    if plan.selective_recompute:
        notes.append("the plan recomputes the attention core; torchtitan's selective mode is its op-level policy")
    replicated = _ddp(plan)
    if not replicated:
        notes += plan.data_sharding_note("torchtitan")
    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": plan.pp,
        "tensor_parallel_degree": plan.tp,
        "context_parallel_degree": plan.cp,
        "expert_parallel_degree": plan.ep,
        "data_parallel_shard_degree": 1 if replicated else plan.dp,
        "data_parallel_replicate_degree": plan.dp if replicated else 1,
        # the reshard policy as the plan has it (job_config.py's Parallelism.fsdp_reshard_after_forward:
        # "default" keeps the gathered weights under PP and frees them at pp 1; "always", "never"): stated
        # whatever the degree; ZeRO-2 keeps them, its closest
        **({"fsdp_reshard_after_forward": "always" if plan.zero_stage >= 3 and plan.reshard_after_forward else "never"}
           if plan.zero_stage >= 2 else {}),
    }
    if plan.pp > 1:  # at pp 1 torchtitan builds no pipeline and reads none of these
        parallelism.update({
            "pipeline_parallel_schedule": _titan_schedule(plan),
            "pipeline_parallel_schedule_csv": csv_path,
            "pipeline_parallel_microbatch_size": 1,
            "module_fqns_per_model_part": parts,
        })
    seq_len = max(plan.text_tokens)
    if plan.cp > 1:  # torchtitan's context parallelism shards the sequence in 2 x cp chunks (head-tail)
        seq_len = -(-seq_len // (2 * plan.cp)) * 2 * plan.cp
    training: dict[str, Any] = {  # a microbatch of one sequence: split off a local batch (pp > 1) or accumulated
        "local_batch_size": plan.num_microbatches if plan.pp > 1 else 1,
        "global_batch_size": plan.num_microbatches * plan.dp,
        "seq_len": seq_len,
        **({"mixed_precision_param": _TITAN_DTYPES[plan.dtype]} if plan.dtype in _TITAN_DTYPES else {}),
    }
    mode = "full" if plan.recompute else "selective" if plan.selective_recompute else "none"
    return TitanJob(parallelism, training, mode, tuple(notes))


def _ddp(plan: ExportPlan) -> bool:
    """Whether torchtitan runs the plan's data parallelism as the plan has it, replicated (DDP): at ZeRO 0 with
    the data axis the only one (torchtitan's DDP takes a one-dimensional mesh: no pp, tp, cp or ep)."""
    return plan.zero_stage == 0 and plan.dp > 1 and plan.pp == plan.tp == plan.cp == plan.ep == 1


def titan_outputs(plan: ExportPlan, paths: tuple[Path | None, ...], job_text) -> tuple[Output, ...]:
    """The job file (``job_text(plan, csv path)``) and, with a pipeline, the schedule CSV beside it (at pp 1 the
    job names no schedule, and no CSV is written)."""
    job, csv = paths
    if plan.pp == 1:
        return (Output(job, job_text(plan, str(csv))),)
    return (Output(job, job_text(plan, str(csv))), Output(csv, schedule_csv(plan)))


def _job_toml(plan: ExportPlan, csv_path: str) -> str:
    """The TOML job config (torchtitan 0.2.x) that runs the CSV at ``csv_path`` with the plan's degrees
    and microbatches."""
    job = titan_job(plan, csv_path)
    par = dict(job.parallelism)
    parts = par.pop("module_fqns_per_model_part", None)
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
        *(["module_fqns_per_model_part = [", *(f"  {_toml(p)}," for p in parts), "]"] if parts else []),
        "",
        "[training]",
        *(f"{k} = {_toml(v)}" for k, v in job.training.items()),
        "",
        "[activation_checkpoint]",
        f"mode = {_toml(job.activation_checkpoint)}",
        *(['selective_ac_option = "op"'] if job.activation_checkpoint == "selective" else []),
    ]
    return "\n".join(lines) + "\n"


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

class TorchTitan(ExportTarget):
    name = "torchtitan"
    trainer = "torchtitan"
    help = "torchtitan 0.2.x TOML job config and the CSV it runs (needs --out)"
    client = ("torchtitan 0.2.x reads the TOML (field names of its job_config.py at v0.2.2, no release of it "
              "installs beside torch 2.13); torch 2.13 runs the CSV (tests/report/test_export_csv_runs.py)")
    files = TwoFiles("the TOML job config", "TOML's", "the schedule CSV it names", "CSV", ".toml", ".csv", "job.toml")

    def validate(self, plan: ExportPlan) -> None:
        validate_titan_job(plan, self.trainer)

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        return titan_outputs(plan, paths, _job_toml)
