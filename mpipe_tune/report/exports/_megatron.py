"""``export --to megatron``: Megatron-LM launch arguments (``megatron/training/arguments.py`` and the config
dataclasses it turns into flags).

``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--num-layers``,
``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` decoder layer, ``L`` loss, ``|`` between stages;
``E`` always on the first stage and ``L`` on the last; its stage count over P is the virtual-stage count, so no
VPP flag is given), ``--microbatch-group-size-per-virtual-pipeline-stage`` (interleaving in rounds other than
P), ``--micro-batch-size``, ``--global-batch-size``, ``--seq-length`` (a multiple of 2 x cp with cp),
``--bf16``/``--fp16``, ``--context-parallel-size``, ``--sequence-parallel``, ``--expert-model-parallel-size``
with ``--num-experts``, ``--moe-router-topk`` and ``--moe-layer-freq``, ``--use-distributed-optimizer``
(ZeRO-1) or ``--use-torch-fsdp2`` (ZeRO-3), ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1`` or ``--recompute-granularity selective --recompute-modules core_attn``, a note to
set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tp or cp > 1, and ``--freeze-ViT``/``--freeze-LM`` of
``examples/multimodal`` (whose LLaVA model builds the vision encoder inside the first pipeline stage). Data
parallelism is what the world size leaves.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from mpipe_tune.algebra import num_rounds, Skeleton
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import REFERENCE
from mpipe_tune.report.exports._plan import PROJECTOR_BLOCK, ExportPlan, Output, frozen_blocks, wavefront_stages
from mpipe_tune.report.exports._refusals import (
    stored_hint, validate_all_sharded, validate_one_tensor_parallel_degree, validate_vision_first,
)
from mpipe_tune.report.exports._target import ExportTarget

TRAINER = "Megatron-LM"


def _validate(plan: ExportPlan) -> None:
    """What Megatron-LM cannot run, in one line each."""
    validate_all_sharded(plan, TRAINER, "and Megatron-LM builds the vision encoder inside the first pipeline "
                                        "stage only")
    if plan.regions[0].skeleton is Skeleton.GPIPE:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it has no GPipe schedule, its pipelines run "
                         f"1F1B; the closest plan it can express: the same cut and slabs under 1f1b"
                         f"{stored_hint(plan, REFERENCE) if plan.name == 'gpipe' else ''}", quantities=("stored plan",))
    if plan.splits_backward:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: its pipelines run full backwards, not the "
                         f"split input/weight backwards of a zero-bubble skeleton; the closest plan it can express: "
                         f"the same cut and slabs under 1f1b{stored_hint(plan, REFERENCE)}, or export this one in "
                         f"export format torch-csv or torchtitan", quantities=("stored plan", "export format"))
    validate_one_tensor_parallel_degree(plan, TRAINER)
    validate_vision_first(plan, wavefront_stages(plan), TRAINER)
    if plan.zero_stage >= 3:
        plan.validate_torch_fsdp2(TRAINER, "torch FSDP2 (--use-torch-fsdp2)")
    P, M = plan.pp, plan.num_microbatches
    if plan.num_chunks > 1 and M // num_rounds(P, M) < P:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: it interleaves only M >= P microbatches "
                         f"(M={M}, P={P}); the closest plan it can express: the same plan at M={P}")
    counts = sorted({n for _, n in plan.moe_layers})
    if len(counts) > 1:
        raise MpipeError(f"Megatron-LM cannot express {plan.describe()}: its MoE layers have {counts} routed experts, "
                         f"and Megatron-LM's --num-experts is one count for every MoE layer")


def _arguments(plan: ExportPlan) -> str:
    """Megatron-LM arguments, one per line (comments start with ``#``), of a plan :func:`_validate` accepted."""
    stages = wavefront_stages(plan)
    fsdp = list(MEGATRON_FSDP_FLAGS) if plan.zero_stage >= 3 else []
    v, P, M = plan.num_chunks, plan.pp, plan.num_microbatches
    group = M // num_rounds(P, M)
    last = len(stages) - 1
    layout = "|".join(("E" if s.index == 0 else "") + _runs("t", len(s.decoders)) + ("L" if s.index == last else "")
                      for s in stages)
    num_decoders = sum(len(s.decoders) for s in stages)
    seq_len = max(plan.text_tokens)
    if plan.cp > 1:  # _arguments.py validate_args: seq-length a multiple of 2 x context-parallel-size
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
        *plan.distributed_optimizer_note(),
        f"--tensor-model-parallel-size {plan.tp}",
        f"--pipeline-model-parallel-size {P}",
        *([f"--context-parallel-size {plan.cp}"] if plan.cp > 1 else []),
        *(["--sequence-parallel"] if plan.sequence_parallel and plan.tp > 1 else []),
        *_megatron_moe(plan),
        *(["--use-distributed-optimizer"] if plan.zero_stage in (1, 2) else []),
        *fsdp,
        f"--num-layers {num_decoders}",
        *([f"--pipeline-model-parallel-layout {shlex.quote(layout)}"] if P > 1 else []),  # pp 1: the one stage
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
"""Megatron-LM's torch FSDP2 (ZeRO-3) and what ``validate_args`` asserts beside it (_arguments.py at d98e8a6,
lines 1031-1049): no distributed optimizer, no gradient-accumulation fusion, a torch_dist or torch_dcp
checkpoint, untied embedding and output weights, no fp16, CUDA_DEVICE_MAX_CONNECTIONS not 1."""


def _megatron_moe(plan: ExportPlan) -> list[str]:
    """``--num-experts``, ``--moe-router-topk``, ``--moe-layer-freq`` (a pattern when some decoder
    layers are dense), ``--expert-model-parallel-size`` and ``--disable-bias-linear``: Megatron-LM's MoE layer
    refuses experts with a bias (``mlp_bias is not supported``: moe/moe_layer.py lines 568 and 684 at
    d98e8a6; TEGroupedMLP refuses one beside the default bias-dropout fusion, moe/experts.py 205-207; shared
    experts, moe/shared_experts.py 124), and the plan's experts have none."""
    if not plan.moe_layers:
        return []
    counts = sorted({n for _, n in plan.moe_layers})
    moe = {k for k, _ in plan.moe_layers}
    num_decoders = sum(len(s.decoders) for s in wavefront_stages(plan))
    flags = [int(k in moe) for k in range(num_decoders)]
    args = [f"--num-experts {counts[0]}", f"--moe-router-topk {plan.moe_top_k}", "--disable-bias-linear"]
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
                     "(its _model.py passes freeze_vision_projection=False)")
    if "llm" in frozen:
        lines.append("--freeze-LM")
    if lines:
        lines.insert(0, "# freezing flags of examples/multimodal (multimodal_args.py)")
    return lines


class Megatron(ExportTarget):
    name = "megatron"
    trainer = TRAINER
    help = "Megatron-LM launch arguments"
    client = ("Megatron-LM's validate_args (megatron/training/arguments.py at d98e8a6), mirrored line by line "
              "with citations in tests/report/test_export.py and test_export_zero3.py (it needs CUDA to import)")

    def validate(self, plan: ExportPlan) -> None:
        _validate(plan)

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        return (Output(paths[0], _arguments(plan)),)
