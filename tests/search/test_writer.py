"""The trial writer's child process: what it was handed reaches the study, and a search that stopped
waiting for it (a second Ctrl-C) does not leave it running when its end marker was lost."""

import subprocess
import sys

import optuna
from optuna.distributions import CategoricalDistribution

from mpipe_tune.search._writer import TrialWriter


def finished_trial(value: float):
    return optuna.trial.create_trial(params={"x": 0}, distributions={"x": CategoricalDistribution([0])}, value=value)


def test_an_abandoned_writer_writes_what_reached_it_and_exits_without_its_end_marker(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="s")
    writer = TrialWriter(storage, "s")
    for value in (3.0, 2.0, 1.0):
        writer.put(finished_trial(value))
    writer.queue.put = lambda *args, **kwargs: None  # the end marker lost, as a put cut by Ctrl-C can lose it
    writer.close(wait_s=0.2)
    writer.process.join(300)  # what the process's exit would wait for (a hang guard, far above a loaded machine)
    assert writer.process.exitcode == 0
    assert sorted(t.value for t in study.get_trials()) == [1.0, 2.0, 3.0]


def test_a_closed_writer_has_written_every_trial(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="s")
    writer = TrialWriter(storage, "s")
    for value in range(40):  # more than the backlog: put waits for the child
        writer.put(finished_trial(float(value)))
    writer.close()
    assert not writer.process.is_alive() and len(study.get_trials()) == 40



DIED = """
import os, signal, sys
import optuna
from optuna.distributions import CategoricalDistribution
from mpipe_tune.errors import MpipeError
from mpipe_tune.search._writer import TrialWriter

if __name__ == "__main__":
    storage = "sqlite:///" + sys.argv[1]
    optuna.create_study(storage=storage, study_name="s")
    writer = TrialWriter(storage, "s")
    os.kill(writer.process.pid, signal.SIGKILL)  # killed (out of memory, say) ...
    writer.process.join()
    trial = optuna.trial.create_trial(params={"x": 0}, distributions={"x": CategoricalDistribution([0])}, value=1.0,
                                      user_attrs={"mpipe": "x" * 4096})
    for _ in range(writer.queue._maxsize):  # ... with more handed over than the pipe holds
        writer.queue.put_nowait(trial)
    try:
        writer.close()
    except MpipeError as exc:
        print(exc)
"""


def test_a_search_whose_writer_died_with_trials_queued_exits_with_its_error(tmp_path):
    """What the feeder thread could not pass on to the dead child is dropped: the process ends (it waited
    for that thread forever) and says why the writer stopped."""
    script = tmp_path / "died.py"
    script.write_text(DIED)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "study.db")], capture_output=True, text=True,
                          timeout=300)  # a hang guard, far above a loaded machine
    assert proc.returncode == 0, proc.stderr
    assert "the trial writer stopped (exit code -9)" in proc.stdout


def test_a_shared_total_stops_at_exactly_n_trials_and_stores_the_next_as_failed(tmp_path):
    """Found by the planted-fault pass (docs/testing.md): a reservation counted one trial too few let one in."""
    from mpipe_tune.search._writer import store_trial

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="s")
    assert [store_trial(study, finished_trial(float(v)), 3, storage) for v in range(5)] == [True] * 3 + [False] * 2
    states = [t.state for t in study.get_trials()]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3 and states.count(optuna.trial.TrialState.FAIL) == 2
