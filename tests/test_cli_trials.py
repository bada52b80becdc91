"""``mpipe-tune trials``: a study's trials, as a CSV file or a compact table."""

import json

import pandas as pd
import pytest

from mpipe_tune.cli import main
from mpipe_tune.search._trials import COLUMNS


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trials")
    url = f"sqlite:///{folder / 'tmp.db'}"
    assert main(["plan", "--trials", "10", "--storage", url, "--devices", "2", "--global-batch", "4", "--samples", "1",
                 "--no-progress", "--out", str(folder / "plan.json"), "--json",
                 "--pp", "2"]) == 0  # pipelines: at pp 1 a baseline is the best and the bounds settle the space with no trial
    plan = json.loads((folder / "plan.json").read_text())
    return url, plan["search"]["study"], plan["search"]


def one_line_error(capsys, code, words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def test_csv_holds_every_trial_and_the_best_is_the_plan_s(study, tmp_path, capsys):
    url, name, search = study
    capsys.readouterr()
    path = tmp_path / "trials.csv"
    assert main(["trials", "--storage", url, "--study", name, "--csv", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    frame = pd.read_csv(path)
    assert out[0].startswith(f"study '{name}' in {url}: {search['trials']} trials (")
    assert out[1] == f"{len(frame)} trials written to {path}"
    assert tuple(frame.columns) == COLUMNS and len(frame) == search["trials"]
    fitting = frame[frame["fits_memory"].eq(True)].sort_values(["step_s", "number"])
    best = fitting.iloc[0]
    assert best["step_s"] == pytest.approx(search["comparison"][0]["step_s"], rel=1e-15)
    assert (best["schedule"], json.loads(best["cut"]), best["pp"], best["tp"], best["dp"], best["microbatches"]) == (
        search["candidate"]["schedule"], search["candidate"]["cut"], search["candidate"]["pp"],
        search["candidate"]["tp"], search["candidate"]["dp"], search["candidate"]["microbatches"])


def test_without_csv_a_summary_line_and_the_fastest_trials(study, capsys):
    url, name, search = study
    capsys.readouterr()
    assert main(["trials", "--storage", url, "--rows", "3"]) == 0  # the storage's only study
    out = capsys.readouterr().out.splitlines()
    assert "the fastest that fits: trial " in out[0] and f"<{search['candidate']['schedule']}>" in out[0]
    header = next(i for i, line in enumerate(out) if line.startswith("trial "))
    rows = out[header + 2:header + 5]
    assert out[header + 5] == "" and len({len(out[header]), *map(len, rows)}) == 1
    steps = [float(r.split()[6].rstrip("*")) for r in rows]
    assert steps == sorted(steps) and steps[0] == pytest.approx(search["comparison"][0]["step_s"] * 1e3, abs=1e-3)
    assert any(line.startswith("step ms    the mean predicted step time") for line in out[header + 5:])


def test_an_unknown_study_is_one_line_listing_the_studies(study, capsys):
    url, name, search = study
    one_line_error(capsys, main(["trials", "--storage", url, "--study", "nope"]),
                   f"the studies in {url}: '{name}' ({search['trials']} trials)")


def test_a_missing_storage_file_or_bad_csv_path_is_one_line_and_writes_nothing(study, tmp_path, capsys):
    url, name, _ = study
    missing = tmp_path / "missing.db"
    one_line_error(capsys, main(["trials", "--storage", f"sqlite:///{missing}"]), "no such file")
    assert not missing.exists()
    one_line_error(capsys, main(["trials", "--storage", url, "--csv", str(tmp_path / "no" / "t.csv")]), "--csv")


def test_a_row_count_below_one_names_its_flag(study, capsys):
    url, _, _ = study
    one_line_error(capsys, main(["trials", "--storage", url, "--rows", "0"]), "row count (--rows) is 0, but it must be")
