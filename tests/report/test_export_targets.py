"""The export-target interface: every registered target states its trainer and the client that checks it,
two-file targets check ``--out`` in one place, the shared refusals hold for every target, and a new target
is one subclass plus one registration."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpipe_tune.cli import main
from mpipe_tune.plan_file import dump_plan
from mpipe_tune.report import exports
from mpipe_tune.report.exports import TARGETS, ExportPlan, ExportTarget, Output
from test_export import export_plan, make_record, one_line_error

TWO_FILES = [name for name, target in TARGETS.items() if target.files]


def test_every_target_is_registered_under_its_name_and_names_its_trainer_and_client():
    assert list(TARGETS) == ["torch-csv", "torchtitan", "torchtitan-0.3", "megatron", "hyper-parallel",
                             "mindspeed-mm"]
    for name, target in TARGETS.items():
        assert target.name == name and target.trainer and target.help and target.client, name


@pytest.mark.parametrize("name", TWO_FILES)
def test_a_two_file_target_needs_out_and_puts_its_second_file_beside_it(name):
    target = TARGETS[name]
    plan = export_plan("1f1b", (), 2, 4)
    assert "output file" in one_line_error(lambda: target.export(plan, None))
    if target.files.suffix:
        assert f"must end in {target.files.suffix}" in one_line_error(lambda: target.export(plan, Path("x.bin")))
    out = Path("run").with_suffix(target.files.suffix or ".args")
    paths = [o.path for o in target.export(plan, out)]
    assert paths[:2] == [out, out.with_suffix(target.files.beside_suffix)]


@pytest.mark.parametrize("name", [n for n in TARGETS if n != "torch-csv"])  # a CSV of actions has no tp
def test_every_trainer_with_one_tp_degree_refuses_the_encoders_own_tp_in_one_line(name):
    plan = export_plan("1f1b", (), 2, 4, tp=2, encoder_tp=1)
    out = Path("x").with_suffix(TARGETS[name].files.suffix or ".args") if TARGETS[name].files else None
    assert "encoder" in one_line_error(lambda: TARGETS[name].export(plan, out))


class _Lines(ExportTarget):
    """A new target: the pipeline degree and schedule, one line."""

    name = "lines"
    trainer = "lines"
    help = "pipeline degree and schedule"
    client = "this test"

    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        return (Output(paths[0], f"{plan.pp} {plan.schedule}\n"),)


def test_a_new_target_is_one_subclass_and_one_registration(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(exports.TARGETS, _Lines.name, _Lines())
    record, _ = make_record("1f1b", (), 2, 4)
    dump_plan(record, tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "lines", "--out", str(tmp_path / "p.txt")]) == 0
    assert (tmp_path / "p.txt").read_text() == "2 1f1b\n"
