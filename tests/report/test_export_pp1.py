"""pp = 1 plans in the exports: the layouts without a pipeline that Megatron-LM, MindSpeed-MM and torchtitan run
for small models, checked as the other export tests check each trainer.

Sources mirrored (no client installs here):
- Megatron-LM d98e8a6 ``megatron/training/arguments.py``: ``--pipeline-model-parallel-layout`` is optional (None
  by default; at pp 1 the one stage holds the embedding, every layer and the loss), the number of microbatches is
  ``global_batch_size / (micro_batch_size x data_parallel_size)`` (gradient accumulation at pp 1), and
  ``--use-torch-fsdp2`` with pp 1 (lines 1031-1049, as in test_export_zero3.py).
- MindSpeed-MM 57069cd5 ``mindspeed_mm/models/vlm_model.py`` lines 159-163 / 318-321: ``pipeline_num_layers`` has
  pp entries summing to the module's layers (test_export_mindspeed.layout_errors).
- torchtitan v0.2.2 ``torchtitan/config/job_config.py`` (``Parallelism``, ``Training``) and ``train.py``'s gradient
  accumulation: ``global_batch_size // (local_batch_size x dp degree)`` steps; at pp 1 it builds no pipeline and
  reads no schedule field; its DDP (``data_parallel_replicate_degree`` alone) takes a one-dimensional mesh
  (``torchtitan/models/llama3/infra/parallelize.py``: "DDP has not supported > 1D parallelism").
"""

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from mpipe_tune.cli import main
from mpipe_tune.plan_file import dump_plan
from export_writers import mindspeed_arguments, mindspeed_layout, to_megatron, to_torchtitan, to_torchtitan_args
from test_export import NUM_DECODERS, export_plan, make_record, megatron_args
from test_export_mindspeed import launch_values, layout_errors

M = 4
PIPELINE_FIELDS = {"pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                   "module_fqns_per_model_part"}


def unpipelined(zero_stage, tp=2, dp=2):
    return export_plan("1f1b", (), 1, M, tp=tp, dp=dp, zero_stage=zero_stage)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_megatron_runs_a_pp_1_plan_as_gradient_accumulation_on_one_stage(zero):
    args = megatron_args(to_megatron(unpipelined(zero)))
    assert args["--pipeline-model-parallel-size"] == "1" and args["--tensor-model-parallel-size"] == "2"
    assert "--pipeline-model-parallel-layout" not in args  # the one stage: Megatron's default
    assert args["--num-layers"] == str(NUM_DECODERS)
    assert int(args["--global-batch-size"]) // (int(args["--micro-batch-size"]) * 2) == M  # microbatches per step
    assert ("--use-distributed-optimizer" in args) == (zero == 1)
    assert ("--use-torch-fsdp2" in args) == (zero == 3)


@pytest.mark.parametrize("zero", [1, 3])
def test_mindspeed_lays_a_pp_1_plan_out_as_one_stage(zero):
    plan = unpipelined(zero)
    config = mindspeed_layout(plan)
    args = launch_values(mindspeed_arguments(plan, "model.json"))
    assert args["--pipeline-model-parallel-size"] == "1" and "--virtual-pipeline-model-parallel-size" not in args
    assert layout_errors(config, 1, None) == []
    assert config["text_decoder"]["pipeline_num_layers"] == [NUM_DECODERS]
    assert args["--global-batch-size"] == str(M * 2) and args["--micro-batch-size"] == "1"
    assert ("--use-torch-fsdp2" in args) == (zero == 3) and ("--use-distributed-optimizer" in args) == (zero == 1)


def test_torchtitan_writes_its_fsdp_only_job_at_pp_1():
    config = tomllib.loads(to_torchtitan(unpipelined(3), "x.csv"))
    par, training = config["parallelism"], config["training"]
    assert par["pipeline_parallel_degree"] == 1 and PIPELINE_FIELDS.isdisjoint(par)
    assert (par["tensor_parallel_degree"], par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (
        2, 2, 1)
    assert par["fsdp_reshard_after_forward"] == "always"
    assert training["local_batch_size"] == 1  # one sequence per microbatch, as predicted ...
    assert training["global_batch_size"] // (training["local_batch_size"] * 2) == M  # ... accumulated M times


def test_torchtitan_replicates_a_zero_0_plan_whose_only_axis_is_data_and_shards_the_others():
    ddp = tomllib.loads(to_torchtitan(unpipelined(0, tp=1, dp=4), "x.csv"))
    assert (ddp["parallelism"]["data_parallel_shard_degree"], ddp["parallelism"]["data_parallel_replicate_degree"]) == (
        1, 4)
    assert "re-plan with --zero 3" not in to_torchtitan(unpipelined(0, tp=1, dp=4), "x.csv")
    for plan in (unpipelined(0), unpipelined(1, tp=1, dp=4)):  # a 2-D mesh; ZeRO-1, which torchtitan has not
        text = to_torchtitan(plan, "x.csv")
        assert tomllib.loads(text)["parallelism"]["data_parallel_shard_degree"] == plan.dp
        assert "re-plan with --zero 3" in text


def test_torchtitan_0_3_arguments_name_no_pipeline_at_pp_1():
    args = to_torchtitan_args(unpipelined(3), "x.csv").splitlines()
    assert "--parallelism.pipeline_parallel_degree 1" in args and "--training.local_batch_size 1" in args
    assert not any(a.split()[0].split(".")[-1] in PIPELINE_FIELDS for a in args if a.startswith("--"))
    assert "--training.disable_cuda_graphs" not in args


@pytest.mark.parametrize("target,out", [("torchtitan", "job.toml"), ("torchtitan-0.3", "job.args")])
def test_the_cli_writes_the_job_alone_at_pp_1(tmp_path, capsys, target, out):
    record, _ = make_record("1f1b", (), 1, M, tp=2, dp=2, zero_stage=3)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", target, "--out", str(tmp_path / out)]) == 0
    assert (tmp_path / out).exists() and not (tmp_path / "job.csv").exists()
    assert "job.csv" not in (tmp_path / out).read_text()
