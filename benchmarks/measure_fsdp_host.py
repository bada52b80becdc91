"""Measure FSDP2's host seconds per sharded layer per call on this machine's gloo ranks and write them into a
profile as its ``fsdp_host_s`` (:mod:`mpipe_tune.profiler._fsdp_host`), with the load average beside it: what
``mpipe-tune profile`` measures, for a profile measured before it did (``moe-vm-4.json``, which
``bench_fidelity_parallel.py`` predicts on).

    python benchmarks/measure_fsdp_host.py benchmarks/profiles/moe-vm-4.json [--nproc 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from mpipe_tune.profiler._fsdp_host import fsdp_host_entry, measure_fsdp_host
from mpipe_tune.profiler import sweep_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    data = json.loads(args.profile.read_text())
    load = os.getloadavg()[0]
    point = measure_fsdp_host("cpu", args.nproc, sweep_settings("cpu", quick=False), lambda text: print(text, flush=True))
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    how = f"; load average {load:.1f} on {os.cpu_count()} cores when measured" + (" (under load)" if load > 1 else "")
    data["fsdp_host_s"] = fsdp_host_entry(point, {"source": "measured", "date": date},
                                          f"on {args.nproc} local processes with gloo", how)
    args.profile.write_text(json.dumps(data, indent=2) + "\n")
    print(f"fsdp_host_s = {point.value:.3g} s per layer call (extra per stack: "
          f"{', '.join(f'{x * 1e3:.2f} ms' for x in point.extra_s)}; load {load:.1f})")


if __name__ == "__main__":
    main()
