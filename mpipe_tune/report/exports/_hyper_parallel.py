"""``export --to hyper-parallel``: a trainer YAML that hyper-parallel's trainer accepts at start-up.

The fields are those of mindspore-ai/hyper-parallel's three-tier ``model``/``data``/``train`` schema
(``hyper_parallel/trainer/config.py`` at 51e4a86b, the commit with MPipe): ``train.accelerator``
``pp``, ``pp_vpp``, ``pp_micro_batch_num``, ``pp_schedule`` (``mpipe`` for the transpose, else
``1f1b`` or ``gpipe``), ``pp_layer_split`` (decoder layers per global stage), ``tp``, ``dp_shard``,
``dp_replicate`` and the transpose's ``pp_mpipe_transpose_layers`` (``visual`` or a layer count),
``pp_mpipe_transpose_overflow`` and ``pp_mpipe_owner_backward``. Its owner map is not free: overflow
``full`` gives microbatch m to rank m mod NT, ``min`` gives m < NT to rank m and the rest to rank 0
(NT = min(P, M)); another owner map cannot be expressed.

The YAML is written to pass the trainer's start-up checks at that commit
(``hyper_parallel/trainer/base.py``):

- ``BaseTrainer._setup``: a low-precision ``param_dtype`` under PP needs an FSDP-wrappable data axis,
  ``dp_shard >= 2`` with ``dp_replicate 1``. The plan's data-parallel degree is written as
  ``dp_shard`` (FSDP-sharded, as the torchtitan export writes ``data_parallel_shard_degree``), with
  ``dp_replicate 1``; a PP plan at dp 1 cannot carry bf16 there, so its YAML trains float32 params
  (mixed precision off) and its header says so.
- ``BaseTrainer._validate_pp_model_parallel_grad_clipping``: PP with tp > 1 needs
  ``optimizer.max_grad_norm 0`` (no clipping).
- ``BaseTrainer._validate_pp_runtime_options``: ``checkpoint.save_hf_weights false`` under PP; the
  effective batch (``global_batch_size // (micro_batch_size x dp)`` x ``micro_batch_size``) a
  multiple of ``pp_micro_batch_num``.
- ``BaseTrainer._build_pipelined_model``: PP composed with FSDP needs ``init_device meta``.

One check depends on the model: activation checkpointing under PP is refused unless the model's
``ModelSpec.pp_applies_activation_checkpoint`` is set (default false); a plan with recomputation asks
for ``full`` and the header says to check it.

The ``model`` section names ``qwen3_vl_moe`` built as its VL model (``config_overrides.vl``), the
model whose ``visual`` tower hyper-parallel's MPipe trainer tests transpose
(``tests/torch/accuracy/test_qwen3_vl_moe_trainer_accuracy.py`` at 51e4a86b), with the plan's
decoder count as ``num_hidden_layers`` (``pp_layer_split`` must sum to it); the ``data`` section its
synthetic ``vl_dummy`` set at the plan's longest text sequence. Both are for the user to replace with
their model, weights and dataset, as the header says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mpipe_tune.algebra import Skeleton
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import MPIPE_RR
from mpipe_tune.report.exports._plan import ExportPlan, ExportRegion, Output, frozen_blocks, wavefront_stages
from mpipe_tune.report.exports._refusals import stored_hint, validate_pp_tp_dp, validate_vision_first
from mpipe_tune.report.exports._target import ExportTarget

TRAINER = "hyper-parallel"
HYPER_PARALLEL_COMMIT = "51e4a86b"
"""The mindspore-ai/hyper-parallel commit whose schema and start-up checks the YAML follows."""
VL_MODEL = "qwen3_vl_moe"
VISUAL_MODULE = "visual"
OVERFLOW_MODES = ("full", "min")
_HYPER_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _validate(plan: ExportPlan) -> None:
    """What hyper-parallel's trainer cannot run, in one line each."""
    validate_pp_tp_dp(plan, TRAINER)
    first = plan.regions[0]
    for region in plan.regions[1:]:
        if not region.is_sharded:
            raise MpipeError(f"hyper-parallel cannot express {plan.describe()}: region {region.index} is a transpose "
                             f"after the first region, and its Mpipe schedule transposes only the model's first "
                             f"layers; the closest plan it can express: the same schedule without it")
    transpose = not first.is_sharded
    skeletons = {r.skeleton for r in plan.sharded}
    if (transpose or plan.num_chunks > 1) and skeletons != {Skeleton.ONE_F_ONE_B}:
        raise MpipeError(f"hyper-parallel cannot express {plan.describe()}: its Mpipe and virtual-stage schedules are "
                         f"interleaved 1F1B; the closest plan it can express: the same cut with 1f1b for every "
                         f"Sharded region")
    validate_vision_first(plan, wavefront_stages(plan), TRAINER)
    if transpose:
        _mpipe_fields(plan, first)


def _trainer_yaml(plan: ExportPlan) -> str:
    """The trainer YAML (its ``model``/``data``/``train`` schema) with a header of comments, of a plan
    :func:`_validate` accepted."""
    first = plan.regions[0]
    transpose = not first.is_sharded
    split = [len(s.decoders) for s in wavefront_stages(plan)]
    accelerator: dict[str, Any] = {
        "pp": plan.pp, "pp_vpp": plan.num_chunks, "pp_micro_batch_num": plan.num_microbatches,
        "pp_schedule": "mpipe" if transpose else plan.sharded[0].skeleton.value, "pp_layer_split": split,
    }
    notes = []
    if transpose:
        accelerator.update(_mpipe_fields(plan, first))
        notes.append(f"# owner map (microbatch -> rank): {list(first.owners)}")
    accelerator.update({"tp": plan.tp, "dp_shard": plan.dp, "dp_replicate": 1})
    pipelined = plan.pp > 1
    mixed, precision_note = _mixed_precision(plan)
    train: dict[str, Any] = {
        "micro_batch_size": 1,
        "global_batch_size": plan.num_microbatches * plan.dp,
        "init_device": "meta",
        "accelerator": accelerator,
        "mixed_precision": mixed,
        "gradient_checkpointing": {"activation_checkpoint": "full" if plan.recompute else "off"},
    }
    if pipelined and plan.tp > 1:
        train["optimizer"] = {"max_grad_norm": 0.0}
        notes.append("# gradient clipping off: the trainer's PP path with tp > 1 needs max_grad_norm 0")
    if pipelined:
        train["checkpoint"] = {"save_hf_weights": False}
    if pipelined and plan.recompute:
        notes.append("# activation_checkpoint under PP starts only for a model whose pipeline splitter applies it "
                     "(ModelSpec.pp_applies_activation_checkpoint, default false); the plan's memory needs it, so "
                     "check your model's spec before launching")
    vision = plan.layers[:plan.num_vision_layers]
    tower_frozen = bool(vision) and not any(u.trainable for u in vision)
    model = {"name": VL_MODEL, "weights_path": None, "config_overrides": {"vl": True},
             "num_hidden_layers": sum(split), "freeze_modules": [VISUAL_MODULE] if tower_frozen else []}
    data = {"type": "vl_dummy", "max_seq_len": max(plan.text_tokens)}
    header = [
        f"# hyper-parallel trainer config for mpipe-tune {plan.describe()}",
        f"# (schema and start-up checks of mindspore-ai/hyper-parallel at {HYPER_PARALLEL_COMMIT}: later commits' "
        f"config class rejects the data and train sections, earlier ones ignore the pp_mpipe_* keys)",
        f"# launch on {plan.pp * plan.tp * plan.dp} devices; the data-parallel degree {plan.dp} is FSDP-sharded "
        f"(dp_shard), as in the torchtitan export",
        f"# fill in: model.name and model.weights_path (your VL model; '{VL_MODEL}' with random weights as written) "
        f"and the data section (synthetic vl_dummy samples as written)",
        *notes, *precision_note, *(f"# {n}" for n in plan.data_sharding_note("hyper-parallel")),
    ]
    others = [b for b in frozen_blocks(plan) if not (tower_frozen and any(u.block == b for u in vision))]
    if others:
        header.append(f"# also frozen in the plan: {', '.join(others)} (add their module names to "
                      f"model.freeze_modules; '{VISUAL_MODULE}' freezes the whole tower, its merger included)")
    document = {"model": model, "data": data, "train": train}
    return "\n".join(header) + "\n" + yaml.safe_dump(document, sort_keys=False, default_flow_style=None)


def _mixed_precision(plan: ExportPlan) -> tuple[dict[str, Any], list[str]]:
    """The ``mixed_precision`` section and the header lines that explain it."""
    if plan.dtype not in _HYPER_DTYPES:
        return {"enabled": False}, []
    if plan.pp > 1 and plan.dp < 2:
        return {"enabled": False}, [
            f"# float32 params: the trainer carries {_HYPER_DTYPES[plan.dtype]} under PP only on an FSDP data axis "
            f"(dp_shard >= 2), and this plan has dp {plan.dp}; its {plan.dtype} prediction does not hold for this "
            f"run (re-plan with dtype fp32, or at dp >= 2)"]
    return {"enabled": True, "param_dtype": _HYPER_DTYPES[plan.dtype]}, []


def mpipe_owners(mode: str, num_ranks: int, num_microbatches: int) -> tuple[int, ...]:
    """The owner map hyper-parallel's overflow ``mode`` gives (NT = min(P, M) transposing ranks).

    >>> mpipe_owners("full", 4, 6), mpipe_owners("min", 4, 6)
    ((0, 1, 2, 3, 0, 1), (0, 1, 2, 3, 0, 0))
    """
    nt = min(num_ranks, num_microbatches)
    if mode == "full":
        return tuple(m % nt for m in range(num_microbatches))
    assert mode == "min", mode
    return tuple(m if m < nt else 0 for m in range(num_microbatches))


def _mpipe_fields(plan: ExportPlan, region: ExportRegion) -> dict[str, Any]:
    """The transpose's arguments: ``visual`` when region 1 is the whole vision tower, else its layer count
    (counted in the model spec's layers; hyper-parallel counts the tower's layers, which agree when each
    spec layer is one tower block); the overflow mode whose owner map is the plan's; an owner-side
    backward when region 1 has a trainable layer (the plan runs ``Bwd(1, owner, m)`` on the owner)."""
    vision = plan.num_vision_layers
    stop = region.layers[1]
    if vision and stop > vision:
        raise MpipeError(f"hyper-parallel cannot express {plan.describe()}: it transposes at most the visual tower "
                         f"(layers 0..{vision - 1}), and region 1 ends at layer {stop}; the closest plan it can "
                         f"express: the same schedule with its cut at layer {vision}{stored_hint(plan, MPIPE_RR)}",
                         quantities=("stored plan",))
    mode = next((m for m in OVERFLOW_MODES if mpipe_owners(m, plan.pp, plan.num_microbatches) == region.owners), None)
    if mode is None:
        stored = (f"; or export the file's stored plan '{MPIPE_RR}' (<transpose,1f1b> with round-robin owners, at its "
                  f"own cut and degrees)" if MPIPE_RR in plan.names and plan.name != MPIPE_RR else "")
        raise MpipeError(f"hyper-parallel cannot express {plan.describe()}: its owner map {list(region.owners)} is "
                         f"neither of hyper-parallel's (overflow 'full': microbatch m on rank m mod "
                         f"{min(plan.pp, plan.num_microbatches)}; 'min': the first on their own ranks, the rest on "
                         f"rank 0); the closest plan it can express: the same schedule with round-robin owners "
                         f"(re-plan with owner policy round-robin){stored}", quantities=("owner policy",))
    trainable = any(u.trainable for u in plan.layers[region.layers[0]:stop])
    return {
        "pp_mpipe_transpose_layers": VISUAL_MODULE if stop == vision else stop,
        "pp_mpipe_transpose_overflow": mode,
        "pp_mpipe_owner_backward": trainable,
    }


class HyperParallel(ExportTarget):
    name = "hyper-parallel"
    trainer = TRAINER
    help = "hyper-parallel trainer YAML (Mpipe transpose schedule arguments)"
    client = (f"hyper-parallel's trainer start-up checks (hyper_parallel/trainer/base.py at {HYPER_PARALLEL_COMMIT}), "
              f"mirrored with citations in tests/report/test_export_hyper_parallel.py (it needs MindSpore or a GPU)")

    def validate(self, plan: ExportPlan) -> None:
        _validate(plan)

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        return (Output(paths[0], _trainer_yaml(plan)),)
