"""The typed plan file: every stored field reads into a record and writes back to the same JSON."""

import json

import pytest

from mpipe_tune.cli import main
from mpipe_tune.errors import PlanFileError
from mpipe_tune.plan_file import BEST, PlanFile, load_plan, read_plan, resolve, select_plan
from mpipe_tune.plan_file._check import write_value


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("schema")
    assert main(["plan", "--devices", "4", "--global-batch", "8", "--samples", "2", "--trials", "6", "--no-progress",
                 "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(folder / "plan.json")]) == 0
    return folder / "plan.json"


def test_every_section_and_the_search_summary_write_back_as_stored(plan_path):
    record = json.loads(plan_path.read_text())
    file = read_plan(plan_path)
    assert file.names == (BEST, *record["baselines"], *record["alternatives"])
    for name in file.names:
        stored = select_plan(record, name)
        section = file.section(name).to_stored()
        assert {k: section[k] for k in file.best.FIELDS} == {k: stored[k] for k in file.best.FIELDS}, name
        assert section["workload"] == stored["inputs"]["workload"], name
    assert file.search.to_stored() == record["search"]
    assert write_value(file.inputs) == {k: v for k, v in record["inputs"].items() if k != "workload"}
    assert load_plan(plan_path) == record


def test_resolve_picks_a_plan_derives_it_and_checks_its_stored_order(plan_path, tmp_path):
    file = read_plan(plan_path)
    for name in file.names:
        resolved = resolve(file, name, predicting=True)
        assert resolved.section is file.section(name) and resolved.profile.name == file.inputs.profile.name
        assert [str(e) for e in resolved.plan.order.events] == list(resolved.section.order.events)
    record = json.loads(plan_path.read_text())
    megatron = record["baselines"]["megatron"]
    nodes = megatron["order"]["nodes"][0]
    nodes[0], nodes[1] = nodes[1], nodes[0]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(record))
    resolve(edited)  # the best plan is intact
    with pytest.raises(PlanFileError, match="plan 'megatron': rank 0's stored order differs from derive's"):
        resolve(edited, "megatron")
    with pytest.raises(PlanFileError, match="holds no plan named 'zigzag'; it holds best, megatron"):
        resolve(edited, "zigzag")


def test_a_record_in_memory_reads_like_a_file(plan_path):
    record = load_plan(plan_path)
    assert PlanFile.from_dict(record, path=str(plan_path)) == read_plan(plan_path)
