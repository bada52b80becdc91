"""The hyper-parallel export against the trainer's own start-up checks.

hyper-parallel's trainer imports torch_npu/mindspore-era packages that are not installable here
(``hyper_parallel`` is on no package index), so :func:`startup_errors` mirrors each check it runs on a
config before training, at mindspore-ai/hyper-parallel commit 51e4a86bcdd6b3c7f9bbc59a5e97fef7f5b39d3f
(the commit with MPipe); each check names the function it mirrors.
"""

import dataclasses
import re

import pytest
import yaml

from mpipe_tune.cli import main
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import all_plan_names, load_plan
from mpipe_tune.report.exports import read_export_plan
from mpipe_tune.report.exports._hyper_parallel import mpipe_owners
from export_writers import to_hyper_parallel
from test_export import NUM_DECODERS, VISION, export_plan, one_line_error

# hyper_parallel/trainer/config.py @51e4a86b: the dataclass fields of each section the export writes
# (ModelConfig, DataConfig, TrainConfig, AcceleratorConfig, MixedPrecisionConfig,
# GradientCheckpointingConfig, OptimizerConfig, CheckpointConfig); HyperTrainerConfig allows exactly the
# top-level keys model, data and train.
FIELDS = {
    "model": {"name", "weights_path", "tokenizer_path", "freeze_modules", "tp_plan", "cp_modules", "ep_modules",
              "vision_parallel", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "max_position_embeddings", "config_overrides"},
    "data": {"type", "load", "train_path", "subset", "max_seq_len", "text_key", "train_size", "template",
             "image_key", "messages_key", "image_token_id", "video_token_id", "vl_video", "vl_grid_t", "vl_grid_h",
             "vl_grid_w", "streaming", "num_workers", "prefetch_factor", "pin_memory", "shuffle"},
    "train": {"max_steps", "num_train_epochs", "global_batch_size", "micro_batch_size", "seed", "backend",
              "init_device", "comm_backend", "local_rank", "accelerator", "mixed_precision", "gradient_checkpointing",
              "optimizer", "checkpoint", "logging"},
    "train.accelerator": {"dp", "dp_replicate", "dp_shard", "tp", "cp", "pp", "pp_micro_batch_num", "pp_schedule",
                          "pp_vpp", "pp_less_memory", "pp_layer_split", "pp_mpipe_transpose_layers",
                          "pp_mpipe_owner_backward", "pp_mpipe_transpose_overflow", "ep", "etp", "zero_stage"},
    "train.mixed_precision": {"enabled", "param_dtype", "reduce_dtype", "output_dtype"},
    "train.gradient_checkpointing": {"activation_checkpoint", "num_layers", "visual_num_layers"},
    "train.optimizer": {"type", "lr", "max_grad_norm", "loss_aggregation", "weight_decay"},
    "train.checkpoint": {"output_dir", "save_steps", "save_hf_weights", "load_path", "save_async"},
}


def startup_errors(config: dict, header: str = "") -> list[str]:
    """The start-up checks hyper-parallel's trainer runs on ``config`` (a parsed YAML), mirrored; each
    failing one as the message naming the function it mirrors (``header``: the YAML's comments, which must
    state the one check that depends on the model)."""
    errors = []
    if set(config) - {"model", "data", "train"}:  # config.py, HyperTrainerConfig / the parser
        errors.append(f"unknown top-level keys {set(config) - {'model', 'data', 'train'}}")
    for section, fields in FIELDS.items():
        node = config
        for key in section.split("."):
            node = node.get(key, {})
        unknown = set(node) - fields
        if unknown:
            errors.append(f"config.py: {section} has no fields {sorted(unknown)}")
    train = config.get("train", {})
    acc = train.get("accelerator", {})
    pp, tp, cp, ep = acc.get("pp", 1), acc.get("tp", 1), acc.get("cp", 1), acc.get("ep", 1)
    dp_shard, dp_replicate = acc.get("dp_shard") or 1, acc.get("dp_replicate", 1)
    mp = train.get("mixed_precision", {})
    low_precision = mp.get("enabled", False) and mp.get("param_dtype", "bfloat16") not in ("float32", "fp32")
    # base.py, BaseTrainer._setup: mixed precision under PP lives on the per-stage FSDP wrap
    if low_precision and pp > 1 and (dp_shard == 1 or dp_replicate > 1) and cp == 1:
        errors.append("BaseTrainer._setup: low-precision param_dtype under PP needs dp_shard>=2 with dp_replicate=1")
    if pp > 1:
        # base.py, BaseTrainer._build_pipelined_model: PP+CP is not wired
        if cp > 1:
            errors.append("BaseTrainer._build_pipelined_model: cp > 1 with pp")
        # base.py, BaseTrainer._validate_pp_model_parallel_grad_clipping
        if float(train.get("optimizer", {}).get("max_grad_norm", 1.0)) > 0 and (tp > 1 or ep > 1):
            errors.append("BaseTrainer._validate_pp_model_parallel_grad_clipping: max_grad_norm must be 0 with tp/ep")
        # base.py, BaseTrainer._validate_pp_runtime_options
        if train.get("optimizer", {}).get("loss_aggregation", "token_weighted") not in ("token_weighted",
                                                                                        "rank_average"):
            errors.append("BaseTrainer._validate_pp_runtime_options: loss_aggregation")
        micro_num = acc.get("pp_micro_batch_num", 1)
        global_bs, micro_bs = train.get("global_batch_size", 8), train.get("micro_batch_size", 1)
        effective = max(global_bs // (micro_bs * dp_shard * dp_replicate), 1) * micro_bs
        if micro_num < 1 or effective % micro_num:
            errors.append(f"BaseTrainer._validate_pp_runtime_options: effective batch {effective} % {micro_num}")
        if train.get("checkpoint", {}).get("save_hf_weights", True):
            errors.append("BaseTrainer._validate_pp_runtime_options: save_hf_weights must be false under PP")
        # base.py, BaseTrainer._validate_pp_runtime_options: AC only where the model's spec applies it under PP
        # (models/spec/model_spec.py, pp_applies_activation_checkpoint, default False): the YAML must say so
        ac = train.get("gradient_checkpointing", {}).get("activation_checkpoint", "off")
        if ac not in ("off", "none", None, False, "") and "pp_applies_activation_checkpoint" not in header:
            errors.append("BaseTrainer._validate_pp_runtime_options: activation_checkpoint under PP, unstated")
        # base.py, BaseTrainer._build_pipelined_model: PP+FSDP wraps on the meta device
        if (dp_shard > 1 or dp_replicate > 1) and train.get("init_device", "meta") != "meta":
            errors.append("BaseTrainer._build_pipelined_model: PP+FSDP needs init_device meta")
        # config.py, AcceleratorConfig.pp_layer_split: one count per global stage, summing to the layers
        split = acc.get("pp_layer_split")
        if split is not None and (len(split) != pp * acc.get("pp_vpp", 1)
                                  or sum(split) != config.get("model", {}).get("num_hidden_layers")):
            errors.append("config.py: pp_layer_split is not one count per global stage summing to num_hidden_layers")
    # config.py, AcceleratorConfig.pp_schedule
    if acc.get("pp_schedule") not in (None, "gpipe", "1f1b", "mpipe", "mpipe_transpose"):
        errors.append(f"config.py: pp_schedule {acc.get('pp_schedule')!r}")
    return errors


def devices(text: str) -> int:
    return int(re.search(r"# launch on (\d+) devices", text).group(1))


def test_the_transpose_arguments_and_the_owner_map():
    plan = export_plan("transpose,1f1b", (VISION,), 4, 6)
    config = yaml.safe_load(to_hyper_parallel(plan))
    acc = config["train"]["accelerator"]
    assert (acc["pp"], acc["pp_vpp"], acc["pp_micro_batch_num"], acc["pp_schedule"]) == (4, 1, 6, "mpipe")
    assert acc["pp_mpipe_transpose_layers"] == "visual" and acc["pp_mpipe_owner_backward"] is True
    assert mpipe_owners(acc["pp_mpipe_transpose_overflow"], 4, 6) == plan.regions[0].owners == (0, 1, 2, 3, 0, 1)
    assert sum(acc["pp_layer_split"]) == NUM_DECODERS == config["model"]["num_hidden_layers"]
    assert len(acc["pp_layer_split"]) == 4 and config["model"]["freeze_modules"] == []

    frozen = yaml.safe_load(to_hyper_parallel(export_plan("transpose,1f1b", (VISION,), 4, 6,
                                                          frozen=("encoder", "projector"))))
    assert frozen["train"]["accelerator"]["pp_mpipe_owner_backward"] is False  # no encoder backward at all
    assert frozen["model"]["freeze_modules"] == ["visual"]
    text = to_hyper_parallel(export_plan("transpose,1f1b", (VISION,), 4, 6, frozen=("encoder",)))
    assert yaml.safe_load(text)["train"]["accelerator"]["pp_mpipe_owner_backward"] is True  # the projector trains
    assert yaml.safe_load(text)["model"]["freeze_modules"] == [] and "also frozen in the plan: encoder" in text


def test_min_overflow_and_an_owner_map_it_cannot_express():
    plan = export_plan("transpose,1f1b", (VISION,), 2, 5, owners=(0, 1, 0, 0, 0))
    assert yaml.safe_load(to_hyper_parallel(plan))["train"]["accelerator"]["pp_mpipe_transpose_overflow"] == "min"
    odd = export_plan("transpose,1f1b", (VISION,), 2, 4, owners=(1, 1, 0, 0))
    assert "round-robin" in one_line_error(lambda: to_hyper_parallel(odd))


def test_the_mirror_rejects_what_the_trainer_rejects():
    """Each mirrored check fires on the config the earlier export wrote (bf16 at dp_shard 1, HF weight saving
    and clipping left at their defaults under PP with tp 2), so a pass below means something."""
    old = {"train": {"accelerator": {"pp": 2, "tp": 2, "dp_replicate": 2, "dp_shard": 1, "pp_micro_batch_num": 4},
                     "global_batch_size": 8, "mixed_precision": {"enabled": True, "param_dtype": "bfloat16"}}}
    found = " ".join(startup_errors(old))
    assert all(name in found for name in ("_setup", "grad_clipping", "save_hf_weights"))
    old["train"]["gradient_checkpointing"] = {"activation_checkpoint": "full"}
    assert "activation_checkpoint under PP" in " ".join(startup_errors(old))


@pytest.mark.parametrize("pp,tp,dp,dtype,recompute", [(2, 1, 2, "bf16", False), (4, 2, 1, "bf16", False),
                                                      (2, 2, 2, "bf16", True), (2, 1, 1, "fp32", True)])
def test_every_degree_mix_passes_the_start_up_checks(pp, tp, dp, dtype, recompute):
    plan = export_plan("transpose,1f1b", (VISION,), pp, 2 * pp, tp=tp, dp=dp, recompute=recompute)
    plan = dataclasses.replace(plan, dtype=dtype)
    text = to_hyper_parallel(plan)
    config = yaml.safe_load(text)
    assert startup_errors(config, text) == []
    acc = config["train"]["accelerator"]
    assert (acc["dp_shard"], acc["dp_replicate"]) == (dp, 1)  # FSDP-sharded, as the torchtitan export
    assert devices(text) == acc["pp"] * acc["tp"] * acc["dp_shard"] * acc["dp_replicate"]
    assert config["model"]["config_overrides"] == {"vl": True} and config["data"]["type"] == "vl_dummy"
    if dp == 1 and dtype == "bf16":  # bf16 cannot be carried under PP at dp_shard 1: float32 params, said so
        assert config["train"]["mixed_precision"] == {"enabled": False} and "# float32 params" in text
    elif dtype == "bf16":
        assert config["train"]["mixed_precision"] == {"enabled": True, "param_dtype": "bfloat16"}


def test_the_built_in_examples_plans_pass_the_start_up_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default study store is the working folder's
    out = tmp_path / "plan.json"
    assert main(["plan", "--devices", "4", "--trials", "30", "--no-progress", "--out", str(out)]) == 0
    written = 0
    for name in all_plan_names(load_plan(out)):
        plan = read_export_plan(out, name)
        try:
            text = to_hyper_parallel(plan)
        except MpipeError as error:  # a plan it cannot express: one line naming the closest one
            assert "\n" not in str(error) and "closest plan" in str(error)
            continue
        assert startup_errors(yaml.safe_load(text), text) == [], name
        written += 1
    assert written >= 3  # megatron, vpp, mpipe-rr at least


def test_an_owner_map_it_cannot_express_names_the_stored_round_robin_plan_as_what_it_is():
    """The file's stored 'mpipe-rr' is <transpose,1f1b> at its own cut and degrees, not the refused plan's
    schedule with other owners: the error offers it as such, after re-planning with round-robin owners."""
    odd = export_plan("transpose,1f1b", (VISION,), 2, 4, owners=(1, 1, 0, 0))
    stored = dataclasses.replace(odd, name="best", names=("best", "megatron", "mpipe-rr"))
    line = one_line_error(lambda: to_hyper_parallel(stored))
    assert "re-plan with owner policy round-robin" in line
    assert "or export the file's stored plan 'mpipe-rr' (<transpose,1f1b> with round-robin owners, at its own cut" in line
    assert "stored plan 'mpipe-rr'" not in one_line_error(lambda: to_hyper_parallel(odd))
