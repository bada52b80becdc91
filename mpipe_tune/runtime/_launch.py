"""Starting ranks: a local spawner that watches its children, or the environment ``torchrun`` sets.

Backends by device: ``cpu`` -> gloo, ``cuda`` -> NCCL, ``npu`` -> HCCL through torch_npu, which is
imported only for ``npu``. Every device check runs before any process or process group exists.

The local spawner starts one process per rank from a fork server that has imported torch once, joins
them through a TCP store the parent holds on a free loopback port, and watches them: when one rank
raises or dies, the others are killed within seconds and :class:`RankFailed` names the rank that
failed first (a rank killed from outside before the peers that lost their connection to it). Each process group also has an operation timeout, so a rank blocked on a peer that
will never answer gives up on its own under ``torchrun`` too.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import sigint_blocked

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_KILL_GRACE_S = 2.0
_SETTLE_S = 0.5  # after a first failure, how long other ranks get to report their own


# Imported once by the fork server instead of once per rank. The first backward from an explicit
# output gradient imports torch's symbolic shapes (and sympy): about 2 s per process otherwise.
_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "mpipe_tune.runtime._worker"]


class RankFailed(RuntimeError):
    """A rank raised or died; the message names it, ``details`` holds its traceback when known."""

    details: str = ""
    user_error: bool = False
    """The rank raised an :class:`MpipeError` (bad input found at run time, e.g. ranks that disagree
    on a step's owner map): the message is its one line, and there is no traceback to show."""


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device_kind: str
    backend: str

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.device_kind == "cpu" else torch.device(self.device_kind, self.local_rank)


def disable_backend_autoload() -> None:
    """Keep an installed but broken device plugin (torch_npu) from breaking ``import torch``; the npu
    device imports torch_npu explicitly instead. Must run before torch is first imported."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def require_torch(what: str) -> None:
    """One line when torch is not installed (the planner runs without it; running a plan does not)."""
    if importlib.util.find_spec("torch") is None:
        raise MpipeError(f"{what} needs torch, which is not installed; install it with pip install 'mpipe-tune[torch]' "
                         f"(on a CPU-only machine install the CPU build of torch first)")


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_world_size() -> int:
    return torchrun_place().world_size


def check_device(device_kind: str, local_ranks: int) -> None:
    """One-line errors for a device this host cannot give ``local_ranks`` ranks."""
    if device_kind not in BACKENDS:
        raise MpipeError(f"device kind {device_kind!r} is unknown; use one of {', '.join(BACKENDS)}", quantities=("device kind",))
    if device_kind == "cpu":
        return
    import torch

    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise MpipeError("device kind cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
                             "use device kind cpu", quantities=("device kind",))
        if torch.cuda.device_count() < local_ranks:
            raise MpipeError(f"device kind cuda: {local_ranks} local ranks need one GPU each but "
                             f"{torch.cuda.device_count()} are visible; NCCL cannot put two ranks on one GPU", quantities=("device kind",))
    elif device_kind == "npu":
        _import_torch_npu()
        if not torch.npu.is_available() or torch.npu.device_count() < local_ranks:
            raise MpipeError(f"device kind npu: torch_npu sees {torch.npu.device_count()} Ascend NPU(s) but {local_ranks} "
                             f"local ranks need one each; check the CANN driver and ASCEND_RT_VISIBLE_DEVICES", quantities=("device kind",))


def torchrun_place():
    """This process's place under torchrun (a :class:`~mpipe_tune.runtime._torchrun_env.NodePlace`), checked for
    consistency before any rendezvous. A plain ``env://`` launch that sets only ``RANK``, ``WORLD_SIZE`` and the
    master's address is one node holding the whole world."""
    from mpipe_tune.runtime._torchrun_env import place_from_env

    env = dict(os.environ)
    env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    env.setdefault("LOCAL_RANK", env["RANK"])
    numbers = env["RANK"].isascii() and env["RANK"].isdigit() and env["LOCAL_WORLD_SIZE"].isascii() and env["LOCAL_WORLD_SIZE"].isdigit()
    env.setdefault("GROUP_RANK", str(int(env["RANK"]) // max(1, int(env["LOCAL_WORLD_SIZE"]))) if numbers else "0")
    return place_from_env(env)


def local_ranks(world_size: int) -> list[int]:
    """Global ranks on this host: all of them for the local spawner, this node's block under torchrun."""
    if not under_torchrun():
        return list(range(world_size))
    place = torchrun_place()
    first = place.rank - place.local_rank
    return list(range(first, min(world_size, first + place.local_world_size)))


def process_bytes() -> float:
    """This process's resident size with torch imported: about what each rank process holds before it
    builds anything (Linux ``/proc/self/status``; 0 where that cannot be read, or without torch, which
    :func:`require_torch` reports)."""
    if importlib.util.find_spec("torch") is None:
        return 0.0
    import torch  # noqa: F401  (a rank imports it first thing)

    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib * 1024.0
    except (OSError, StopIteration, ValueError):
        return 0.0


def available_memory(device_kind: str) -> tuple[float, bool, str]:
    """(bytes available, shared by the local ranks?, what it is) of the device ranks run on.

    CPU: the host's available memory (``MemAvailable``), which every local rank shares. CUDA / NPU:
    the free memory of the first visible device (every rank has a device of its own)."""
    if device_kind == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            return kib * 1024.0, True, "this host"
        except (OSError, StopIteration, ValueError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), True, "this host"
    import torch

    free, _total = (torch.npu if device_kind == "npu" else torch.cuda).mem_get_info(0)
    return float(free), False, f"{device_kind} device 0"


_NATIVE_CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def dtype_note(device_kind: str, dtype: str) -> str | None:
    """One line when ``dtype`` is missing or known to be slow on the device, else ``None``."""
    if device_kind == "cpu" and dtype in _NATIVE_CPU_FLAGS:
        try:
            with open("/proc/cpuinfo") as f:
                flags = set(next((line for line in f if line.startswith("flags")), "").split())
        except OSError:
            flags = set()
        if not flags & set(_NATIVE_CPU_FLAGS[dtype]):
            return (f"{dtype} on this CPU: no native {dtype} matmul ({' or '.join(_NATIVE_CPU_FLAGS[dtype])} not in "
                    f"/proc/cpuinfo), so torch emulates it, often many times slower than fp32; the prediction holds only "
                    f"if the profile measured {dtype} here (plan with dtype fp32, or run with dtype fp32 to time fp32)")
        return None
    if device_kind == "cuda" and dtype == "bf16":
        import torch

        if not torch.cuda.is_bf16_supported():
            return "bf16 on this GPU: not supported natively (torch.cuda.is_bf16_supported() is False); use dtype fp16 or fp32"
    return None


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity where the OS tells it, else the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS
        return os.cpu_count() or 1


def shared_cores_note(device_kind: str, ranks: int, fix: str) -> str | None:
    """One line when ``ranks`` local CPU ranks outnumber the cores they may run on (they take turns, and the
    operating system's time-slicing, which no profile or prediction prices, enters every timing), with ``fix``;
    else ``None``."""
    cores = usable_cores()
    if device_kind != "cpu" or ranks <= cores:
        return None
    return (f"{ranks} CPU ranks on {cores} cores: the ranks take turns on the cores, so every time measured carries "
            f"the operating system's time-slicing, which no profile or prediction prices; {fix}")


def _import_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401  (registers the npu device and HCCL)
    except Exception as exc:  # any failure of a binary plugin: missing, ABI mismatch, no CANN
        detail = (str(exc).strip().splitlines() or [""])[0][:160]
        raise MpipeError(
            f"device kind npu: torch_npu is not usable ({type(exc).__name__}: {detail}); install the torch_npu "
            f"build matching this torch and the Ascend CANN toolkit (if a broken torch_npu breaks 'import torch', set "
            f"TORCH_DEVICE_BACKEND_AUTOLOAD=0)", quantities=("device kind",)
        ) from None


def _init_rank(rank: int, world_size: int, local_rank: int, device_kind: str, timeout_s: float, store=None,
               place=None) -> RankContext:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device_kind == "npu":
        _import_torch_npu()
        torch.npu.set_device(local_rank)
    elif device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    backend = BACKENDS[device_kind]
    if place is not None:  # torchrun's env:// rendezvous, bounded, one line when peers never come
        from mpipe_tune.runtime._torchrun_env import join_env_world

        join_env_world(dist, backend, place, timeout_s)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                store=store)
    return RankContext(rank, world_size, local_rank, device_kind, backend)


def run_under_torchrun(fn: Callable[..., Any], args: tuple, device_kind: str, *, timeout_s: float) -> Any:
    """Run ``fn(ctx, *args)`` as the rank ``torchrun`` started; returns its result (rank 0's matters)."""
    import torch.distributed as dist

    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (see _PRELOAD: keep it out of the first step)

    place = torchrun_place()
    rank = place.rank
    ctx = _init_rank(rank, place.world_size, place.local_rank, device_kind, timeout_s, place=place)
    try:
        return fn(ctx, *args)
    except MpipeError as exc:
        error = RankFailed(f"rank {rank}: {_first_line(exc)}")
        error.user_error = True
        raise error from exc
    except Exception as exc:
        error = RankFailed(f"rank {rank} failed: {type(exc).__name__}: {_first_line(exc)}")
        error.details = traceback.format_exc()
        raise error from exc
    finally:
        dist.destroy_process_group()


def launch_local(
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    device_kind: str = "cpu",
    *,
    timeout_s: float = 300.0,
    deadline_s: float | None = None,
) -> Any:
    """Run ``fn(ctx, *args)`` on ``world_size`` local ranks and return rank 0's result.

    ``fn`` must be importable by name (a module-level function). ``timeout_s`` bounds each collective
    and transfer, and the start: joining the store and the process group. ``deadline_s``, when given,
    bounds the run from the moment every rank has joined (so that a slow start on a loaded host does
    not count against the work); the ranks whose ``fn`` had not returned by then are named and killed.
    Raises :class:`RankFailed`.
    """
    import torch.distributed as dist

    disable_backend_autoload()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="mpipe-run-") as scratch:
        procs = [
            context.Process(
                target=_child_main,
                args=(rank, world_size, store.port, device_kind, timeout_s, scratch, fn, args),
                name=f"mpipe-rank{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            with sigint_blocked():  # inherited by the fork server and the ranks: a Ctrl-C while they start up
                for p in procs:     # (the fork server imports torch) cannot end them with a traceback
                    p.start()
        except BaseException:  # a Ctrl-C that came meanwhile: the ranks started after it never saw it
            _kill([p for p in procs if p.pid is not None])
            raise
        _watch(procs, scratch, deadline_s, timeout_s)
        result_file = Path(scratch) / "result.pkl"
        return pickle.loads(result_file.read_bytes()) if result_file.exists() else None


def _watch(procs: list, scratch: str, deadline_s: float | None, timeout_s: float) -> None:
    """Wait for every rank; on a first failure, give the others ``_SETTLE_S`` to report theirs, then
    kill the rest and raise. The deadline clock starts once every rank has joined the process group
    (its ``joined`` mark, or its exit); starting is bounded by twice ``timeout_s`` (the ranks' own
    store and process-group timeouts normally end a start that hangs before that). At the deadline,
    the ranks whose work had not returned (no ``returned`` mark) are named; ranks that returned and
    are only exiting get ``timeout_s`` more."""
    launched = time.monotonic()
    started: float | None = None
    alive = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
    failures: list[tuple[float, int, str, str]] = []
    first_seen = 0.0
    try:
        while alive:
            if failures and time.monotonic() >= first_seen + _SETTLE_S:
                break
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.1 if failures else 0.25):
                rank, p = alive.pop(sentinel)
                p.join()
                if p.exitcode != 0:
                    first_seen = first_seen or time.monotonic()
                    failures.append(_failure_of(rank, p.exitcode, scratch))
            if deadline_s is None or failures:
                continue
            now = time.monotonic()
            ranks = sorted(rank for rank, _ in alive.values())
            if started is None:
                if all(_marked(scratch, rank, "joined") for rank in ranks):
                    started = now
                elif now - launched > 2 * timeout_s:
                    waiting = [rank for rank in ranks if not _marked(scratch, rank, "joined")]
                    raise RankFailed(f"rank(s) {waiting} had not joined the process group {2 * timeout_s:g} s after "
                                     f"the launch and were killed")
                continue
            if now - started > deadline_s:
                working = [rank for rank in ranks if not _marked(scratch, rank, "returned")]
                if working or now - started > deadline_s + timeout_s:
                    raise RankFailed(f"the run passed its deadline of {deadline_s:g} s; rank(s) {working or ranks} "
                                     f"were still running and were killed")
    finally:
        _kill([p for _, p in alive.values()])
    if failures:
        # A rank that died without raising (a signal from outside) is the cause when it is among the
        # failures: the others' errors are its peers losing their connections to it, and they may
        # carry earlier times than the moment its death was noticed.
        _when, _rank, message, details, user_error = min(failures, key=lambda f: (bool(f[3]), f[0]))
        others = len(failures) - 1
        error = RankFailed(message + (f" ({others} other rank(s) failed after it)" if others else ""))
        error.details, error.user_error = details, user_error
        raise error


def _marked(scratch: str, rank: int, what: str) -> bool:
    return (Path(scratch) / f"rank{rank}.{what}").exists()


def _mark(scratch: str, rank: int, what: str) -> None:
    (Path(scratch) / f"rank{rank}.{what}").touch()


def _failure_of(rank: int, exitcode: int, scratch: str) -> tuple[float, int, str, str, bool]:
    """(when, rank, one-line message, traceback, a user error?) of a rank that exited non-zero."""
    error_file = Path(scratch) / f"rank{rank}.err"
    if error_file.exists():
        when, kind, line, details = error_file.read_text().split("\n", 3)
        return float(when), rank, line, details, kind == "user"
    how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"
    if exitcode == -9:  # SIGKILL from outside: on a host this is most often the out-of-memory killer
        how += (" (most often the kernel's out-of-memory killer: check the plan's predicted memory with "
                "'mpipe-tune show', or plan for a smaller workload such as the 'smoke' mix)")
    return time.time(), rank, f"rank {rank} died: its process {how}", "", False


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _child_main(rank, world_size, port, device_kind, timeout_s, scratch, fn, args) -> None:
    import torch.distributed as dist

    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked from the start: a Ctrl-C now ends here
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=timeout_s))
        ctx = _init_rank(rank, world_size, rank, device_kind, timeout_s, store)
        _mark(scratch, rank, "joined")
        result = fn(ctx, *args)
        _mark(scratch, rank, "returned")
        if rank == 0:
            tmp = Path(scratch) / "result.pkl.tmp"
            tmp.write_bytes(pickle.dumps(result))
            tmp.rename(Path(scratch) / "result.pkl")
        dist.destroy_process_group()
    except MpipeError as exc:  # bad input found at run time: its one line, no traceback
        (Path(scratch) / f"rank{rank}.err").write_text(f"{time.time()}\nuser\nrank {rank}: {_first_line(exc)}\n")
        _exit(1)
    except BaseException as exc:
        message = f"rank {rank} failed: {type(exc).__name__}: {_first_line(exc)}"
        (Path(scratch) / f"rank{rank}.err").write_text(f"{time.time()}\nerror\n{message}\n{traceback.format_exc()}")
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    """End a rank process at once (no interpreter shutdown, which can wait on the backend's threads), after
    multiprocessing's exit finalizers: they release the semaphores the rank made (tqdm's write lock, when
    it read a dataset), which the resource tracker otherwise reports as leaked when the run ends."""
    multiprocessing.util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
