"""The Ctrl-C tests again and again, under whatever load the machine has: how many runs in a row passed.

    python benchmarks/interrupt_loop.py [RUNS] [-- PYTEST-ARGS...]

Default: 20 runs of issue 41's interrupt tests (a Ctrl-C at the entry point's first line, among the commands'
imports, 0.1 s after start, and twice while the trial writer starts), each run one pytest process. Prints one line
per run and a summary with the load average (skipped cases counted apart). Record the summary in docs/testing.md
("Interrupts under load").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

DEFAULT = ["tests/test_interrupt.py", "-k", "entry_point or tenth_of_a_second or writer_starts"]


def main() -> int:
    args = sys.argv[1:]
    runs = int(args.pop(0)) if args and args[0].isdigit() else 20
    pytest_args = args[args.index("--") + 1:] if "--" in args else DEFAULT
    passed_in_a_row = skipped = 0
    loads = []
    start = time.time()
    for run in range(1, runs + 1):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *pytest_args],
                              capture_output=True, text=True)
        loads.append(os.getloadavg()[0])
        summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
        skipped += sum(int(n) for n in re.findall(r"(\d+) skipped", summary))
        print(f"run {run}: exit {done.returncode}: {summary}", flush=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], file=sys.stderr)
            break
        passed_in_a_row += 1
    print(f"{passed_in_a_row} of {runs} runs passed in a row ({skipped} skipped cases), {time.time() - start:.0f} s, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    return 0 if passed_in_a_row == runs else 1


if __name__ == "__main__":
    sys.exit(main())
