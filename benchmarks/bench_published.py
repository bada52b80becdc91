"""Published, measured training runs predicted by the cost model: published step time, predicted, ratio.

Every run in ``benchmarks/published_runs.yaml`` (its full stated configuration and citation) is
predicted as ``mpipe-tune predict`` would predict it (see ``benchmarks/published.py``), on the
profile the run names as shipped, or on ``--profile`` for every run. The table marks each run
``fit`` (the calibration in ``fit_published.py`` saw it) or ``held-out`` (it did not), and gives
the predicted peak memory per device against the device's capacity. The summary reports the
held-out bf16 runs separately: the target is every one within 10% of its published throughput. A run
marked ``excluded`` (outside what its profile describes, the reason in ``published_runs.yaml``) is shown
with its reason and counted in no summary figure.

    python benchmarks/bench_published.py [--profile NAME_OR_JSON] [--only SUITE] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout

from published import load_runs, predict_run  # noqa: E402

from mpipe_tune.cost import load_profile  # noqa: E402

TARGET = 0.10
"""Largest throughput error a held-out bf16 run may have."""


def evaluate(runs, profile_spec: str | None, overrides=None) -> list[dict]:
    """One row per run; ``overrides`` maps profile names to profiles to use instead of the shipped ones."""
    rows = []
    profiles = dict(overrides or {})
    for run in runs:
        spec = profile_spec or run.profile
        profile = profiles.setdefault(spec, load_profile(spec))
        prediction = predict_run(run, profile)
        predicted_s = prediction.timeline.makespan_s
        memory = prediction.memory
        rows.append({
            "run": run.name, "suite": run.suite, "split": "excluded" if run.excluded else run.split,
            "excluded": run.excluded, "dtype": run.dtype, "devices": run.devices,
            "layout": f"tp{run.tp} pp{run.pp} vp{run.vp} cp{run.cp} dp{run.dp} ep{run.ep}"
                      + (" sp" if run.sequence_parallel else ""),
            "global_batch": run.global_batch, "seq_len": run.seq_len, "profile": profile.name,
            "published_step_s": run.step_time_s, "predicted_step_s": predicted_s,
            "ratio": predicted_s / run.step_time_s,
            "throughput_error": run.step_time_s / predicted_s - 1.0,
            "published_mfu": run.mfu,
            "peak_memory_bytes": max(memory.peak_bytes), "capacity_bytes": memory.capacity_bytes,
            "fits": memory.fits, "source": run.source, "table": run.table,
        })
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for profile in sorted({r["profile"] for r in rows}):
        for split in ("fit", "held_out"):
            for dtype in sorted({r["dtype"] for r in rows}):
                chosen = [abs(r["throughput_error"]) for r in rows
                          if r["split"] == split and r["dtype"] == dtype and r["profile"] == profile]
                if chosen:
                    out[f"{profile} {split} {dtype}"] = {"runs": len(chosen), "mean_abs_error": sum(chosen) / len(chosen),
                                                         "max_abs_error": max(chosen)}
    held = [r for r in rows if r["split"] == "held_out" and r["dtype"] == "bf16"]
    out["held_out_bf16_within_target"] = sum(abs(r["throughput_error"]) <= TARGET for r in held)
    out["held_out_bf16_runs"] = len(held)
    for profile in sorted({r["profile"] for r in held}):
        mine = [r for r in held if r["profile"] == profile]
        out[f"held_out_bf16_within_target {profile}"] = f"{sum(abs(r['throughput_error']) <= TARGET for r in mine)} / {len(mine)}"
    scope = [r for r in rows if not r["excluded"]]
    out["layouts_predicted_to_fit"] = sum(r["fits"] for r in scope)
    out["runs"] = len(scope)
    out["excluded"] = len(rows) - len(scope)
    return out


def print_table(rows: list[dict], stats: dict) -> None:
    head = (f"{'run':<32} {'split':<8} {'dtype':<5} {'layout':<30} {'published s':>11} {'predicted s':>11} "
            f"{'ratio':>6} {'tput err':>8} {'peak GB':>8} {'fits':>4}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['run']:<32} {r['split'].replace('_', '-'):<8} {r['dtype']:<5} {r['layout']:<30} "
              f"{r['published_step_s']:>11.3f} {r['predicted_step_s']:>11.3f} {r['ratio']:>6.3f} "
              f"{r['throughput_error']:>+8.1%} {r['peak_memory_bytes'] / 1e9:>8.1f} {'yes' if r['fits'] else 'NO':>4}")
    print()
    for key, value in stats.items():
        if isinstance(value, dict):
            print(f"{key:<30} runs {value['runs']:>2}  mean |throughput error| {value['mean_abs_error']:6.1%}  "
                  f"max {value['max_abs_error']:6.1%}")
    for key, value in stats.items():
        if key.startswith("held_out_bf16_within_target "):
            print(f"held-out bf16 runs on {key.split(' ', 1)[1]} within {TARGET:.0%}: {value}")
    print(f"held-out bf16 runs within {TARGET:.0%} of published throughput: "
          f"{stats['held_out_bf16_within_target']} / {stats['held_out_bf16_runs']}")
    print(f"layouts predicted to fit the memory they ran in: {stats['layouts_predicted_to_fit']} / {stats['runs']}"
          + (f" (in scope; {stats['excluded']} excluded)" if stats["excluded"] else ""))
    for r in rows:
        if r["excluded"]:
            print(f"excluded {r['run']}: {r['excluded']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="predict every run on this profile (default: each run's own)")
    parser.add_argument("--only", default=None, help="only the suites whose id contains this text")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    runs = [r for r in load_runs() if args.only is None or args.only in r.suite]
    started = time.perf_counter()
    rows = evaluate(runs, args.profile)
    stats = summary(rows)
    if args.json:
        print(json.dumps({"runs": rows, "summary": stats, "wall_s": time.perf_counter() - started}, indent=1))
    else:
        print_table(rows, stats)
        print(f"({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
