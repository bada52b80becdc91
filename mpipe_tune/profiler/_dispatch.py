"""The host's cost of issuing work: seconds per small operator (``dispatch_s``) and per device sync (``sync_s``).

A chain of ``n`` tiny operators (``y = y + c`` on a one-element tensor: each allocates its output and
depends on the one before, as a layer's small kernels do) is issued back to back and timed on the host
(``time.perf_counter``) without waiting for the device: on an accelerator the queue runs ahead and the
host's time is what it took to issue them; on CPU eager torch each operator runs on the issuing thread,
so it is the per-operator overhead of a chain of tiny ones. The same chain with a device-to-host read
after every operator (``y.item()``: the copy back and the wait for the queue to drain, as a loss read
or a MoE token count does) gives the sync: its extra seconds per operator over the plain chain.

Each chain length is timed ``repeats`` times from an empty queue; ``t = a + b n`` is fitted to the
medians (relative error, both >= 0, :func:`~mpipe_tune.profiler._fit.fit_nonnegative_line`), and the
slope ``b`` is the per-operator figure (``a`` is the timer's and the loop's fixed cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mpipe_tune.profiler._fit import AlphaBetaFit, fit_alpha_beta
from mpipe_tune.profiler._stats import Spread, summarize


@dataclass(frozen=True)
class ChainSweep:
    """One chain's timings: host seconds of the whole chain, per length, over repeats."""

    lengths: tuple[int, ...]
    seconds: tuple[Spread, ...]

    def fit(self) -> AlphaBetaFit:
        """``t = fixed + per_op * n`` fitted to the medians (``beta_s_per_byte`` is the seconds per operator)."""
        return fit_alpha_beta(self.lengths, [s.median for s in self.seconds])


@dataclass(frozen=True)
class HostSweep:
    """The chain without syncs and the chain with a sync after every operator."""

    plain: ChainSweep
    synced: ChainSweep

    @property
    def dispatch_s(self) -> float:
        return self.plain.fit().beta_s_per_byte

    @property
    def sync_s(self) -> float:
        """Extra seconds of a sync over the operator it follows (0 where the two chains cannot be told apart)."""
        return max(0.0, self.synced.fit().beta_s_per_byte - self.dispatch_s)


def measure_host(torch: ModuleType, device: str, lengths: tuple[int, ...], repeats: int,
                 progress: Callable[[str], None]) -> HostSweep:
    """Time both chains at every length (interleaved, so a drift of the host's speed hits both alike);
    ``progress`` is called once per length."""
    x = torch.zeros(1, device=device)
    c = torch.ones(1, device=device)
    sync = getattr(torch, device).synchronize if device != "cpu" else (lambda: None)

    def chain(n: int, read: bool) -> float:
        sync()
        begin = time.perf_counter()
        y = x
        for _ in range(n):
            y = y + c
            if read:
                y.item()
        elapsed = time.perf_counter() - begin
        sync()
        return elapsed

    for n in lengths[:2]:  # warm-up: the allocator's first blocks, the first kernel loads
        chain(n, False), chain(n, True)
    plain, synced = [], []
    for n in lengths:
        times = [(chain(n, False), chain(n, True)) for _ in range(repeats)]
        plain.append(summarize([t for t, _ in times]))
        synced.append(summarize([t for _, t in times]))
        progress(f"dispatch chain {n}")
    return HostSweep(ChainSweep(tuple(lengths), tuple(plain)), ChainSweep(tuple(lengths), tuple(synced)))


def host_entries(sweep: HostSweep, measured: Mapping[str, str], device: str, how: str = "") -> dict[str, Any]:
    """The profile's ``host`` table: ``dispatch_s`` and ``sync_s`` with the chains behind them, and on CPU
    ``issue: inline`` (the cost model adds a pass's issue time to its device time rather than overlapping them)."""
    plain, synced = sweep.plain.fit(), sweep.synced.fit()
    chains = {"chain_lengths": list(sweep.plain.lengths), "repeats": sweep.plain.seconds[0].num_repeats}
    issue = ("issued without waiting for the device (host seconds, the queue runs ahead)" if device != "cpu"
             else "on CPU eager torch each runs on the issuing thread: the per-operator overhead")
    return {
        **({"issue": "inline"} if device == "cpu" else {}),  # eager CPU torch runs each operator as it is issued
        "dispatch_s": {
            "value": sweep.dispatch_s, **measured,
            "ref": f"chains of tiny operators (y = y + c on a one-element {device} tensor, each allocating its "
                   f"output and depending on the one before) {issue}; t = fixed + dispatch_s * n fitted to the "
                   f"median host seconds per chain length n (relative error); fit_r2 is the R^2 of log(time){how}",
            "fit_r2": plain.fit_r2, **chains,
            "median_s": [s.median for s in sweep.plain.seconds], "iqr_s": [s.iqr for s in sweep.plain.seconds],
        },
        "sync_s": {
            "value": sweep.sync_s, **measured,
            "ref": f"the same chains with a device-to-host read (y.item()) after every operator, timed "
                   f"interleaved with them: the slope fitted the same way minus dispatch_s (the extra seconds "
                   f"of a sync that drains the queue){how}",
            "fit_r2": synced.fit_r2, "synced_op_s": synced.beta_s_per_byte, **chains,
            "median_s": [s.median for s in sweep.synced.seconds], "iqr_s": [s.iqr for s in sweep.synced.seconds],
        },
    }
