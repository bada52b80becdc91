"""Exports to torch pipelining CSV, torchtitan, Megatron-LM and hyper-parallel, read back by their own parsers
where one exists here (torch's CSV loader, tomllib, shlex, PyYAML)."""

import json
import shlex
import subprocess
import sys
from pathlib import Path
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
import yaml

from mpipe_tune.algebra import Degrees, Fwd, Cut, parse_schedule
from mpipe_tune.cli import main
from mpipe_tune.cost import CostOptions
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.report.exports._plan import plan_from_record, read_export_plan
from export_writers import to_hyper_parallel, to_megatron, to_torch_csv, to_torchtitan
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record, plan_section, select_plan
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model
from conftest import predict_plan

MODEL = "example-mllm"  # explicit costs: 8 ViT layers, a projector, 16 decoder layers
VISION = 9
NUM_DECODERS = 16


def workload(num_microbatches):
    return Workload(tuple(Microbatch(64 * (m % 3), 100 + m) for m in range(num_microbatches)), "export-test")


def predicted(schedule, cut, pp, num_microbatches, *, frozen=(), owners=None, slabs=None, tp=1, dp=1, recompute=False,
              model_name=MODEL, sequence_parallel=False, zero_stage=1, reshard_after_forward=True, **degrees):
    """(prediction, model, workload, profile, options) of one candidate of the example model (or
    ``model_name``); ``degrees``: more of its degrees (``ep``, ``cp``, ``encoder_tp``)."""
    model = load_model(model_name)
    if frozen:
        model = model.with_frozen(frozen)
    hw, wl = load_profile("ideal"), workload(num_microbatches)
    options = CostOptions(dtype="bf16", recompute=recompute, sequence_parallel=sequence_parallel,
                          degrees=Degrees(1, tp=tp, dp=dp, **degrees), shard_optimizer=zero_stage >= 1,
                          shard_gradients=zero_stage == 2, shard_parameters=zero_stage >= 3,
                          reshard_after_forward=reshard_after_forward)
    prediction = predict_plan(Cut(cut), parse_schedule(schedule), model, wl, hw, pp, microbatch_owners=owners,
                         slab_counts=slabs, options=options)
    return prediction, model, wl, hw, options


def make_record(schedule, cut, pp, num_microbatches, *, baselines=(), frozen=(), **kwargs):
    """A plan file's record (as ``plan_record`` writes it), with ``baselines``: name -> (schedule, cut)."""
    prediction, model, wl, hw, options = predicted(schedule, cut, pp, num_microbatches, frozen=frozen, **kwargs)
    sections = {name: plan_section(*predicted(s, c, pp, num_microbatches, frozen=frozen, **kwargs)[:3:2])
                for name, (s, c) in dict(baselines).items()}
    return plan_record(prediction, model, wl, hw, PlanInputs(kwargs.get("model_name", MODEL), frozen, "ideal"),
                       baselines=sections), model


def export_plan(schedule, cut, pp, num_microbatches, *, frozen=(), **kwargs):
    record, model = make_record(schedule, cut, pp, num_microbatches, frozen=frozen, **kwargs)
    return plan_from_record(record, model)


def load_with_torch(path, num_ranks, num_stages, num_microbatches):
    """torch's own loader: ``_PipelineScheduleRuntime._load_csv`` validates the actions, infers the stage to
    rank map and lowers them with send/recv (which fails on an order it cannot pair up). No process group
    is needed for that, so the runtime object is made without its constructor and given the fields the
    loader reads."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    runtime = object.__new__(schedules._PipelineScheduleRuntime)
    runtime.pipeline_order = {}
    runtime.pp_group_size = num_ranks
    runtime._num_stages = num_stages
    runtime._n_microbatches = num_microbatches
    runtime._stages = []
    runtime._defer_pp_recv = False
    runtime._load_csv(str(path))
    return schedules, runtime


CASES = [  # (schedule, cut, P, M): 1f1b, gpipe, interleaved v = 2 and 3, M a multiple of P and not
    ("1f1b", (), 4, 8),
    ("1f1b", (), 4, 3),
    ("gpipe", (), 4, 6),
    ("1f1b,1f1b", (17,), 4, 8),
    ("1f1b,1f1b", (17,), 4, 6),
    ("1f1b,1f1b,1f1b", (13, 19), 4, 8),
    ("1f1b,1f1b,1f1b", (13, 19), 4, 10),
    ("zb1p", (), 4, 8),
    ("zb1p", (), 4, 3),
    ("zbv,zbv", (17,), 4, 8),
    ("zbv,zbv", (17,), 2, 5),
]


@pytest.mark.parametrize("schedule,cut,pp,num_microbatches", CASES)
def test_torch_loads_the_csv_with_derives_compute_actions_rank_by_rank(tmp_path, schedule, cut, pp, num_microbatches):
    prediction, model, wl, hw, options = predicted(schedule, cut, pp, num_microbatches)
    record = plan_record(prediction, model, wl, hw, PlanInputs(MODEL, (), "ideal"))
    path = tmp_path / "schedule.csv"
    path.write_text(to_torch_csv(plan_from_record(record, model)))
    v = len(cut) + 1
    schedules, runtime = load_with_torch(path, pp, pp * v, num_microbatches)

    plan = prediction.plan
    split = schedule.startswith("zb")
    stage_rank = {s: (s % pp if s < pp or not schedule.startswith("zbv") else 2 * pp - 1 - s) for s in range(pp * v)}
    for rank in range(pp):
        def stage(e):
            return next(s for s, r in stage_rank.items() if r == rank and (s // pp) == e.region - 1)
        ops = {"Fwd": "F", "Bwd": "I" if split else "B", "Wgrad": "W"}
        expected = [(stage(e), ops[type(e).__name__], e.mb)
                    for e in plan.nodes(rank) if type(e).__name__ in ops]
        loaded = [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in runtime.pipeline_order[rank]]
        assert loaded == expected, f"rank {rank}"
    assert runtime.stage_index_to_group_rank == stage_rank
    # torch's lowering paired every send with a receive; its dry run finds no deadlock
    kinds = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
    compute_and_comms = {r: [a for a in actions if a.computation_type.value in kinds]
                         for r, actions in runtime.pipeline_order_with_comms.items()}
    schedules._simulate_comms_compute(compute_and_comms, lambda s: runtime.stage_index_to_group_rank[s], pp * v)


def test_a_stage_without_backward_is_refused_as_torch_needs_one_per_forward():
    plan = export_plan("1f1b", (), 2, 3, frozen=("encoder", "projector"), slabs=((VISION, NUM_DECODERS),))
    assert "stage 0 runs no backward" in one_line_error(lambda: to_torch_csv(plan))


def one_line_error(call):
    with pytest.raises(MpipeError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_transpose_is_refused_in_one_line_naming_the_encoder_in_first_stage_plan():
    record, model = make_record("transpose,1f1b", (VISION,), 4, 8, baselines={"megatron": ("1f1b", ())})
    plan = plan_from_record(record, model, names=("best", "megatron"))
    for writer in (to_torch_csv, to_megatron, lambda p: to_torchtitan(p, "x.csv")):
        message = one_line_error(lambda: writer(plan))
        assert "region 1 is a transpose" in message and "stored plan 'megatron'" in message
    alone = plan_from_record(record, model)  # a file without the megatron baseline: say how to make it
    assert "<1f1b> with no cut" in one_line_error(lambda: to_torch_csv(alone))


@pytest.mark.parametrize("schedule,cut", [("zb1p", ()), ("zbv,zbv", (17,))])
def test_zero_bubble_plans_are_refused_in_one_line_by_the_formats_without_split_backwards(schedule, cut):
    record, model = make_record(schedule, cut, 4, 8, baselines={"megatron": ("1f1b", ())})
    plan = plan_from_record(record, model, names=("best", "megatron"))
    message = one_line_error(lambda: to_megatron(plan))
    assert "split input/weight backwards" in message and "stored plan 'megatron'" in message and "torch-csv" in message
    assert "zero-bubble" in one_line_error(lambda: to_hyper_parallel(plan))


def test_cli_refuses_a_transpose_with_exit_2_and_writes_nothing(tmp_path, capsys):
    record, _ = make_record("transpose,1f1b", (VISION,), 2, 4, baselines={"megatron": ("1f1b", ())})
    dump_plan(record, tmp_path / "plan.json")
    out = tmp_path / "schedule.csv"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torch-csv", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stored plan (--plan) 'megatron'" in err and not out.exists()
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torch-csv", "--plan", "megatron"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and rows[0].startswith("0F0,")


def test_cli_checks_the_out_folder_and_the_plan_name(tmp_path, capsys):
    record, _ = make_record("1f1b", (), 2, 4)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "megatron", "--out", str(tmp_path / "no" / "a.txt")]) == 2
    assert "folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "plan.json"), "--to", "megatron", "--plan", "vpp"]) == 2
    assert "holds no plan named 'vpp'" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("schedule,cut", [("1f1b", ()), ("1f1b,1f1b,1f1b", (13, 19))])
def test_torchtitan_toml_parses_with_the_plans_degrees_and_its_csv_beside_it(tmp_path, capsys, schedule, cut):
    record, _ = make_record(schedule, cut, 2, 4, tp=2, dp=2)
    dump_plan(record, tmp_path / "plan.json")
    out = tmp_path / "job.toml"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--out", str(out)]) == 0
    config = tomllib.loads(out.read_text())
    par, training = config["parallelism"], config["training"]
    v = len(cut) + 1
    assert (par["pipeline_parallel_degree"], par["tensor_parallel_degree"], par["data_parallel_shard_degree"]) == (2, 2, 2)
    assert par["pipeline_parallel_schedule"] == ("PipelineScheduleSingle" if v == 1 else "PipelineScheduleMulti")
    assert par["pipeline_parallel_microbatch_size"] == 1 and training["local_batch_size"] == 4
    assert training["global_batch_size"] == 8
    csv_path = tmp_path / "job.csv"
    assert par["pipeline_parallel_schedule_csv"] == str(csv_path)
    assert csv_path.read_text() == to_torch_csv(read_export_plan(tmp_path / "plan.json"))
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == 2 * v
    assert parts[0][:3] == ["encoder", "projector", "tok_embeddings"] and parts[-1][-2:] == ["norm", "output"]
    assert [m for part in parts for m in part if m.startswith("layers.")] == [f"layers.{k}" for k in range(NUM_DECODERS)]


def megatron_args(text):
    tokens = shlex.split("\n".join(line for line in text.splitlines() if not line.startswith("#")))
    args, i = {}, 0
    while i < len(tokens):
        value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else True
        args[tokens[i]] = value
        i += 1 if value is True else 2
    return args


def test_megatron_args_carry_sizes_layout_batch_and_recomputation():
    plan = export_plan("1f1b,1f1b", (17,), 4, 8, tp=2, dp=3, recompute=True)
    args = megatron_args(to_megatron(plan))
    assert args["--pipeline-model-parallel-size"] == "4" and args["--tensor-model-parallel-size"] == "2"
    assert args["--micro-batch-size"] == "1" and args["--global-batch-size"] == str(8 * 3)
    assert args["--num-layers"] == str(NUM_DECODERS)
    stages = args["--pipeline-model-parallel-layout"].split("|")
    assert len(stages) == 4 * 2 and stages[0].startswith("E") and stages[-1].endswith("L")
    assert args["--recompute-granularity"] == "full" and args["--recompute-method"] == "uniform"
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in args  # M a multiple of P: Megatron's default
    assert args["--bf16"] is True and "--freeze-ViT" not in args


def test_megatron_notes_frozen_modules_and_interleaving_rounds():
    plan = export_plan("1f1b,1f1b", (17,), 4, 6, frozen=("encoder",))
    args = megatron_args(to_megatron(plan))
    assert args["--freeze-ViT"] is True and "--freeze-LM" not in args
    assert args["--microbatch-group-size-per-virtual-pipeline-stage"] == "6"  # one round of 6
    assert "--recompute-granularity" not in args


def test_megatron_refuses_gpipe_and_an_encoder_beyond_the_first_stage():
    assert "no GPipe schedule" in one_line_error(lambda: to_megatron(export_plan("gpipe", (), 2, 4)))
    spread = export_plan("1f1b", (), 4, 4, slabs=((5, 7, 7, 6),))  # the 9 vision layers in stages 0 and 1
    assert "inside the first pipeline stage" in one_line_error(lambda: to_megatron(spread))


def test_a_baseline_section_exports_with_its_own_microbatches(tmp_path):
    record, model = make_record("transpose,1f1b", (VISION,), 2, 4, baselines={"vpp": ("1f1b,1f1b", (17,))})
    dump_plan(record, tmp_path / "plan.json")
    plan = read_export_plan(tmp_path / "plan.json", "vpp")
    assert plan == plan_from_record(select_plan(record, "vpp"), model, name="vpp", names=("best", "vpp"))
    assert plan.schedule == "1f1b,1f1b" and plan.num_chunks == 2


def test_cli_names_every_format_and_refuses_an_unknown_one(tmp_path, capsys):
    from mpipe_tune.report.exports import TARGETS as FORMATS

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    assert all(name in help_text for name in FORMATS)
    record, _ = make_record("1f1b", (), 2, 4)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed"]) == 2
    assert f"use one of {', '.join(FORMATS)}" in capsys.readouterr().err


def test_the_export_module_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import mpipe_tune.report.exports, mpipe_tune.cli._export"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


TINY_MOE = str(Path(__file__).parents[1] / "runtime" / "tiny-mla-moe.yaml")  # 3 dense then 2 MoE decoder layers


def five_d_plan(**kwargs):
    """pp 2 x tp 2 x cp 2 x dp 2 with ep 2 (carved from dp x cp), sequence parallelism and selective
    recomputation, of a MoE backbone."""
    return export_plan("1f1b", (), 2, 4, tp=2, dp=2, recompute="selective", model_name=TINY_MOE, ep=2,
                       cp=2, sequence_parallel=True, **kwargs)


def test_megatron_args_carry_expert_context_and_sequence_parallelism_as_validate_args_needs_them():
    """What Megatron-LM's validate_args asserts (megatron/training/arguments.py at d98e8a6): num_experts a
    multiple of expert-model-parallel-size (lines 1655-1658), seq-length a multiple of 2 x
    context-parallel-size (1335-1338), no recompute method with selective granularity (1425-1428),
    sequence parallelism kept only with tp > 1 (1432-1439); the data-parallel size is world / (tp x pp x
    cp) (439-446). CUDA_DEVICE_MAX_CONNECTIONS=1 with tp or cp > 1 before Blackwell (1453;
    megatron/core/tensor_parallel/layers.py 842-849, 909-921)."""
    plan = five_d_plan()
    text = to_megatron(plan)
    args = megatron_args(text)
    assert args["--expert-model-parallel-size"] == "2" and args["--context-parallel-size"] == "2"
    assert args["--sequence-parallel"] is True and args["--tensor-model-parallel-size"] == "2"
    assert int(args["--num-experts"]) == 4 and int(args["--num-experts"]) % 2 == 0 and args["--moe-router-topk"] == "2"
    assert args["--moe-layer-freq"] == "([0]*3+[1]*2)"  # the pattern's length is --num-layers
    # the MoE layer refuses experts with a bias, the default (megatron/core/transformer/moe/moe_layer.py lines
    # 568 and 684 at d98e8a6: "mlp_bias is not supported"; _experts.py 205-207 beside the default bias fusion)
    assert args["--disable-bias-linear"] is True
    assert eval(args["--moe-layer-freq"]) == [0, 0, 0, 1, 1] and args["--num-layers"] == "5"
    assert int(args["--seq-length"]) % 4 == 0 and int(args["--seq-length"]) >= max(plan.text_tokens)
    assert args["--recompute-granularity"] == "selective" and "--recompute-method" not in args
    assert args["--recompute-modules"] == "core_attn" and args["--use-distributed-optimizer"] is True
    assert args["--global-batch-size"] == str(4 * 2)  # M x dp: the cp ranks share their samples
    assert "launch on 16 GPUs" in text and "CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    dense = megatron_args(to_megatron(export_plan("1f1b", (), 2, 4)))
    assert not any(k in dense for k in ("--context-parallel-size", "--sequence-parallel", "--num-experts",
                                        "--expert-model-parallel-size"))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in to_megatron(export_plan("1f1b", (), 2, 4))


def test_torchtitan_toml_carries_expert_and_context_parallel_degrees():
    config = tomllib.loads(to_torchtitan(five_d_plan(), "x.csv"))
    par = config["parallelism"]
    degrees = par["expert_parallel_degree"], par["context_parallel_degree"], par["data_parallel_shard_degree"]
    assert degrees == (2, 2, 2)
    assert config["training"]["seq_len"] % 4 == 0 and config["activation_checkpoint"]["mode"] == "selective"


def test_the_encoders_own_tp_is_refused_by_torchtitan_and_megatron_in_one_line():
    plan = export_plan("1f1b", (), 2, 4, tp=2, encoder_tp=1)
    assert "encoder at tp 1" in one_line_error(lambda: to_megatron(plan))
    assert "encoder at tp 1" in one_line_error(lambda: to_torchtitan(plan, "x.csv"))
    assert "encoder tp 1" in one_line_error(lambda: to_hyper_parallel(plan))


def titan_parse(args_path, cwd):
    """torchtitan 0.3's own ConfigManager on the exported arguments, in a fresh interpreter; the config's
    fields as JSON."""
    code = (
        "import json, shlex, sys\n"
        "from torchtitan.config.manager import ConfigManager\n"
        "text = open(sys.argv[1]).read()\n"
        "args = shlex.split('\\n'.join(l for l in text.splitlines() if not l.startswith('#')))\n"
        "c = ConfigManager().parse_args(args)\n"
        "p, t = c.parallelism, c.training\n"
        "print(json.dumps({'pp': p.pipeline_parallel_degree, 'tp': p.tensor_parallel_degree,"
        " 'cp': p.context_parallel_degree, 'ep': p.expert_parallel_degree, 'dp': p.data_parallel_shard_degree,"
        " 'sp': p.enable_sequence_parallel, 'schedule': p.pipeline_parallel_schedule,"
        " 'csv': p.pipeline_parallel_schedule_csv, 'parts': p.module_fqns_per_model_part,"
        " 'local_batch': t.local_batch_size, 'global_batch': t.global_batch_size, 'seq_len': t.seq_len,"
        " 'ac': type(c.activation_checkpoint).__qualname__, 'reshard': p.fsdp_reshard_after_forward}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(args_path)], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["zbv", "5d", "zero3"])
def test_torchtitan_0_3_config_manager_accepts_the_arguments(tmp_path, capsys, case):
    pytest.importorskip("torchtitan.config.manager")
    pytest.importorskip("triton")  # torchtitan 0.3's model registries import it, on CPU too
    if case == "zbv":
        record, _ = make_record("zbv,zbv", (17,), 2, 4, tp=2, dp=2)
    elif case == "zero3":
        record, _ = make_record("1f1b", (), 2, 4, tp=2, dp=2, zero_stage=3)
    else:
        record, _ = make_record("1f1b", (), 2, 4, tp=2, dp=2, recompute="selective", model_name=TINY_MOE,
                                ep=2, cp=2, sequence_parallel=True)
    dump_plan(record, tmp_path / "plan.json")
    out = tmp_path / "job.args"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan-0.3", "--out", str(out)]) == 0
    plan = read_export_plan(tmp_path / "plan.json")
    assert (tmp_path / "job.csv").read_text() == to_torch_csv(plan)
    config = titan_parse(out, tmp_path)
    assert (config["pp"], config["tp"], config["cp"], config["ep"], config["dp"]) == (2, 2, plan.cp, plan.ep, 2)
    assert config["csv"] == str(tmp_path / "job.csv") and config["local_batch"] == 4 and config["global_batch"] == 8
    # the same stages as the 0.2.x TOML, the output layer under 0.3's name for it
    assert config["parts"] == [["lm_head" if m == "output" else m for m in p] for p in tomllib.loads(
        to_torchtitan(plan, "x.csv"))["parallelism"]["module_fqns_per_model_part"]]
    # ZeRO-3: every layer reshards after its forward, which torchtitan's default does not under PP
    assert config["reshard"] == ("always" if case == "zero3" else "default")
    if case == "zbv":  # the V: torchtitan places stages r and 2P-1-r on rank r for this schedule name
        assert config["schedule"] == "ZBVZeroBubble" and config["ac"] == "NoneType" and config["sp"] is False
        assert len(config["parts"]) == 4 and config["parts"][-1][-2:] == ["norm", "lm_head"]
    elif case == "zero3":
        assert config["schedule"] == "PipelineScheduleSingle" and config["sp"] is False
    else:
        assert config["sp"] is True and config["ac"] == "SelectiveAC.Config" and config["seq_len"] % 4 == 0
