"""The lines ``mpipe-tune run`` prints for a run's record (its JSON summary): the plan's settings, as plan wrote them."""

from mpipe_tune.cli.run import print_run

RECORD = {"plan": "plan.json", "schedule": "transpose,1f1b", "pp": 2, "tp": 1, "dp": 2, "cp": 1, "ep": 1,
          "sequence_parallel": False, "zero_stage": 1, "microbatches": 8, "world_size": 4, "device": "cpu",
          "backend": "gloo", "compute": "emulated", "dtype": None, "owners": "fixed", "data": "stored", "steps": 1,
          "step_times_s": [1.0], "loss_sums": [None], "measured_step_s": 1.0, "predicted_step_s": 1.0, "ratio": 1.0}


def test_the_first_line_names_a_zero_stage_other_than_1(capsys):
    """A ZeRO-3 run said pp2 tp1 dp2 like a stage-1 run; plan's best line says 'zero3'."""
    print_run({**RECORD, "zero_stage": 3})
    assert capsys.readouterr().out.splitlines()[0].startswith("plan plan.json: <transpose,1f1b> pp2 tp1 dp2 zero3 M=8")
    print_run(RECORD)
    assert capsys.readouterr().out.splitlines()[0].startswith("plan plan.json: <transpose,1f1b> pp2 tp1 dp2 M=8")
