"""Alpha-beta measurement: time point-to-point messages and collectives across ``nproc`` local processes.

The parent opens a TCPStore on a free loopback port (port 0, so no other program can take it in
between), spawns one worker per rank (gloo on CPU, NCCL on CUDA, HCCL on NPU; rank ``r`` uses device
``r``), and drives a progress callback from the workers' messages. Every worker sweeps the same
(collective, message size) points in the same order:

- ``p2p``: ping-pong between ranks 0 and 1; a call is a round trip and its time is halved;
- ``all_reduce``, ``all_gather``, ``reduce_scatter`` (from one flat buffer into each rank's share, as ZeRO's
  gradient reduce and FSDP2 call it), ``gather`` (to rank 0), ``scatter`` (from rank 0) and ``all_to_all``
  (``all_to_all_single``, equal shares): over all ranks.

For each size: warm-up calls, then one timed call whose slowest rank decides how many back-to-back
calls one repeat batches (so a repeat lasts at least ``min_repeat_s``). Then the repeats, each after a
barrier, with the sizes interleaved: pass 1 times every size once, pass 2 again, and so on. A repeat's
time is the slowest rank's, which is when the collective is done everywhere.

Sizes follow ``estimate_collective_s``: the message for ``p2p``, the reduced buffer for ``all_reduce``,
the full gathered buffer for the gathers and scatters (each rank holds ``size / g`` of it), the full buffer
before it is scattered for ``reduce_scatter`` (each rank keeps ``size / g``), and for
``all_to_all`` the buffer each rank sends from (``g`` shares of ``size / g``). Payloads are float32.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import random
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import mark, sigint_blocked
from mpipe_tune.profiler._device import BACKENDS, Timer, calls_for, import_torch, threads_per_process
from mpipe_tune.profiler._settings import SweepSettings

LINK_COLLECTIVES = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")
_ELEMENT_BYTES = 4
_DIST_TIMEOUT_S = 300
_MAX_CALLS = 256


@dataclass(frozen=True)
class LinkSweep:
    """The timings of one collective over a group: per message size, one time per repeat."""

    collective: str
    group_size: int
    sizes_bytes: tuple[int, ...]
    samples_s: tuple[tuple[float, ...], ...]


def payload_elements(collective: str, size_bytes: int, group_size: int) -> tuple[int, int]:
    """``(elements per rank, size in bytes as estimate_collective_s counts it)`` for a nominal message size.

    >>> payload_elements("all_reduce", 4096, 2), payload_elements("gather", 4, 2), payload_elements("gather", 4096, 4)
    ((1024, 4096), (1, 8), (256, 4096))
    """
    if collective in ("p2p", "all_reduce"):
        elements = max(1, size_bytes // _ELEMENT_BYTES)
        return elements, elements * _ELEMENT_BYTES
    elements = max(1, size_bytes // (_ELEMENT_BYTES * group_size))
    return elements, elements * _ELEMENT_BYTES * group_size


def measure_links(device: str, nproc: int, settings: SweepSettings, progress: Callable[[str], None],
                  *, timeout_s: float = 900.0) -> dict[str, LinkSweep]:
    """Spawn ``nproc`` workers and sweep every collective of :data:`LINK_COLLECTIVES` over them."""
    return run_ranks(device, nproc, _sweep_links, settings, what="link measurement", progress=progress,
                     timeout_s=timeout_s)


def _sweep_links(torch, dist, where: str, rank: int, nproc: int, device: str, settings: SweepSettings, messages):
    sweep = GroupSweep(torch, dist, where, Timer(torch, device), rank, tuple(range(nproc)), None, settings)
    return sweep.all_collectives(messages)


def run_ranks(device: str, nproc: int, body: Callable, argument: object, *, what: str,
              progress: Callable[[str], None], timeout_s: float):
    """Spawn ``nproc`` workers in one process group (gloo, NCCL or HCCL by ``device``), run
    ``body(torch, dist, where, rank, nproc, device, argument, messages)`` on each (a module-level function;
    ``messages`` on rank 0 only, else None: where its ``("progress", text)`` go) and return rank 0's result.
    A worker's failure, or no result after ``timeout_s``, is one line naming ``what`` was measured."""
    assert nproc >= 2, nproc
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=_DIST_TIMEOUT_S))
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    workers = [
        context.Process(target=_worker, args=(rank, nproc, device, store.port, body, argument, messages),
                        name=f"mpipe-tune-profile-rank{rank}", daemon=True)
        for rank in range(nproc)
    ]
    with sigint_blocked():  # inherited: a Ctrl-C while a worker starts up cannot end it with a traceback
        for worker in workers:
            worker.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                kind, payload = messages.get(timeout=1.0)
            except queue_module.Empty:
                failed = [(rank, w.exitcode) for rank, w in enumerate(workers) if w.exitcode not in (None, 0)]
                if failed:
                    raise MpipeError(f"{what}: worker rank {failed[0][0]} died with exit code "
                                     f"{failed[0][1]} before reporting; rerun, or lower the process count",
                                     quantities=("process count",)) from None
                if time.monotonic() > deadline:
                    raise MpipeError(f"{what}: no result after {timeout_s:.0f} s; check that "
                                     f"the {BACKENDS[device]} backend works on this host") from None
                continue
            if kind == "progress":
                mark("link")
                progress(payload)
            elif kind == "error":
                raise MpipeError(f"{what} failed on {payload}")
            else:
                result = payload
                break
        for worker in workers:
            worker.join(timeout=60)
        return result
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join()


def _worker(rank: int, nproc: int, device: str, port: int, body: Callable, argument: object, messages) -> None:
    # Ctrl-C is the parent's to handle (it terminates the workers); SIGINT was blocked from the fork on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        torch = import_torch(device)
        import torch.distributed as dist

        if device == "cpu":
            torch.set_num_threads(threads_per_process(nproc))
            where = "cpu"
        else:
            getattr(torch, device).set_device(rank)
            where = f"{device}:{rank}"
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=_DIST_TIMEOUT_S))
        bound = {} if device == "cpu" else {"device_id": torch.device(where)}
        dist.init_process_group(BACKENDS[device], store=store, rank=rank, world_size=nproc,
                                timeout=timedelta(seconds=_DIST_TIMEOUT_S), **bound)
        result = body(torch, dist, where, rank, nproc, device, argument, messages if rank == 0 else None)
        if rank == 0:
            messages.put(("result", result))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent as one line, which ends the run
        last = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[0]
        messages.put(("error", f"rank {rank}: {last}"))
        raise SystemExit(1) from None


class GroupSweep:
    """One rank's side of the sweep over a group of ranks; every member calls the same methods in the
    same order. ``members`` are the group's global ranks (``p2p`` pairs the first two), ``group`` its
    process group (None: the whole world)."""

    def __init__(self, torch, dist, where: str, timer: Timer, rank: int, members: tuple[int, ...], group,
                 settings: SweepSettings) -> None:
        assert rank in members and len(members) >= 2, (rank, members)
        self.torch, self.dist, self.where, self.timer = torch, dist, where, timer
        self.rank, self.members, self.group, self.settings = rank, members, group, settings
        self.nproc = len(members)

    def all_collectives(self, messages) -> dict[str, LinkSweep]:
        """Every collective of :data:`LINK_COLLECTIVES`, in order (``messages``: where progress goes, or None)."""
        return {collective: self.collective(collective, messages) for collective in LINK_COLLECTIVES}

    def collective(self, collective: str, messages) -> LinkSweep:
        group_size = 2 if collective == "p2p" else self.nproc
        points: dict[int, Callable[[], object]] = {}
        for nominal in self.settings.message_sizes_bytes:
            elements, size_bytes = payload_elements(collective, nominal, group_size)
            if size_bytes not in points:
                points[size_bytes] = self._op(collective, elements)
        calls = {size: self._calibrate(op) for size, op in points.items()}
        samples: dict[int, list[float]] = {size: [] for size in points}
        # Repeats are the outer loop and each pass visits the sizes in a fresh order (seeded by the pass,
        # so the same on every rank): a slow spell of the host, or the progress message that starts a
        # pass, spreads over all sizes instead of bending the line at a few of them.
        for repeat in range(self.settings.link_repeats):
            order = list(points)
            random.Random(repeat).shuffle(order)
            for size in order:
                self._barrier()
                samples[size].append(self.timer.seconds_per_call(points[size], calls[size]))
            if messages is not None:
                messages.put(("progress", f"{collective} repeat {repeat + 1}"))
        halve = 2 if collective == "p2p" else 1  # a p2p call is a round trip
        slowest = self._slowest([t / halve for size in points for t in samples[size]])
        repeats = self.settings.link_repeats
        per_size = tuple(tuple(slowest[i * repeats:(i + 1) * repeats]) for i in range(len(points)))
        return LinkSweep(collective, group_size, tuple(points), per_size)

    def _op(self, collective: str, elements: int) -> Callable[[], object]:
        torch, dist, rank, g, group = self.torch, self.dist, self.rank, self.nproc, self.group
        first, second = self.members[:2]

        def zeros(n: int):
            return torch.zeros(n, dtype=torch.float32, device=self.where)

        x = zeros(elements)
        if collective == "p2p":
            y = zeros(elements)
            if rank == first:
                return lambda: (dist.send(x, second), dist.recv(y, second))
            if rank == second:
                return lambda: (dist.recv(y, first), dist.send(x, first))
            return lambda: None
        if collective == "all_reduce":
            return lambda: dist.all_reduce(x, group=group)
        if collective == "all_to_all":
            sent, received = zeros(elements * g), zeros(elements * g)
            return lambda: dist.all_to_all_single(received, sent, group=group)
        if collective == "reduce_scatter":  # from one flat buffer, as ZeRO's gradient reduce and FSDP2 run it
            from mpipe_tune.runtime import REDUCE_SCATTER_FROM as scatter

            full = zeros(elements * g)
            return lambda: scatter(x, full, group=group)
        parts = [zeros(elements) for _ in range(g)]
        if collective == "all_gather":
            return lambda: dist.all_gather(parts, x, group=group)
        if collective == "gather":
            return lambda: dist.gather(x, gather_list=parts if rank == first else None, dst=first, group=group)
        assert collective == "scatter", collective
        return lambda: dist.scatter(x, scatter_list=parts if rank == first else None, src=first, group=group)

    def _calibrate(self, op: Callable[[], object]) -> int:
        """Warm ``op`` up, then return how many back-to-back calls make one repeat (same on every rank)."""
        self._barrier()
        for _ in range(max(1, self.settings.warmup)):
            op()
        self._barrier()
        first = self._slowest([self.timer.seconds_per_call(op)])[0]
        return calls_for(first, self.settings.min_repeat_s, _MAX_CALLS)

    def _barrier(self) -> None:
        """All ranks here, and nothing of theirs still queued on the device, before a timed repeat."""
        self.dist.barrier(group=self.group)
        self.timer.synchronize()

    def _slowest(self, times: list[float]) -> list[float]:
        values = self.torch.tensor(times, dtype=self.torch.float32, device=self.where)
        self.dist.all_reduce(values, op=self.dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in values.tolist()]
