"""plan.json sections: the baselines stored beside the best plan, selected by name, validated on load."""

import json

import pytest

from mpipe_tune.algebra.schedule import Cut, parse_schedule
from mpipe_tune.cli import main
from mpipe_tune.cost.layers import CostOptions
from mpipe_tune.cost.predict import predict
from mpipe_tune.errors import MpipeError
from mpipe_tune.report.plan_file import SECTION_KEYS, dump_plan, load_plan, plan_names, select_plan, workload_of
from mpipe_tune.runtime.plan_view import read_plan_file
from mpipe_tune.specs import load_model, load_profile


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    path = folder / "plan.json"
    assert main(["plan", "--devices", "4", "--dp", "1", "--global-batch", "8", "--samples", "1", "--trials", "10",
                 "--no-progress", "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(path)]) == 0
    return path


def test_every_baseline_is_stored_as_a_runnable_section_at_the_best_plans_degrees(plan_file):
    record = load_plan(plan_file)
    rows = {r["plan"]: r for r in record["search"]["comparison"]}
    assert plan_names(record) == tuple(rows)  # best first, then every baseline the table shows
    best = record["candidate"]
    for name in plan_names(record):
        selected = select_plan(record, name)
        c = selected["candidate"]
        assert set(SECTION_KEYS) <= set(selected) and selected["inputs"]["model"] == record["inputs"]["model"]
        assert (c["schedule"], c["microbatches"], c["slabs"]) == (rows[name]["schedule"], rows[name]["microbatches"],
                                                                   rows[name]["slabs"])
        assert (c["pp"], c["tp"], c["dp"]) == (best["pp"], best["tp"], best["dp"])
        assert len(workload_of(selected)) == c["microbatches"]
        view = read_plan_file(str(plan_file), plan_name=name)
        assert view.schedule == c["schedule"] and view.predicted_step_s == selected["predicted"]["makespan_s"]
    assert select_plan(record, None) is record and select_plan(record, "best") is record


def test_a_selected_baseline_re_predicts_to_its_stored_step_time(plan_file):
    """What ``show`` does to the best plan holds for each baseline: the section is the cost model's own."""
    record = load_plan(plan_file)
    model, profile = load_model(record["inputs"]["model"]["spec"]), load_profile(record["inputs"]["profile"]["spec"])
    for name in plan_names(record)[1:]:
        selected = select_plan(record, name)
        c = selected["candidate"]
        options = CostOptions(dtype=c["dtype"], tp_degree=c["tp"], dp_degree=c["dp"], recompute=c["recompute"])
        again = predict(Cut(tuple(c["cut"])), parse_schedule(c["schedule"]), model, workload_of(selected), profile,
                        c["pp"], slab_counts=tuple(tuple(s) for s in c["slabs"]),
                        microbatch_owners=tuple(c["owners"]) if c["owners"] is not None else None, options=options)
        assert again.timeline.makespan_s == pytest.approx(selected["predicted"]["makespan_s"], rel=1e-12), name


def test_a_selected_baseline_round_trips_as_a_plan_file_of_its_own(plan_file, tmp_path):
    record = load_plan(plan_file)
    selected = select_plan(record, "megatron")
    dump_plan(selected, tmp_path / "megatron.json")
    alone = load_plan(tmp_path / "megatron.json")
    assert alone == selected and plan_names(alone) == ("best",)
    assert select_plan(alone, "best") == selected


def test_an_unknown_plan_name_lists_the_names_the_file_holds(plan_file):
    record = load_plan(plan_file)
    with pytest.raises(MpipeError, match="holds no plan named 'zigzag'; it holds best, megatron, disttrain"):
        select_plan(record, "zigzag", where=f"plan file {plan_file}")
    with pytest.raises(MpipeError, match="holds no plan named 'zigzag'"):
        read_plan_file(str(plan_file), plan_name="zigzag")


def test_a_corrupt_baseline_section_is_refused_on_load(plan_file, tmp_path):
    record = json.loads(plan_file.read_text())
    record["baselines"]["gpipe"]["order"]["nodes"].pop()
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(record))
    with pytest.raises(MpipeError, match="baseline 'gpipe': the order section is corrupt"):
        load_plan(broken)
    del record["baselines"]["gpipe"]["predicted"]
    broken.write_text(json.dumps(record))
    with pytest.raises(MpipeError, match="baseline 'gpipe': field 'predicted' is missing"):
        load_plan(broken)


def test_a_file_without_baselines_still_loads_and_shows(plan_file, tmp_path, capsys):
    record = json.loads(plan_file.read_text())
    del record["baselines"]
    (tmp_path / "old.json").write_text(json.dumps(record))
    assert plan_names(load_plan(tmp_path / "old.json")) == ("best",)
    assert main(["show", str(tmp_path / "old.json")]) == 0
    assert "recorded step time" in capsys.readouterr().out
