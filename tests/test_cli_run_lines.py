"""The lines ``mpipe-tune run`` prints for a run's record (its JSON summary): the plan's candidate in its one text form."""

from mpipe_tune.algebra import Candidate
from mpipe_tune.cli._run import print_run

CANDIDATE = Candidate("transpose,1f1b", (9,), pp=2, dp=2, num_microbatches=8)
RECORD = {"plan": "plan.json", "candidate": str(CANDIDATE), "schedule": "transpose,1f1b", "pp": 2, "tp": 1, "dp": 2, "cp": 1, "ep": 1,
          "sequence_parallel": False, "zero_stage": 1, "microbatches": 8, "world_size": 4, "device": "cpu",
          "backend": "gloo", "compute": "emulated", "dtype": None, "owners": "fixed", "data": "stored", "steps": 1,
          "step_times_s": [1.0], "loss_sums": [None], "measured_step_s": 1.0, "predicted_step_s": 1.0, "ratio": 1.0}


def test_the_first_line_is_the_candidates_text_form_with_a_zero_stage_other_than_1(capsys):
    """A ZeRO-3 run said pp2 tp1 dp2 like a stage-1 run; the candidate's text form says 'zero3' and parses back."""
    zero3 = Candidate("transpose,1f1b", (9,), pp=2, dp=2, num_microbatches=8, zero_stage=3)
    print_run({**RECORD, "candidate": str(zero3), "zero_stage": 3})
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("plan plan.json: <transpose,1f1b> cut 9  pp2 tp1 dp2  M=8  zero3  on 4 cpu rank(s)")
    assert Candidate.parse(first.removeprefix("plan plan.json: ").split("  on ")[0]) == zero3
    print_run(RECORD)
    assert capsys.readouterr().out.splitlines()[0].startswith("plan plan.json: <transpose,1f1b> cut 9  pp2 tp1 dp2  M=8  on")
