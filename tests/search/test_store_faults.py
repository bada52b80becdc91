"""The study's storage under faults: a damaged, locked, read-only, full or foreign SQLite file, one an
older Optuna wrote, and a study of another (or an earlier) problem definition. Each is one line naming the file and the fix, exit code 2, and
the trials committed before the fault stay in the file (a rerun continues from them)."""

import contextlib
import os
import sqlite3

import optuna
import pytest
import sqlalchemy

from mpipe_tune.cli import main
from mpipe_tune.errors import MpipeError
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions, run_search
from mpipe_tune.search._writer import TrialWriter
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model

SMALL = ["--devices", "2", "--global-batch", "4", "--samples", "1", "--no-progress", "--study", "s",
         "--pp", "2"]  # a pipeline: at pp 1 the bounds settle this space before the trials these tests count


def plan(db, *args, url=None):
    return main(["plan", "--storage", url or f"sqlite:///{db}", "--out", str(db.parent / "plan.json"), *SMALL, *args])


def one_line_error(capsys, code, *words):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def finished(db) -> int:
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]


@pytest.fixture
def study_db(tmp_path, capsys):
    """A study of 6 finished trials of the small problem."""
    db = tmp_path / "study.db"
    assert plan(db, "--trials", "6") == 0
    capsys.readouterr()
    (tmp_path / "plan.json").unlink()
    assert finished(db) == 6
    return db


def test_a_file_that_is_not_sqlite_is_damaged_and_left_as_it_was(tmp_path, capsys):
    db = tmp_path / "study.db"
    db.write_bytes(b"these are not the pages of an SQLite database\n" * 200)
    before = db.read_bytes()
    one_line_error(capsys, plan(db), str(db), "is damaged (not an SQLite file)", "move it aside", ".recover")
    one_line_error(capsys, main(["trials", "--storage", f"sqlite:///{db}"]), str(db), "is damaged")
    assert db.read_bytes() == before and not (tmp_path / "plan.json").exists()


def test_damaged_pages_are_one_line_and_nothing_is_written(study_db, capsys):
    data = bytearray(study_db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for start in range(page, len(data), page):  # every page but the first (the schema's root) overwritten
        data[start:start + page] = b"\xa5" * page
    study_db.write_bytes(bytes(data))
    one_line_error(capsys, plan(study_db, "--trials", "8"), str(study_db), "is damaged")
    one_line_error(capsys, main(["trials", "--storage", f"sqlite:///{study_db}"]), str(study_db), "is damaged")
    assert not (study_db.parent / "plan.json").exists()


@pytest.mark.parametrize("lock", ["BEGIN IMMEDIATE", "BEGIN EXCLUSIVE"])
def test_a_file_another_process_holds_locked_is_one_line_and_a_rerun_continues(study_db, capsys, lock):
    """A write transaction held by another connection: reserved (others may read) or exclusive."""
    holder = sqlite3.connect(study_db, isolation_level=None)
    holder.execute(lock)
    holder.execute("UPDATE studies SET study_name = study_name")  # a write: the lock is held
    try:
        line = one_line_error(capsys, plan(study_db, "--trials", "10", url=f"sqlite:///{study_db}?timeout=0.1"),
                              str(study_db), "is locked", "rerun the same command to continue")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    if lock == "BEGIN IMMEDIATE":  # readable while locked: the line says what the file keeps
        assert "keeps the 6 finished trials" in line
    assert finished(study_db) == 6 and not (study_db.parent / "plan.json").exists()
    assert plan(study_db, "--trials", "10") == 0
    assert finished(study_db) == 10


def small_search():
    problem = Problem(load_model("example-mllm"), load_profile("ideal"), 2, 4, mix="balanced", num_samples=1, seed=3)
    evaluator = Evaluator(problem)
    return SearchSpace(problem, evaluator.reference_weights(), SpaceOptions()), evaluator


def test_a_lock_taken_during_the_search_stops_it_in_one_line_with_its_trials_kept(tmp_path):
    db = tmp_path / "study.db"
    url = f"sqlite:///{db}?timeout=0.1"
    space, evaluator = small_search()
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    seen = []

    def take_the_lock_at_the_fifth(evaluation):
        seen.append(evaluation)
        if len(seen) == 5:
            holder.execute("BEGIN EXCLUSIVE")

    try:
        with pytest.raises(MpipeError, match="is locked") as caught:
            run_search(space, evaluator, storage=url, study_name="s", n_trials=40, exhaustive=False, progress=False,
                       on_trial=take_the_lock_at_the_fifth)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert str(db) in str(caught.value) and "\n" not in str(caught.value)
    assert 4 <= finished(db) <= 5  # every trial finished before the lock was stored
    again = run_search(space, evaluator, storage=url, study_name="s", n_trials=12, exhaustive=False, progress=False)
    assert again.num_trials == 12 and finished(db) == 12


def test_a_read_only_file_is_one_line_naming_it(study_db, capsys):
    ro = f"sqlite:///file:{study_db}?mode=ro&uri=true"
    one_line_error(capsys, plan(study_db, "--trials", "8", url=ro), str(study_db), "is read-only", "writable")
    assert finished(study_db) == 6
    assert main(["trials", "--storage", f"sqlite:///{study_db}"]) == 0  # reading it needs no write


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a file whatever its mode")
def test_a_file_without_write_permission_is_refused_before_the_search(study_db, capsys):
    study_db.chmod(0o444)
    try:
        one_line_error(capsys, plan(study_db, "--trials", "8"), str(study_db), "is read-only", "chmod u+w")
    finally:
        study_db.chmod(0o644)
    assert finished(study_db) == 6


@contextlib.contextmanager
def pages_limited_to(extra_pages: int):
    """Every SQLite connection this process opens may grow its file by ``extra_pages`` pages only: SQLite
    then fails a write with SQLITE_FULL, as it does when the disk is full."""
    def limit(connection, record):
        count = connection.execute("PRAGMA page_count").fetchone()[0]
        connection.execute(f"PRAGMA max_page_count = {count + extra_pages}")

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", limit)
    try:
        yield
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", limit)


def test_a_disk_that_fills_during_the_search_is_one_line_with_every_stored_trial_kept(study_db, capsys):
    with pages_limited_to(3):
        line = one_line_error(capsys, plan(study_db, "--trials", "400"), str(study_db), "is full",
                              "free space", "rerun the same command to continue")
    kept = finished(study_db)
    assert 6 <= kept < 400 and f"keeps the {kept} finished trials" in line
    assert not (study_db.parent / "plan.json").exists()
    assert plan(study_db, "--trials", str(kept + 4)) == 0  # space again: the study continues from them
    assert finished(study_db) == kept + 4


def test_another_tool_s_database_is_refused_and_left_untouched(tmp_path, capsys):
    db = tmp_path / "notes.db"
    with contextlib.closing(sqlite3.connect(db)) as c:
        c.execute("CREATE TABLE notes (body TEXT)")
        c.execute("INSERT INTO notes VALUES ('mine')")
        c.commit()
    before = db.read_bytes()
    one_line_error(capsys, plan(db), str(db), "another tool's SQLite database (tables notes)", "a study storage file of its own")
    one_line_error(capsys, main(["trials", "--storage", f"sqlite:///{db}"]), "another tool's")
    assert db.read_bytes() == before  # Optuna would have added its tables


def test_the_trial_writer_s_storage_fault_is_its_one_line_error(study_db):
    """The child process that writes a long search's trials reports the fault it stopped on."""
    storage = f"sqlite:///file:{study_db}?mode=ro&uri=true"
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{study_db}")
    writer = TrialWriter(storage, "s")
    with pytest.raises(MpipeError, match="is read-only") as caught:
        for trial in study.get_trials()[:3]:
            writer.put(trial)
        writer.close()
    assert str(study_db) in str(caught.value)
    writer.process.join(300)  # it stopped on the fault: a hang guard, far above a loaded machine
    assert writer.process.exitcode == 1 and finished(study_db) == 6


def test_a_study_of_another_problem_names_the_part_that_differs(study_db, capsys):
    one_line_error(capsys, plan(study_db, "--global-batch", "8"), "study 's'", "the global batch", "--study")
    one_line_error(capsys, plan(study_db, "--recompute", "search"), "the search space")
    assert finished(study_db) == 6


def test_a_study_of_an_earlier_problem_definition_is_told_so(study_db, capsys):
    """A study an earlier mpipe-tune made (its problem digest computed otherwise, no parts recorded)."""
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{study_db}")
    study.set_user_attr("problem", "0123456789abcdef")
    study.set_user_attr("problem_parts", None)
    one_line_error(capsys, plan(study_db), "study 's'", "an earlier mpipe-tune", "optuna delete-study")
    assert finished(study_db) == 6


def test_a_storage_an_older_optuna_wrote_is_told_to_upgrade_with_its_trials_kept(study_db, capsys):
    """Optuna refuses a schema an older Optuna set up until `optuna storage upgrade` has run on it."""
    with contextlib.closing(sqlite3.connect(study_db)) as c:
        c.execute("UPDATE alembic_version SET version_num = 'v2.6.0.a'")  # the revision Optuna 2.6 left
        c.execute("UPDATE version_info SET library_version = '2.6.0'")
        c.commit()
    for command in (lambda: plan(study_db, "--trials", "8"), lambda: main(["trials", "--storage", f"sqlite:///{study_db}"])):
        one_line_error(capsys, command(), str(study_db), "was written by another Optuna version",
                       f"optuna storage upgrade --storage sqlite:///{study_db}")
    assert finished(study_db) == 6 and not (study_db.parent / "plan.json").exists()


def test_a_trial_budget_no_study_may_hold_is_refused_before_the_search(tmp_path, capsys):
    db = tmp_path / "study.db"
    one_line_error(capsys, plan(db, "--trials", "100001"), "trial budget (--trials) 100001 is above 100000")
    assert not db.exists()


def test_a_study_larger_than_a_search_reloads_is_refused_before_optuna_reads_it(study_db, capsys, monkeypatch):
    monkeypatch.setattr("mpipe_tune.search._store.MAX_TRIALS", 5)  # the 6-trial study stands for one of 10^5 and more
    one_line_error(capsys, plan(study_db, "--trials", "5"), "study 's'", "holds 6 trials, more than the 5",
                   "mpipe-tune trials")
    assert main(["trials", "--storage", f"sqlite:///{study_db}", "--study", "s"]) == 0  # it can still be read
