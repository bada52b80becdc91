"""A study's trials as a DataFrame: each trial's candidate and figures, decoded as the driver stores them."""

import optuna
import pandas as pd
import pytest

from mpipe_tune.cli import main
from mpipe_tune.errors import MpipeError
from mpipe_tune.algebra import Candidate
from mpipe_tune.search._search_run import ATTR
from mpipe_tune.search._trials import COLUMNS, load_trials_study, study_summaries, trials_frame


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    folder = tmp_path_factory.mktemp("study")
    url = f"sqlite:///{folder / 'tmp.db'}"
    assert main(["plan", "--trials", "10", "--storage", url, "--study", "small", "--devices", "2", "--global-batch", "4",
                 "--samples", "2", "--no-progress", "--out", str(folder / "plan.json"), "--json",
                 "--pp", "2"]) == 0  # a pipeline: at pp 1 the bounds settle this space before 10 trials
    return url


def test_every_trial_is_a_row_with_its_candidate_and_figures_in_si_units(storage):
    study = load_trials_study(storage, "small")
    frame = trials_frame(study, storage)
    assert tuple(frame.columns) == COLUMNS
    trials = study.get_trials(deepcopy=False)
    assert list(frame["number"]) == [t.number for t in trials] and len(trials) == 10
    for (_, row), t in zip(frame.iterrows(), trials):
        info = t.user_attrs[ATTR]
        c = Candidate.from_dict(info["candidate"])
        assert (row["schedule"], row["cut"], row["pp"], row["tp"], row["dp"], row["microbatches"], row["recompute"]) == (
            c.schedule, list(c.cut), c.pp, c.tp, c.dp, c.num_microbatches, c.recompute)
        assert row["owners"] == c.owner_policy or (c.owner_policy is None and pd.isna(row["owners"]))
        assert row["state"] == "COMPLETE" and row["step_s"] == t.value == info["mean_s"] and row["p90_s"] == info["p90_s"]
        assert row["exact"] == info["exact"]
        if info["peak_bytes"] is None:
            assert pd.isna(row["peak_bytes"]) and row["fits_memory"] is None  # never estimated
        else:
            assert row["peak_bytes"] == info["peak_bytes"]
            assert row["memory_excess_bytes"] == pytest.approx(info["memory_excess_gib"] * 2**30)
    assert frame["fits_memory"].eq(True).any()


def test_an_unknown_study_or_missing_file_lists_what_the_storage_holds_and_creates_nothing(storage, tmp_path):
    assert study_summaries(storage) == [("small", 10)]
    with pytest.raises(MpipeError, match=r"no study 'other' in .*tmp.db; the studies in .*: 'small' \(10 trials\)"):
        load_trials_study(storage, "other")
    assert load_trials_study(storage, None).study_name == "small"  # the storage's only study
    missing = tmp_path / "missing.db"
    with pytest.raises(MpipeError, match="no such file"):
        load_trials_study(f"sqlite:///{missing}", None)
    assert not missing.exists()


def test_an_empty_study_is_an_empty_frame(tmp_path):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    optuna.create_study(storage=url, study_name="empty")
    frame = trials_frame(load_trials_study(url, "empty"), url)
    assert frame.empty and tuple(frame.columns) == COLUMNS
