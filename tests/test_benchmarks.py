"""The fidelity benchmark's tables are DataFrames of its recorded results (seconds, plain ratios)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("bench_fidelity", BENCHMARKS / "bench_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_the_fidelity_tables_are_frames_of_the_recorded_seconds(fidelity, capsys):
    record = json.loads((BENCHMARKS / "fidelity-results.json").read_text())
    plans = fidelity.plans_frame(record)
    assert list(plans.columns) == ["plan", "predicted_s", "measured_s", "error", "round_medians_s",
                                   "predicted_recalibrated_s", "one_eff_s", "per_phase_s"]
    for (_, row), r in zip(plans.iterrows(), record["plans"]):
        assert (row["plan"], row["predicted_s"], row["measured_s"]) == (r["label"], r["predicted_s"], r["measured_s"])
        assert row["error"] == r["predicted_s"] / r["measured_s"] - 1
        assert row["per_phase_s"] == r["predicted_by_variant_s"]["per-phase"]
    figures = fidelity.figures_frame(record)
    assert figures.iloc[0]["mape"] == record["figures"]["mape"] and len(figures) == 2 + len(record["figures_by_variant"])
    fidelity.print_table(record)
    out = capsys.readouterr().out.splitlines()
    first = record["plans"][0]
    assert out[2].startswith(f"| 0 | `{first['label']}` | {first['predicted_s'] * 1e3:.1f} | ")
