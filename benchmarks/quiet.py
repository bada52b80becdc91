"""Other tenants' load on a shared machine: their CPU share over a window, and waiting for a quiet spell.

Used by ``bench_fidelity.py`` to keep real-compute measurements only when other jobs left the cores
alone.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path



class ForeignLoad:
    """CPU share taken by processes other than this one and its descendants over a window.

    The two cores are shared with other jobs (other sessions' tests and benchmarks, some in containers
    whose processes are not listed here). Foreign time = all busy time in ``/proc/stat`` minus the
    time of this process tree, sampled every ``period_s`` by a thread."""

    def __init__(self, period_s: float = 0.5) -> None:
        import threading

        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ticks = os.sysconf("SC_CLK_TCK")
        self.busy_s = self.own_s = self.total_s = 0.0

    @staticmethod
    def _machine() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields[:8]) - idle, sum(fields[:8])

    @staticmethod
    def _processes() -> dict[int, int]:
        """CPU ticks of this process and its descendants (their own, plus their reaped children's, so
        that a rank that exits between two samples is still counted, through its parent)."""
        parent, ticks = {}, {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(entry.path, "stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                pid = int(entry.name)
                parent[pid], ticks[pid] = int(fields[1]), sum(int(x) for x in fields[11:15])
        mine, me = {}, os.getpid()
        for pid in ticks:
            node = pid
            while node > 1 and node != me:
                node = parent.get(node, 0)
            if node == me:
                mine[pid] = ticks[pid]
        return mine

    def _run(self) -> None:
        busy0, total0 = self._machine()
        seen = self._processes()
        while not self._stop.wait(self.period_s):
            busy, total = self._machine()
            now = self._processes()
            # A process that ended was reaped by its parent (in this tree), whose children's ticks now
            # hold its whole time: take back what was counted of it while it lived.
            own = sum(t - seen.get(pid, 0) for pid, t in now.items()) - sum(t for pid, t in seen.items() if pid not in now)
            self.busy_s += (busy - busy0) / self._ticks
            self.total_s += (total - total0) / self._ticks
            self.own_s += max(0, own) / self._ticks
            busy0, total0, seen = busy, total, now

    def __enter__(self) -> "ForeignLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def share(self) -> float:
        """Foreign CPU time over all CPU time (0.5 = one of two cores taken)."""
        return max(0.0, self.busy_s - self.own_s) / self.total_s if self.total_s else 0.0


def wait_for_quiet(threshold: float, max_wait_s: float, window_s: float = 3.0) -> tuple[float, float]:
    """Wait until other tenants take less than ``threshold`` of the CPU over a window (or give up after
    ``max_wait_s``); returns (the last window's foreign share, seconds waited)."""
    started = time.perf_counter()
    while True:
        with ForeignLoad() as load:
            time.sleep(window_s)
        waited = time.perf_counter() - started
        if load.share < threshold or waited >= max_wait_s:
            return load.share, waited
        print(f"  other tenants take {load.share:.0%} of the CPU; waiting ({waited:.0f} s so far)", file=sys.stderr)
