"""Time `mpipe-tune profile` on this host and show how much its figures move from run to run.

    python benchmarks/bench_profile.py --runs 3 --calibrate tiny-vit-llm --save benchmarks/profiles/this-vm.json

runs `mpipe-tune profile --device cpu --nproc 2` (plus `--calibrate MODEL` when given) ``--runs`` times,
prints the wall time of each run and a markdown table of every figure per run with the spread across
runs (max / min), and keeps the last run's profile at ``--save``. The README records its output.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from mpipe_tune.cost import load_profile


def figures(path: Path) -> dict[str, float]:
    """The numbers worth comparing across runs, in display units."""
    p = load_profile(path)
    out = {f"peak {d} (TFLOP/s)": v / 1e12 for d, v in p.peak_flops_per_s.items()}
    out["memory (GB/s)"] = p.memory_bytes_per_s / 1e9
    for (link_class, collective), cost in p.links.items():
        if link_class == "intra_node":
            out[f"{collective} alpha (us)"] = cost.alpha_s * 1e6
            out[f"{collective} bandwidth (GB/s)"] = 1e-9 / cost.beta_s_per_byte if cost.beta_s_per_byte else float("inf")
            out[f"{collective} fit R^2 (log t)"] = p.provenance[f"links.{link_class}.{collective}"]["fit_r2"]
    for kind, value in p.efficiency.items():
        out[f"efficiency {kind}"] = value
    if p.host is not None:
        out["host dispatch (us)"] = p.host.dispatch_s * 1e6
        out["host sync (us)"] = p.host.sync_s * 1e6
    for family, curve in asdict(p.kernel_efficiency).items() if p.kernel_efficiency else ():
        for name, value in (curve or {}).items():
            out[f"kernel {family} {name}"] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calibrate", default=None, help="model whose layers calibrate the efficiencies")
    parser.add_argument("--save", default=None, help="keep the last run's profile here")
    args = parser.parse_args()

    rows: dict[str, list[float]] = {}
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            out = Path(tmp) / f"run{run}.json"
            command = [sys.executable, "-m", "mpipe_tune.cli", "profile", "--device", "cpu", "--nproc",
                       str(args.nproc), "--out", str(out)]
            if args.calibrate:
                command += ["--calibrate", args.calibrate]
            if args.save:
                command += ["--name", Path(args.save).stem]
            begin = time.monotonic()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            walls.append(time.monotonic() - begin)
            print(f"run {run + 1}: {walls[-1]:.1f} s wall", file=sys.stderr)
            for name, value in figures(out).items():
                rows.setdefault(name, []).append(value)
        if args.save:
            shutil.copyfile(out, args.save)
    print(f"command: mpipe-tune profile --device cpu --nproc {args.nproc}"
          + (f" --calibrate {args.calibrate}" if args.calibrate else "") + " --out X.json")
    print(f"wall time per run (s): {', '.join(f'{w:.0f}' for w in walls)}\n")
    print("| figure | " + " | ".join(f"run {i + 1}" for i in range(args.runs)) + " | max / min |")
    print("|---|" + "---:|" * (args.runs + 1))
    for name, values in rows.items():
        low, high = min(values), max(values)
        spread = f"{high / low:.2f}" if low > 0 and high != float("inf") else "-"
        print(f"| {name} | " + " | ".join(f"{v:.4g}" for v in values) + f" | {spread} |")
    print(json.dumps({"wall_s": walls}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
