"""Measure FSDP2's host seconds per sharded layer per call, per byte, per collective and per tensor on this
machine's gloo ranks and write them into a profile as its ``fsdp_host_s``, ``fsdp_bytes_s``, ``fsdp_collective_s``
and ``fsdp_tensor_s`` (:mod:`mpipe_tune.profiler._fsdp_host`; ``fsdp_collective_s`` against the profile's own
links), with the load average beside it: what ``mpipe-tune profile`` measures, for a profile measured before it
did (``moe-vm-4.json``, which ``bench_fidelity_parallel.py`` predicts on).

    python benchmarks/measure_fsdp_host.py benchmarks/profiles/moe-vm-4.json [--nproc 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from dataclasses import replace
from pathlib import Path

from mpipe_tune.profiler._fsdp_host import fsdp_host_entries, measure_fsdp_host, priced_layer_comm_s
from mpipe_tune.cost import load_profile
from mpipe_tune.profiler import sweep_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    data = json.loads(args.profile.read_text())
    load = os.getloadavg()[0]
    point = measure_fsdp_host("cpu", args.nproc, sweep_settings("cpu", quick=False), lambda text: print(text, flush=True))
    point = replace(point, priced_s=priced_layer_comm_s(load_profile(str(args.profile)), point.sizes, point.group_size))
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    how = f"; load average {load:.1f} on {os.cpu_count()} cores when measured" + (" (under load)" if load > 1 else "")
    data.update(fsdp_host_entries(point, {"source": "measured", "date": date},
                                  f"on {args.nproc} local processes with gloo", how))
    args.profile.write_text(json.dumps(data, indent=2) + "\n")
    per_call, per_byte, per_collective, per_tensor = point.figures
    print(f"fsdp_host_s = {per_call:.3g} s per layer call, fsdp_bytes_s = {per_byte:.3g} s per byte per collective, "
          f"fsdp_collective_s = {per_collective:.3g} s per collective, fsdp_tensor_s = {per_tensor:.3g} s per tensor "
          f"(a sharded layer adds {', '.join(f'{s * 1e3:.2f} ms at {b} bytes' for b, s in zip(point.sizes, point.per_layer_s))}; "
          f"load {load:.1f})")


if __name__ == "__main__":
    main()
