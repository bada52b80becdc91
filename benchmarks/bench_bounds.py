"""Bounds on what a command may use: time and peak memory against input size (issue 31 item 4).

Each case runs a real ``mpipe-tune`` command (or the loader it calls) in a fresh process at growing
sizes and reports wall time and peak resident memory (``ru_maxrss`` of the child), with the ratio of
each size's figures to the previous size's: a step proportional to the input doubles when the input
doubles, a quadratic one quadruples.

- ``workload``: a workload JSON file of N microbatches with 200 images each (tens to ~100 MB), read
  by ``load_workload``;
- ``model``: a model YAML file of L explicit-cost layers, read by ``load_model``;
- ``trials``: a plan study grown to N trials (rows copied by set-wise SQL from a real 8-trial study), listed
  by ``mpipe-tune trials`` and continued by ``mpipe-tune plan`` (which finds it full, or refuses a study
  above the most a search reloads);
- ``devices``: ``mpipe-tune plan`` of DeepSeek-V3 on 4,096 and 16,384 devices, and ``show`` of the
  16,384-device plan file.

Usage: ``nice -n 10 .venv/bin/python benchmarks/bench_bounds.py [workload model trials devices] [--big]``
(``--big`` adds the largest sizes: 10^6 trials, a model of 200,000 layers). Results are recorded in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable


def measure(args: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """Wall seconds, peak RSS in MiB (of the child and the children it waited for), exit code and the last
    line of stderr of one child process; the note (the last line) is prefixed with the child's CPU time
    (user + sys) and the 1-minute load average at its end, since wall time on a shared machine is not
    the command's own."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        wall_s = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = (err.read().strip().splitlines() or [""])[-1]
    cpu_s = usage.ru_utime + usage.ru_stime
    return wall_s, usage.ru_maxrss / 1024, child.returncode, f"cpu {cpu_s:.1f} s, load {os.getloadavg()[0]:.1f}; {tail}"


def report(title: str, rows: list[tuple[str, float, float, float, int, str]]) -> None:
    print(f"\n{title}")
    print(f"{'size':>28} {'input MB':>9} {'wall s':>8} {'x prev':>7} {'peak MiB':>9} {'x prev':>7}  rc  note")
    prev = None
    for size, mb, wall_s, rss, rc, note in rows:
        ratio_t = f"{wall_s / prev[0]:.2f}" if prev else "-"
        ratio_m = f"{rss / prev[1]:.2f}" if prev else "-"
        print(f"{size:>28} {mb:>9.1f} {wall_s:>8.2f} {ratio_t:>7} {rss:>9.0f} {ratio_m:>7}  {rc:>2}  {note[:130]}")
        prev = (wall_s, rss)
    sys.stdout.flush()


def loader(code: str) -> list[str]:
    return [PY, "-c", code]


def case_workload(tmp: Path, big: bool) -> None:
    rows = []
    for n in (8192, 16384, 32768, 65536):
        path = tmp / f"workload-{n}.json"
        mbs = [{"image_tokens": 200 * 64, "text_tokens": 4096, "images": [64] * 200} for _ in range(n)]
        path.write_text(json.dumps({"microbatches": mbs}))
        wall, rss, rc, tail = measure(loader(f"from mpipe_tune.inputs._workload import load_workload; "
                                             f"w = load_workload({str(path)!r}); print(len(w.microbatches))"), tmp)
        rows.append((f"{n} microbatches", path.stat().st_size / 1e6, wall, rss, rc, tail))
        path.unlink()
    report("workload file (JSON, 200 images per microbatch), load_workload", rows)


def case_model(tmp: Path, big: bool) -> None:
    rows = []
    sizes = (12_500, 25_000, 50_000, 100_000) + ((200_000,) if big else ())
    for n in sizes:
        path = tmp / f"model-{n}.yaml"
        lines = ["name: wide", "layers:"]
        lines += [f"  - {{name: enc{i}, block: encoder, fwd_s_per_token: 1.0e-7, bwd_s_per_token: 2.0e-7}}"
                  for i in range(n // 10)]
        lines += [f"  - {{name: llm{i}, block: llm, fwd_s_per_token: 1.0e-7, bwd_s_per_token: 2.0e-7}}"
                  for i in range(n - n // 10)]
        path.write_text("\n".join(lines) + "\n")
        wall, rss, rc, tail = measure(loader(f"from mpipe_tune.specs import load_model; "
                                             f"m = load_model({str(path)!r}); print(len(m.layers))"), tmp)
        rows.append((f"{n} layers", path.stat().st_size / 1e6, wall, rss, rc, tail))
        path.unlink()
    report("model file (YAML, explicit-cost layers), load_model", rows)


PLAN_SMALL = ["--devices", "2", "--global-batch", "4", "--samples", "1", "--no-progress", "--study", "s"]


def grow_study(db: Path, total: int) -> None:
    """Copy the study's trials (with their attributes, parameters and values) in set-wise SQL, doubling the
    study each round, until it holds ``total``: a copy keeps its source's trial id plus a fixed offset, so
    its rows in the child tables are copied with one ``INSERT ... SELECT`` per table (10^6 trials in about a
    minute, where a Python loop over the rows took most of an hour)."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        c.execute("PRAGMA journal_mode = WAL")
        have = c.execute("SELECT count(*) FROM trials").fetchone()[0]
        while have < total:
            low, high, top = c.execute("SELECT min(trial_id), max(trial_id), max(number) FROM trials").fetchone()
            high = min(high, low + (total - have) - 1)  # the ids are dense: high - low + 1 trials are copied
            shift_id, shift_number = c.execute("SELECT max(trial_id) FROM trials").fetchone()[0] - low + 1, top + 1
            c.execute("INSERT INTO trials (trial_id, number, study_id, state, datetime_start, datetime_complete) "
                      "SELECT trial_id + ?, number + ?, study_id, state, datetime_start, datetime_complete FROM trials "
                      "WHERE trial_id BETWEEN ? AND ?", (shift_id, shift_number, low, high))
            for table, cols in (("trial_user_attributes", "key, value_json"),
                                ("trial_system_attributes", "key, value_json"),
                                ("trial_params", "param_name, param_value, distribution_json"),
                                ("trial_values", "objective, value, value_type")):
                c.execute(f"INSERT INTO {table} (trial_id, {cols}) SELECT trial_id + ?, {cols} FROM {table} "
                          f"WHERE trial_id BETWEEN ? AND ?", (shift_id, low, high))
            c.commit()
            have = c.execute("SELECT count(*) FROM trials").fetchone()[0]
        c.execute("PRAGMA journal_mode = DELETE")


def case_trials(tmp: Path, big: bool) -> None:
    db = tmp / "study.db"
    url = f"sqlite:///{db}"
    done = subprocess.run([PY, "-m", "mpipe_tune.cli", "plan", "--storage", url, "--trials", "8",
                           "--out", str(tmp / "p.json"), *PLAN_SMALL], cwd=tmp, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows_list, rows_plan = [], []
    for n in (10_000, 100_000) + ((1_000_000,) if big else ()):
        start = time.perf_counter()
        grow_study(db, n)
        print(f"  grew the study to {n} trials in {time.perf_counter() - start:.0f} s", flush=True)
        mb = db.stat().st_size / 1e6
        wall, rss, rc, tail = measure([PY, "-m", "mpipe_tune.cli", "trials", "--storage", url, "--study", "s"], tmp)
        rows_list.append((f"{n} trials", mb, wall, rss, rc, tail))
        print(f"  trials, {n}: {wall:.1f} s wall, {rss:.0f} MiB, rc {rc}, {tail}", flush=True)
        # A budget within the limit, so that a study above it meets the study-size check (not the budget's).
        wall, rss, rc, tail = measure([PY, "-m", "mpipe_tune.cli", "plan", "--storage", url, "--trials",
                                       str(min(n, 100_000)), "--out", str(tmp / "p.json"), *PLAN_SMALL], tmp)
        rows_plan.append((f"{n} trials", mb, wall, rss, rc, tail))
        print(f"  plan, {n}: {wall:.1f} s wall, {rss:.0f} MiB, rc {rc}, {tail}", flush=True)
    report("study of N trials: mpipe-tune trials", rows_list)
    report("study of N trials: mpipe-tune plan continuing it (already full)", rows_plan)


def case_devices(tmp: Path, big: bool) -> None:
    rows = []
    for devices in (4096, 16384):
        out = tmp / f"plan-{devices}.json"
        wall, rss, rc, tail = measure(
            [PY, "-m", "mpipe_tune.cli", "plan", "--model", "qwen2vl-vit-deepseek-v3", "--profile", "ascend-910c-cm384",
             "--devices", str(devices), "--global-batch", str(devices), "--recompute", "search", "--no-progress",
             "--storage", f"sqlite:///{tmp / f'd{devices}.db'}", "--out", str(out)], tmp)
        rows.append((f"plan, {devices} devices", out.stat().st_size / 1e6 if out.exists() else 0.0, wall, rss, rc, tail))
    out = tmp / "plan-16384.json"
    if out.exists():
        wall, rss, rc, tail = measure([PY, "-m", "mpipe_tune.cli", "show", str(out)], tmp)
        rows.append(("show, 16384 devices", out.stat().st_size / 1e6, wall, rss, rc, tail))
    report("DeepSeek-V3 on ascend-910c-cm384, global batch = devices, 100 trials", rows)


CASES = {"workload": case_workload, "model": case_model, "trials": case_trials, "devices": case_devices}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES), choices=list(CASES) + [[]])
    parser.add_argument("--big", action="store_true", help="also the largest sizes (10^6 trials, 200,000 layers)")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.cases:
            CASES[name](Path(folder), args.big)


if __name__ == "__main__":
    main()
