"""``export --to mindspeed-mm``: a plan as MindSpeed-MM's model.json layout and launch arguments.

MindSpeed-MM (Ascend/MindSpeed-MM, ``pretrain_vlm.py``) takes a VLM's pipeline layout from its
``--mm-model`` model.json: ``image_encoder.vision_encoder.pipeline_num_layers`` and
``text_decoder.pipeline_num_layers``, one count per pipeline stage (``[32, 0, 0, 0]`` and
``[1, 10, 10, 7]``), or with virtual stages a list of ``v`` lists of ``P`` counts, chunk-major
(``[[10, 10, 10, 2], [0, 0, 0, 0]]``: rank r's chunk j is global stage ``j x P + r``,
``docs/zh/features/virtual_pipeline_parallel.md``). Its checks, mirrored by
``tests/report/test_export_mindspeed.py`` (``mindspeed_mm/models/vlm_model.py`` at 57069cd5):
``P`` counts per list, ``P x v`` counts in all with VPP, and counts summing to the module's
``num_layers`` (its last stage is the one whose layers end at ``num_layers``). The vision tower's
layers are the encoder's transformer blocks (its patch embedding runs in the first vision stage, the
projector, ``vision_projector``, after the last one: a Qwen2-VL patch merger is that projector, as in
``examples/qwen2.5vl/model_7b.json``'s 32 vision layers); the text decoder's embedding runs in its first
stage with layers and its output layer in its last.

The writer gives two files: the model.json keys to merge into the model's own model.json
(``num_layers``, ``pipeline_num_layers``, ``freeze`` of the encoder and projector, which
``pretrain_vlm.py`` reads, and ``recompute_granularity``/``recompute_method``/``recompute_num_layers``
for full recomputation, per module), and beside it a shell fragment with the launch script's
parallel arguments: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--virtual-pipeline-model-parallel-size`` (MindSpeed-MM reads no ``VP_SIZE`` variable: its model.json's
chunk-major lists and this flag are the whole of its VPP),
``--microbatch-group-size-per-virtual-pipeline-stage`` (Megatron core 0.12's interleaving in rounds other than P), ``--context-parallel-size 1``, ``--micro-batch-size 1``,
``--global-batch-size``, ``--seq-length``, ``--bf16``/``--fp16``, and ``--enable-dummy-optimizer``
when a stage holds only frozen parameters (its backward has nothing to compute and its rank's
optimizer nothing to update; ``examples/qwen2.5vl/README.md``); with tp > 1 it exports
``CUDA_DEVICE_MAX_CONNECTIONS=1``, as MindSpeed-MM's example launch scripts do for Megatron core's
tensor-parallel layers.

MindSpeed-MM runs Megatron's 1F1B and interleaved 1F1B over sharded stages: a transpose region, GPipe
and interleaving with fewer microbatches than ranks are one line naming the closest plan it runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mpipe_tune.algebra import num_rounds, Skeleton
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import VISION_OUTSIDE_KINDS
from mpipe_tune.plan_file import REFERENCE
from mpipe_tune.report.exports._plan import (
    EMBEDDING_KIND, LM_HEAD_KIND, PROJECTOR_BLOCK, ExportPlan, Output, Stage, wavefront_stages,
)
from mpipe_tune.report.exports._refusals import stored_hint, validate_all_sharded, validate_one_tensor_parallel_degree
from mpipe_tune.report.exports._target import ExportTarget, TwoFiles

TRAINER = "MindSpeed-MM"
MINDSPEED_COMMIT = "57069cd5"
"""The Ascend/MindSpeed-MM commit whose model.json layout and checks the export follows."""
ENCODER_BLOCK = "encoder"
MERGER_KIND = "merger"
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _validate(plan: ExportPlan) -> None:
    """What MindSpeed-MM cannot run, in one line each."""
    validate_all_sharded(plan, TRAINER, "and its pipeline stages each hold a slab of layers (the vision "
                                        "encoder's pipeline_num_layers)")
    others = sorted({r.skeleton for r in plan.sharded if r.skeleton is not Skeleton.ONE_F_ONE_B}, key=lambda s: s.value)
    if others:
        what = " or ".join("GPipe" if s is Skeleton.GPIPE else f"{s.value}'s split input/weight backwards"
                           for s in others)
        raise MpipeError(f"MindSpeed-MM cannot express {plan.describe()}: it runs Megatron's 1F1B schedules with "
                         f"full backwards, not {what}; the closest plan it can express: the same cut and slabs "
                         f"under 1f1b{stored_hint(plan, REFERENCE) if plan.name == 'gpipe' else ''}",
                         quantities=("stored plan",))
    validate_one_tensor_parallel_degree(plan, TRAINER)
    P, M, v = plan.pp, plan.num_microbatches, plan.num_chunks
    if v > 1 and M < P:
        raise MpipeError(f"MindSpeed-MM cannot express {plan.describe()}: Megatron's interleaved schedule runs only "
                         f"M >= P microbatches (M={M}, P={P}); the closest plan it can express: the same plan at M={P}")
    if plan.zero_stage >= 3:
        plan.validate_torch_fsdp2(TRAINER, "FSDP2 (--use-torch-fsdp2, under Megatron core 0.12.1)")


def _layout(plan: ExportPlan) -> dict[str, Any]:
    """The model.json keys of ``plan``: the vision encoder's and text decoder's layer counts per stage."""
    P, v = plan.pp, plan.num_chunks
    stages = wavefront_stages(plan)
    vision = [sum(1 for i in s.vision if _is_vit_layer(plan, i)) for s in stages]
    decoders = [len(s.decoders) for s in stages]
    projector = [_is_projector(plan, i) for i in range(len(plan.layers))]
    parts = {ENCODER_BLOCK: [u for u, p in zip(plan.layers, projector) if u.block == ENCODER_BLOCK and not p],
             PROJECTOR_BLOCK: [u for u, p in zip(plan.layers, projector) if p]}
    frozen_vision = {b: not any(u.trainable for u in layers) for b, layers in parts.items() if layers}
    encoder: dict[str, Any] = {"num_layers": sum(vision), "pipeline_num_layers": _per_stage(vision, P, v),
                               "freeze": frozen_vision.get(ENCODER_BLOCK, True)}
    decoder: dict[str, Any] = {"num_layers": sum(decoders), "pipeline_num_layers": _per_stage(decoders, P, v)}
    if plan.recompute:
        encoder.update(FULL_RECOMPUTE)
        decoder.update(FULL_RECOMPUTE)
    image = {"vision_encoder": encoder}
    if PROJECTOR_BLOCK in frozen_vision:
        image["vision_projector"] = {"freeze": frozen_vision[PROJECTOR_BLOCK]}
    return {"image_encoder": image, "text_decoder": decoder}


def _arguments(plan: ExportPlan, model_json: str) -> str:
    """The launch script's parallel arguments, as a shell fragment that sets ``MPIPE_ARGS``."""
    fsdp = _fsdp2_flags(plan, Path(model_json).with_suffix(FSDP2_SUFFIX).name)
    P, M, v = plan.pp, plan.num_microbatches, plan.num_chunks
    stages = wavefront_stages(plan)
    group = M // num_rounds(P, M)
    frozen = [s.index for s in stages if not any(plan.layers[i].trainable for i in range(*s.layers))]
    args = [
        f"--tensor-model-parallel-size {plan.tp}",
        f"--pipeline-model-parallel-size {P}",
        *([f"--virtual-pipeline-model-parallel-size {v}"] if v > 1 else []),
        *([f"--microbatch-group-size-per-virtual-pipeline-stage {group}"] if v > 1 and group != P else []),
        "--context-parallel-size 1",
        "--micro-batch-size 1",
        f"--global-batch-size {M * plan.dp}",
        f"--seq-length {max(plan.text_tokens)}",
        *({"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(plan.dtype, [])),
        *(["--enable-dummy-optimizer"] if frozen else []),
        *(["--use-distributed-optimizer"] if plan.zero_stage in (1, 2) else []),
        *fsdp,
    ]
    lines = [
        f"# MindSpeed-MM launch arguments for mpipe-tune {plan.describe()}",
        f"# (Ascend/MindSpeed-MM at {MINDSPEED_COMMIT}): merge the keys of {model_json} into your model's "
        f"model.json (--mm-model) and add $MPIPE_ARGS to GPT_ARGS of its finetune script",
        f"# launch on {P * plan.tp * plan.dp} NPUs: the data-parallel size {plan.dp} is what the world size leaves",
        *([f"# stage(s) {', '.join(map(str, frozen))} hold only frozen parameters: --enable-dummy-optimizer"]
          if frozen else []),
        *_notes(plan, stages),
        *plan.distributed_optimizer_note(),
        *(["# FSDP2 (ZeRO-3) as MindSpeed-MM's UserGuide/features/fsdp2.rst launches it; leave "
           "CUDA_DEVICE_MAX_CONNECTIONS above 1 (its examples export 2), and untie the embedding and output "
           "weights in the model if they are tied"] if fsdp else []),
        *(["export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron core's tensor-parallel layers order their "
           "communication by it"] if plan.tp > 1 and not fsdp else []),
        'MPIPE_ARGS="',
        *(f"    {a} \\" for a in args),
        '"',
    ]
    return "\n".join(lines) + "\n"


FSDP2_SUFFIX = ".fsdp2.yaml"
def fsdp2_config(plan: ExportPlan) -> str:
    """The FSDP2 config a stage-3 plan's launch arguments name: ``sharding_size: auto`` is the data-parallel
    group's size (``_create_device_mesh``), ``reshard_after_forward`` FSDP2's own setting, the plan's policy."""
    policy = plan.reshard_after_forward
    return ("# MindSpeed-MM FSDP2 config (--fsdp2-config-path; fields of Fsdp2Config in\n"
            f"# mindspeed_mm/models/transformers/base_model.py at {MINDSPEED_COMMIT}): shard over the whole "
            "data-parallel\n"
            + ("# group, every wrapped module freeing its gathered weights after its forward (ZeRO-3 as planned)\n"
               if policy else "# group, every wrapped module keeping its gathered weights for its backward "
                              "(ZeRO-3 keeping them, as planned)\n")
            + "sharding_size: auto\n"
            + f"reshard_after_forward: {'true' if policy else 'false'}\n")


def _fsdp2_flags(plan: ExportPlan, config_name: str) -> list[str]:
    """The FSDP2 flags of a stage-3 plan (``UserGuide/features/fsdp2.rst``); :func:`_validate` refuses in one
    line, naming the closest plan, what MindSpeed-MM cannot run: its FSDP2 runs inside Megatron core 0.12.1's training
    (README.md's version table), whose ``validate_args`` refuses ``--use-torch-fsdp2`` with pipeline or
    expert parallelism and fp16 (megatron/training/arguments.py at core_v0.12.1, lines 510-528; every
    FSDP2 example of MindSpeed-MM runs PP=1)."""
    if plan.zero_stage < 3:
        return []
    return ["--use-torch-fsdp2", f"--fsdp2-config-path {config_name}", "--ckpt-format torch_dcp",
            "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"]


def _compact_lists(text: str) -> str:
    """Lists of counts on one line, as MindSpeed-MM's own model.json files write them."""
    return re.sub(r"\[[\d,\s\[\]]*\]", lambda m: re.sub(r"\s+", "", m.group()).replace(",", ", "), text)


def _is_vit_layer(plan: ExportPlan, index: int) -> bool:
    layer = plan.layers[index]
    return layer.block == ENCODER_BLOCK and layer.kind not in VISION_OUTSIDE_KINDS


def _is_projector(plan: ExportPlan, index: int) -> bool:
    """MindSpeed-MM's ``vision_projector``: the projector block, and a patch merger of the encoder."""
    layer = plan.layers[index]
    return layer.block == PROJECTOR_BLOCK or (layer.block == ENCODER_BLOCK and layer.kind == MERGER_KIND)


def _per_stage(counts: list[int], num_ranks: int, num_chunks: int) -> list[int] | list[list[int]]:
    """Counts per global stage as MindSpeed-MM lists them: flat for one chunk, else chunk-major rows of P.

    >>> _per_stage([1, 2, 3, 4], 2, 2), _per_stage([1, 2], 2, 1)
    ([[1, 2], [3, 4]], [1, 2])
    """
    if num_chunks == 1:
        return list(counts)
    return [list(counts[j * num_ranks:(j + 1) * num_ranks]) for j in range(num_chunks)]


def _notes(plan: ExportPlan, stages: tuple[Stage, ...]) -> list[str]:
    """Where MindSpeed-MM places a layer in another stage than the plan does, one comment each."""
    def stage_of(index: int) -> int:
        return next(s.index for s in stages if s.layers[0] <= index < s.layers[1])

    notes = []
    vit = [i for i in range(len(plan.layers)) if _is_vit_layer(plan, i)]
    projector = [i for i in range(len(plan.layers)) if _is_projector(plan, i)]
    if vit and projector and stage_of(projector[0]) != stage_of(vit[-1]):
        notes.append(f"# MindSpeed-MM runs the projector after the last vision layer, in stage {stage_of(vit[-1])}; "
                     f"the plan has it in stage {stage_of(projector[0])}")
    with_decoders = [s.index for s in stages if s.decoders]
    for kind, where, name in ((EMBEDDING_KIND, with_decoders[:1], "embedding"),
                              (LM_HEAD_KIND, with_decoders[-1:], "output layer")):
        placed = [stage_of(i) for i, u in enumerate(plan.layers) if u.kind == kind]
        if placed and where and placed[0] != where[0]:
            notes.append(f"# MindSpeed-MM runs the text decoder's {name} in stage {where[0]} (with its "
                         f"{'first' if kind == EMBEDDING_KIND else 'last'} layers); the plan has it in stage "
                         f"{placed[0]}")
    if any(u.block == "llm" for u in plan.layers) and not any(u.trainable for u in plan.layers if u.block == "llm"):
        notes.append("# the plan freezes the text decoder, which pretrain_vlm.py does not (it freezes only the "
                     "vision encoder and projector from model.json): freeze it in the model code")
    return notes


class MindSpeedMM(ExportTarget):
    name = "mindspeed-mm"
    trainer = TRAINER
    help = "MindSpeed-MM model.json layout and launch arguments (needs --out)"
    client = (f"MindSpeed-MM's layout checks (mindspeed_mm/models/vlm_model.py at {MINDSPEED_COMMIT}) and Megatron "
              f"core 0.12.1's validate_args, mirrored with citations in tests/report/test_export_mindspeed.py (they need "
              f"torch_npu to import)")
    files = TwoFiles("the model.json keys", "JSON's", "the launch arguments", "shell fragment", ".json",
                     ".sh",
                     "model.json")

    def validate(self, plan: ExportPlan) -> None:
        _validate(plan)

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        out, sh = paths
        outputs = (Output(out, _compact_lists(json.dumps(_layout(plan), indent=4)) + "\n"),
                   Output(sh, _arguments(plan, out.name)))
        if plan.zero_stage >= 3:
            outputs += (Output(out.with_suffix(FSDP2_SUFFIX), fsdp2_config(plan)),)
        return outputs
