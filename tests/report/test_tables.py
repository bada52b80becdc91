"""The per-rank table of a prediction is a DataFrame in seconds and bytes, printed in ms and GiB."""

import json

from mpipe_tune.algebra import Candidate
from mpipe_tune.cli import main
from mpipe_tune.report._tables import rank_frame


def test_the_rank_frame_holds_the_record_s_seconds_and_bytes(capsys):
    assert main(["predict", "--profile", "h100-sxm", "--model", "qwen2vl-vit-llama3-8b", "--pp", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    frame = rank_frame(record)
    assert list(frame.columns) == ["rank", "busy_s", "bubble_s", "encoder_s", "warmup_slack_s", "spill_s",
                                   "static_bytes", "activation_peak_bytes", "peak_bytes", "over_capacity", "bound_by"]
    for (_, row), r in zip(frame.iterrows(), record["ranks"]):
        assert (row["busy_s"], row["spill_s"], row["peak_bytes"]) == (r["busy_s"], r["spill_s"], r["memory"]["peak_bytes"])
        assert row["over_capacity"] == r["memory"]["over_capacity"]


def test_the_printed_table_marks_and_explains_a_rank_over_capacity(capsys):
    assert main(["predict", "--profile", "h100-sxm", "--model", "qwen2vl-vit-llama3-8b", "--pp", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.split()[:2] == ["rank", "busy"])
    assert out[header + 1].endswith("  OVER") and out[header + 1].split()[0] == "0"
    assert out[header].index("peak GiB") + len("peak GiB") == len(out[header + 1]) - len("  OVER")
    assert "does NOT fit" in out[-1] and "(OVER: the rank's peak is over it)" in out[-1]


def predicted_header(capsys, *flags):
    """``predict``'s candidate line: the candidate it predicted, read back from its one text form."""
    assert main(["predict", "--model", "tiny-vit-llm", *flags, "--json"]) == 0
    predicted = Candidate.from_dict(json.loads(capsys.readouterr().out))
    assert main(["predict", "--model", "tiny-vit-llm", *flags]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("candidate ") and Candidate.parse(line.removeprefix("candidate ")) == predicted, line
    return line


def test_the_printed_header_is_the_candidates_text_form_with_its_memory_and_parallel_settings(capsys):
    """predict and show say the settings the step was predicted with (a ZeRO-3 plan's show did not say zero3),
    in the candidate's text form, which parses back to the candidate predicted."""
    line = predicted_header(capsys, "--pp", "2", "--tp", "2", "--dp", "2", "--zero", "3", "--recompute",
                            "selective", "--sequence-parallel")
    assert "  pp2 tp2 dp2  M=" in line and "  recompute selective  zero3  sp" in line
    assert "  recompute" in predicted_header(capsys, "--pp", "2", "--recompute")
    assert "recompute" not in predicted_header(capsys, "--pp", "2")  # the defaults add nothing
