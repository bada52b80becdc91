"""No export format expresses an interior or sink transpose: each refuses it in one line, from the
Python writers and from the CLI (exit 2, nothing written)."""

import pytest

from mpipe_tune.algebra import Cut, parse_schedule
from mpipe_tune.cli import main
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.report.exports._plan import plan_from_record
from export_writers import to_hyper_parallel, to_megatron, to_torch_csv, to_torchtitan
from mpipe_tune.plan_file import PlanInputs, dump_plan, plan_record
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

from conftest import predict_plan

MODEL = "example-mllm"  # 8 ViT layers, a projector, 16 decoder layers
VISION, LAST = 9, 24
WRITERS = {"torch-csv": to_torch_csv, "megatron": to_megatron, "torchtitan": lambda p: to_torchtitan(p, "x.csv"),
           "hyper-parallel": to_hyper_parallel}


def record_of(schedule, cut, pp=2, num_microbatches=4):
    model, hw = load_model(MODEL), load_profile("ideal")
    workload = Workload(tuple(Microbatch(64 * (m % 3), 100 + m) for m in range(num_microbatches)), "export-test")
    prediction = predict_plan(Cut(cut), parse_schedule(schedule), model, workload, hw, pp)
    return plan_record(prediction, model, workload, hw, PlanInputs(MODEL, (), "ideal")), model


@pytest.mark.parametrize("schedule,cut,region", [
    ("1f1b,transpose", (LAST,), 2),
    ("transpose,1f1b,transpose", (VISION, LAST), 3),
    ("1f1b,transpose,1f1b", (VISION, VISION + 2), 2),
])
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_every_format_refuses_a_transpose_after_the_first_region_in_one_line(schedule, cut, region, fmt):
    record, model = record_of(schedule, cut)
    plan = plan_from_record(record, model)
    with pytest.raises(MpipeError) as info:
        WRITERS[fmt](plan)
    message = str(info.value)
    assert "\n" not in message and f"<{schedule}>" in message
    first_transposed = 1 if schedule.startswith("transpose") and fmt != "hyper-parallel" else region
    assert f"region {first_transposed} is a transpose" in message


def test_cli_refuses_a_sink_transpose_with_exit_2_and_writes_nothing(tmp_path, capsys):
    record, _ = record_of("1f1b,transpose", (LAST,))
    dump_plan(record, tmp_path / "plan.json")
    out = tmp_path / "schedule.csv"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torch-csv", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "region 2 is a transpose" in err and not out.exists()
