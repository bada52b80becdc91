"""ZeRO stage 3 in every export: the trainers that shard the data axis (torchtitan's and hyper-parallel's
FSDP) carry a stage-3 plan as it is and say so in one header line for a plan predicted at a lower
stage; Megatron-LM and MindSpeed-MM take their torch-FSDP2 flags where their argument checks allow
them and refuse the rest in one line naming stage 1.

Sources mirrored (no client installs here, so each check cites the field or assertion it follows):
- torchtitan v0.2.2 (73a0e69) ``torchtitan/config/job_config.py`` line 336: ``Parallelism.fsdp_reshard_after_forward:
  Literal["default", "always", "never"]``; ``"default"`` is ``not pp_enabled``
  (``torchtitan/models/llama3/infra/parallelize.py`` lines 319-327), so a PP plan needs ``"always"``;
  torchtitan 0.3.0 ``torchtitan/config/configs.py`` line 136, the same field of ``ParallelismConfig``
  (``--parallelism.fsdp_reshard_after_forward``; ``torchtitan/distributed/fsdp.py`` lines 71-74).
- Megatron-LM d98e8a6 ``megatron/training/arguments.py`` lines 1031-1049 (``--use-torch-fsdp2``: no PP, no
  EP, no distributed optimizer, no gradient-accumulation fusion, a torch_dist/torch_dcp checkpoint, untied
  embeddings, no fp16, CUDA_DEVICE_MAX_CONNECTIONS not 1).
- MindSpeed-MM 57069cd5 ``UserGuide/features/fsdp2.rst`` lines 57-62 (the launch flags),
  ``mindspeed_mm/models/transformers/base_model.py`` lines 219-232 and 276-283 (``Fsdp2Config`` and its
  YAML loader), README.md line 206 (Megatron core 0.12.1, whose _arguments.py lines 510-528 assert as d98e8a6).
"""

import dataclasses

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
import yaml

from mpipe_tune.cli import main
from mpipe_tune.plan_file import dump_plan
from mpipe_tune.report.exports._megatron import MEGATRON_FSDP_FLAGS
from export_writers import mindspeed_arguments, to_hyper_parallel, to_megatron, to_torchtitan, to_torchtitan_args
from test_export import export_plan, make_record, megatron_args, one_line_error
from test_export_mindspeed import launch_values

TITAN_RESHARD_POLICIES = ("default", "always", "never")  # job_config.py:336 (v0.2.2), configs.py:136 (0.3.0)
FSDP2_CONFIG_FIELDS = {"sharding_size", "sub_modules_to_wrap", "reshard_after_forward", "param_dtype", "reduce_dtype",
                       "output_dtype", "cast_forward_inputs", "offload_to_cpu", "pin_memory"}  # base_model.py:219-232
NOTE = "re-plan with --zero 3 for a matching prediction"


def plan_at(zero_stage, pp=2, dp=2, **kwargs):
    return export_plan("1f1b", (), pp, 4, tp=2, dp=dp, zero_stage=zero_stage, **kwargs)


def test_a_stage_3_plan_is_predicted_and_exported_at_stage_3():
    assert plan_at(3).zero_stage == 3 and plan_at(1).zero_stage == 1


def test_torchtitan_reshards_after_forward_at_stage_3_and_notes_a_lower_stage():
    config = tomllib.loads(to_torchtitan(plan_at(3), "x.csv"))["parallelism"]
    assert config["fsdp_reshard_after_forward"] == "always" and config["fsdp_reshard_after_forward"] in TITAN_RESHARD_POLICIES
    assert config["data_parallel_shard_degree"] == 2 and config["data_parallel_replicate_degree"] == 1
    stage1 = to_torchtitan(plan_at(1), "x.csv")
    assert "fsdp_reshard_after_forward" not in tomllib.loads(stage1)["parallelism"]
    notes = [line for line in stage1.splitlines() if NOTE in line]
    assert len(notes) == 1 and notes[0].startswith("#") and "ZeRO-1" in notes[0]
    assert NOTE not in to_torchtitan(plan_at(3), "x.csv")
    assert NOTE not in to_torchtitan(plan_at(1, dp=1), "x.csv")  # no data axis to shard


def test_torchtitan_0_3_arguments_carry_the_same_setting():
    args = to_torchtitan_args(plan_at(3), "x.csv").splitlines()
    assert "--parallelism.fsdp_reshard_after_forward always" in args
    stage1 = to_torchtitan_args(plan_at(1), "x.csv")
    assert "fsdp_reshard_after_forward" not in stage1 and sum(NOTE in line for line in stage1.splitlines()) == 1


def test_hyper_parallel_shards_the_data_axis_and_notes_a_lower_stage():
    exact, lower = to_hyper_parallel(plan_at(3)), to_hyper_parallel(plan_at(1))
    for text in (exact, lower):
        assert yaml.safe_load(text)["train"]["accelerator"]["dp_shard"] == 2
    assert NOTE not in exact and sum(NOTE in line for line in lower.splitlines()) == 1


def test_megatron_takes_torch_fsdp2_without_pipeline_or_expert_parallelism_as_validate_args_asserts():
    text = to_megatron(plan_at(3, pp=1))
    args = megatron_args(text)
    assert all(args.get(flag.split()[0]) == (flag.split()[1] if " " in flag else True) for flag in MEGATRON_FSDP_FLAGS)
    assert args["--use-torch-fsdp2"] is True and args["--pipeline-model-parallel-size"] == "1"
    assert "--use-distributed-optimizer" not in args  # _arguments.py:1038
    assert args["--ckpt-format"] in ("torch_dist", "torch_dcp") and "--fp16" not in args  # 1042, 1046
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" not in text  # 1048: tp 2 warns instead (1456)
    assert megatron_args(to_megatron(plan_at(1)))["--use-distributed-optimizer"] is True


def test_megatron_refuses_stage_3_with_pipeline_parallelism_naming_stage_1():
    message = one_line_error(lambda: to_megatron(plan_at(3)))
    assert "pipeline parallelism" in message and "ZeRO stage 1" in message
    fp16 = dataclasses.replace(plan_at(3, pp=1), dtype="fp16")
    assert "fp16" in one_line_error(lambda: to_megatron(fp16))


def test_mindspeed_writes_its_fsdp2_flags_and_config_at_pp_1(tmp_path):
    record, _ = make_record("1f1b", (), 1, 4, tp=2, dp=2, zero_stage=3)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "mindspeed-mm", "--out", str(tmp_path / "m.json")]) == 0
    flags = launch_values((tmp_path / "m.sh").read_text())
    assert flags["--use-torch-fsdp2"] == "" and flags["--fsdp2-config-path"] == "m.fsdp2.yaml"
    assert flags["--ckpt-format"] == "torch_dcp" and "--untie-embeddings-and-output-weights" in flags
    assert "--no-gradient-accumulation-fusion" in flags and "--use-distributed-optimizer" not in flags
    config = yaml.safe_load((tmp_path / "m.fsdp2.yaml").read_text())  # as Fsdp2Config.load_from_yaml reads it
    assert set(config) <= FSDP2_CONFIG_FIELDS
    assert config == {"sharding_size": "auto", "reshard_after_forward": True}


def test_the_reshard_policy_and_stage_2_in_each_trainers_terms(tmp_path):
    # torchtitan: the plan's policy stated whatever the pipeline degree ("default" would follow pp)
    for zero, policy, word in ((3, True, "always"), (3, False, "never"), (2, True, "never")):
        text = to_torchtitan(plan_at(zero, reshard_after_forward=policy), "x.csv")
        assert tomllib.loads(text)["parallelism"]["fsdp_reshard_after_forward"] == word
        assert ("re-plan with --zero 3-keep" in text) == (zero == 2)  # torchtitan has no ZeRO-2
    # MindSpeed-MM at pp 1: Fsdp2Config's reshard_after_forward is the plan's
    record, _ = make_record("1f1b", (), 1, 4, tp=2, dp=2, zero_stage=3, reshard_after_forward=False)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "mindspeed-mm", "--out", str(tmp_path / "m.json")]) == 0
    assert yaml.safe_load((tmp_path / "m.fsdp2.yaml").read_text()) == {"sharding_size": "auto",
                                                                        "reshard_after_forward": False}
    # Megatron-LM and MindSpeed-MM: stage 2 as the distributed optimizer, said in one header line
    text = to_megatron(plan_at(2))
    assert megatron_args(text)["--use-distributed-optimizer"] is True and "--use-torch-fsdp2" not in text
    assert sum("ZeRO-2 as planned" in line for line in text.splitlines()) == 1
    mindspeed = mindspeed_arguments(plan_at(2), "m.json")
    assert "--use-distributed-optimizer" in launch_values(mindspeed) and "ZeRO-2 as planned" in mindspeed


def test_mindspeed_refuses_stage_3_under_pipeline_parallelism_and_writes_nothing(tmp_path, capsys):
    record, _ = make_record("1f1b", (), 2, 4, tp=2, dp=2, zero_stage=3)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "mindspeed-mm", "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pipeline parallelism" in err and "ZeRO stage 1" in err
    assert not list(tmp_path.glob("m.*"))
    stage1 = launch_values(mindspeed_arguments(plan_at(1), "m.json"))
    assert "--use-distributed-optimizer" in stage1 and "--use-torch-fsdp2" not in stage1
