"""Published MoE training runs (language-only) predicted with MoE dispatch as the trainers run it
(``mpipe_tune/cost/_moe.py``): every MoE run of ``published_runs.yaml`` and ``published_moe_runs.yaml``, each at its
stated layout and MoE settings (dispatcher, capacity factor, padding), on its profile, as ``bench_published.py``
predicts the dense runs. Prints each run's measured and predicted step time and their ratio, the fit and held-out
rows apart. Nothing here is fitted: ``fit_published.py`` fits ascend-910b's index-kernel curve on the ``fit`` rows
of its profile (:data:`fit_published.MOE_NAMES`), never reading a ``held_out`` one.

    python benchmarks/bench_moe.py            # the table
    python benchmarks/bench_moe.py --json     # one JSON object
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published import RUNS_FILE, load_runs, predict_run, run_model  # noqa: E402

MOE_RUNS_FILE = Path(__file__).resolve().parent / "published_moe_runs.yaml"


def moe_runs() -> list:
    """The MoE runs of both files (a run's model has a ``moe_block`` layer)."""
    runs = [*load_runs(RUNS_FILE), *load_runs(MOE_RUNS_FILE)]
    return [r for r in runs if any(getattr(layer.cost, "kind", None) == "moe_block" for layer in run_model(r).layers)]


def evaluate() -> list[dict]:
    rows = []
    for run in moe_runs():
        start = time.process_time()
        prediction = predict_run(run)
        rows.append({
            "run": run.name, "profile": run.profile, "split": "excluded" if run.excluded else run.split,
            "dispatcher": run.moe_dispatcher, "capacity_factor": run.moe_capacity_factor,
            "padded": run.moe_pad_to_capacity, "measured_s": run.step_time_s,
            "predicted_s": prediction.timeline.makespan_s,
            "ratio": prediction.timeline.makespan_s / run.step_time_s,
            "fits_memory": bool(prediction.fits_memory) if hasattr(prediction, "fits_memory") else None,
            "cpu_s": time.process_time() - start,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rows = evaluate()
    if "--json" in argv:
        print(json.dumps({"python": platform.python_version(), "runs": rows}, indent=1))
        return 0
    print(f"python {platform.python_version()}; ratio = predicted / measured step time\n")
    print("| run | profile | split | dispatcher | capacity | measured s | predicted s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        capacity = "dropless" if r["capacity_factor"] is None else f"{r['capacity_factor']:g}{' padded' if r['padded'] else ''}"
        print(f"| {r['run']} | {r['profile']} | {r['split']} | {r['dispatcher']} | {capacity} | {r['measured_s']:.2f} | "
              f"{r['predicted_s']:.2f} | {r['ratio']:.3f} |")
    for split in ("fit", "held_out"):
        errors = [abs(r["ratio"] - 1) for r in rows if r["split"] == split]
        if errors:
            within = sum(e <= 0.15 for e in errors)
            print(f"\n{split}: {len(errors)} runs, mean |error| {100 * sum(errors) / len(errors):.1f}%, "
                  f"max {100 * max(errors):.1f}%, within 15%: {within} of {len(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
