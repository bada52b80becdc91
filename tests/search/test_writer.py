"""The trial writer's child process: what it was handed reaches the study, and a search that stopped
waiting for it (a second Ctrl-C) does not leave it running when its end marker was lost."""

import optuna
from optuna.distributions import CategoricalDistribution

from mpipe_tune.search.writer import TrialWriter


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
