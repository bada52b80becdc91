"""``mpipe-tune run`` end to end: real and emulated compute, JSON beside the prediction, the trace.

The first test runs the console entry point in a subprocess; the others call ``main`` in-process,
which reuses this test session's fork server.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, TEST_MODEL, make_plan  # noqa: E402

from mpipe_tune.cli import main  # noqa: E402
from mpipe_tune.inputs import Microbatch, Workload  # noqa: E402


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "run", *args], capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return make_plan(tmp_path_factory.mktemp("cli"), "transpose,1f1b", (FIRST_LLM,), 2)


def test_real_run_reports_measured_beside_predicted_and_writes_the_trace(plan, tmp_path):
    trace_path = tmp_path / "trace.json"
    code, stdout, stderr = run_cli(str(plan), "--steps", "2", "--json", "--trace", str(trace_path))
    assert code == 0, stderr
    record = json.loads(stdout)
    assert record["schedule"] == "transpose,1f1b" and record["pp"] == 2 and record["backend"] == "gloo"
    assert len(record["step_times_s"]) == 2 and all(t > 0 for t in record["step_times_s"])
    assert record["measured_step_s"] == record["step_times_s"][1]
    assert record["ratio"] == pytest.approx(record["measured_step_s"] / record["predicted_step_s"])
    assert all(loss > 0 for loss in record["loss_sums"])
    # progress: one line per step with the step's time (its slowest rank's, as the record has it)
    for step, seconds in enumerate(record["step_times_s"]):
        assert f"step {step + 1}/2 done in {seconds * 1e3:.1f} ms (predicted " in stderr

    plan_record = json.loads(plan.read_text())
    trace = json.loads(trace_path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    for rank, nodes in enumerate(plan_record["order"]["nodes"]):
        names = [e["name"] for e in slices if e["pid"] == rank and e["args"]["step"] == 0]
        assert names == [plan_record["order"]["events"][i] for i in nodes]  # every event, in the plan's order
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)


def test_emulated_run_needs_no_architecture_and_never_beats_the_prediction(tmp_path, capsys):
    """Emulated compute waits each event's predicted seconds: an explicit-cost model (which the real
    runtime cannot build) runs, and no step can be shorter than the predicted longest path."""
    workload = Workload(tuple(Microbatch(300 * m, 1000) for m in range(4)), "emulated")
    plan = make_plan(tmp_path, "transpose,1f1b", (8,), 2, model_spec="example-mllm", workload=workload)
    assert main(["run", str(plan), "--compute", "emulated", "--steps", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["compute"] == "emulated" and record["loss_sums"] == [None, None]
    assert record["predicted_step_s"] > 0.1
    assert min(record["step_times_s"]) >= record["predicted_step_s"]


@pytest.mark.parametrize("zero", [dict(zero_stage=2), dict(zero_stage=3, reshard_after_forward=False)])
def test_an_emulated_run_steps_over_the_sharding_actions(tmp_path, capsys, zero):
    """Emulated compute at ZeRO-2 and ZeRO-3 keeping the weights: the program's sharding actions take no
    time of their own (each step at least the prediction)."""
    plan = make_plan(tmp_path, "1f1b", (), 2, dp=2, **zero)
    assert main(["run", str(plan), "--compute", "emulated", "--steps", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["compute"] == "emulated" and min(record["step_times_s"]) >= record["predicted_step_s"]


def test_table_output(plan, capsys):
    assert main(["run", str(plan), "--steps", "1", "--model", TEST_MODEL]) == 0
    stdout = capsys.readouterr().out
    assert "pp2 tp1 dp1  M=4" in stdout and "on 2 cpu rank(s) (gloo)" in stdout and "measured/predicted" in stdout


def test_a_tensor_and_data_parallel_plan_runs_from_the_cli(tmp_path, capsys):
    """pp 1 x tp 2 x dp 2 on 4 gloo ranks, real compute: the summary names the layout."""
    plan = make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 1, tp=2, dp=2)
    assert main(["run", str(plan), "--steps", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["pp"], record["tp"], record["dp"], record["world_size"]) == (1, 2, 2, 4)
    assert record["dtype"] == "fp32" and record["loss_sums"][0] > 0


def test_a_zero_3_plan_runs_from_the_cli_and_trains_as_stage_1(tmp_path, capsys):
    """pp 2 x dp 2 transpose,1f1b at ZeRO stage 3 (FSDP2 per layer), in the plan's fp32: the same summed
    losses over two steps as the stage-1 plan's, so the sharded update moved every weight as stage 1's."""
    losses = {}
    for zero in (1, 3):
        plan = make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 2, dp=2, zero_stage=zero)
        assert main(["run", str(plan), "--steps", "2", "--json", "--no-progress"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["zero_stage"] == zero and (record["pp"], record["dp"], record["world_size"]) == (2, 2, 4)
        losses[zero] = record["loss_sums"]
    assert losses[3] == pytest.approx(losses[1], rel=1e-5) and losses[3][1] != losses[3][0]
