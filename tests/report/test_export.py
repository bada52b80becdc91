"""Exports to torch pipelining CSV, torchtitan, Megatron-LM and hyper-parallel, read back by their own parsers
where one exists here (torch's CSV loader, tomllib, shlex, PyYAML)."""

import shlex
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
import yaml

from mpipe_tune.algebra.events import Fwd
from mpipe_tune.algebra.schedule import Cut, parse_schedule
from mpipe_tune.cli import main
from mpipe_tune.cost.layers import CostOptions
from mpipe_tune.inputs.workload import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.report.export import (
    plan_from_record,
    read_export_plan,
    to_megatron,
    to_torch_csv,
    to_torchtitan,
)
from mpipe_tune.report.plan_file import PlanInputs, dump_plan, plan_record, plan_section
from mpipe_tune.plan_file import select_plan
from mpipe_tune.specs import load_model, load_profile
from conftest import predict_plan

MODEL = "example-mllm"  # explicit costs: 8 ViT layers, a projector, 16 decoder layers
VISION = 9
NUM_DECODERS = 16


def workload(num_microbatches):
    return Workload(tuple(Microbatch(64 * (m % 3), 100 + m) for m in range(num_microbatches)), "export-test")


def predicted(schedule, cut, pp, num_microbatches, *, frozen=(), owners=None, slabs=None, tp=1, dp=1, recompute=False):
    """(prediction, model, workload, profile, options) of one candidate of the example model."""
    model = load_model(MODEL)
    if frozen:
        model = model.with_frozen(frozen)
    hw, wl = load_profile("ideal"), workload(num_microbatches)
    options = CostOptions(dtype="bf16", tp_degree=tp, dp_degree=dp, recompute=recompute)
    prediction = predict_plan(Cut(cut), parse_schedule(schedule), model, wl, hw, pp, microbatch_owners=owners,
                         slab_counts=slabs, options=options)
    return prediction, model, wl, hw, options


def make_record(schedule, cut, pp, num_microbatches, *, baselines=(), frozen=(), **kwargs):
    """A plan file's record (as ``plan_record`` writes it), with ``baselines``: name -> (schedule, cut)."""
    prediction, model, wl, hw, options = predicted(schedule, cut, pp, num_microbatches, frozen=frozen, **kwargs)
    sections = {name: plan_section(*predicted(s, c, pp, num_microbatches, frozen=frozen, **kwargs)[:4])
                for name, (s, c) in dict(baselines).items()}
    return plan_record(prediction, model, wl, hw, PlanInputs(MODEL, frozen, "ideal"), baselines=sections), model


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
    for rank in range(pp):
        expected = [(e.rank + (e.region - 1) * pp, "F" if isinstance(e, Fwd) else "B", e.mb)
                    for e in plan.nodes(rank) if type(e).__name__ in ("Fwd", "Bwd")]
        loaded = [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in runtime.pipeline_order[rank]]
        assert loaded == expected, f"rank {rank}"
    assert runtime.stage_index_to_group_rank == {s: s % pp for s in range(pp * v)}
    # torch's lowering paired every send with a receive; its dry run finds no deadlock
    compute_and_comms = {r: [a for a in actions if a.computation_type.value in ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")]
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
        assert "region 1 is a transpose" in message and "--plan megatron" in message
    alone = plan_from_record(record, model)  # a file without the megatron baseline: say how to make it
    assert "<1f1b> with no cut" in one_line_error(lambda: to_torch_csv(alone))


@pytest.mark.parametrize("schedule,cut", [("zb1p", ()), ("zbv,zbv", (17,))])
def test_zero_bubble_plans_are_refused_by_every_export_in_one_line(schedule, cut):
    record, model = make_record(schedule, cut, 4, 8)
    message = one_line_error(lambda: plan_from_record(record, model))
    assert f"zero-bubble skeleton {schedule.split(',')[0]}" in message and "--plan megatron" in message


def test_cli_refuses_a_transpose_with_exit_2_and_writes_nothing(tmp_path, capsys):
    record, _ = make_record("transpose,1f1b", (VISION,), 2, 4, baselines={"megatron": ("1f1b", ())})
    dump_plan(record, tmp_path / "plan.json")
    out = tmp_path / "schedule.csv"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torch-csv", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plan megatron" in err and not out.exists()
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
    from mpipe_tune.report.export import FORMATS

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    assert all(name in help_text for name in FORMATS)
    record, _ = make_record("1f1b", (), 2, 4)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed"]) == 2
    assert "use one of torch-csv, torchtitan, megatron, hyper-parallel" in capsys.readouterr().err


def test_the_export_module_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import mpipe_tune.report.export, mpipe_tune.cli_export"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
