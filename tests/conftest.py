"""Shared test helpers: small explicit-cost models and uniform workloads."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from hypothesis import settings

from mpipe_tune.algebra import ExplicitCost, Layer, Model
from mpipe_tune.inputs import Microbatch, Workload

# A fast profile for local runs, a thorough one for CI (CI=true).
settings.register_profile("fast", max_examples=40, deadline=None)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile("thorough" if os.environ.get("CI") else "fast")

# A suite started in the background of a non-interactive shell inherits SIGINT ignored, and so would every
# command it starts: the Ctrl-C tests need Python's own handler, which a command it execs then gets too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def process_stats() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        yield int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])


def ctrl_c_after(args: list[str], line_start: str) -> tuple[int, str, str, int]:
    """Run ``args`` in a process group of its own, as a terminal runs a command; once its stderr says a line
    starting with ``line_start`` (the event the Ctrl-C waits for, not a sleep), send SIGINT to the whole
    group, as a terminal's Ctrl-C does, and wait for the end: exit code, stdout, all of stderr, and the
    group's id (the command's pid). Unbuffered pipes: the lines read first leave nothing unseen by the rest."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    said = b""
    try:
        for line in proc.stderr:
            said += line
            if line.decode(errors="replace").startswith(line_start):
                break
        else:
            raise AssertionError(f"the command ended before a line starting {line_start!r}: {said.decode()}")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=600)  # a hang guard, far above a loaded machine
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out.decode(), (said + err).decode(), proc.pid


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_module(name: str):
    """A fixture body: the benchmark script ``benchmarks/<name>.py`` imported as a module (the benchmarks folder on
    ``sys.path`` for its sibling imports, its name in ``sys.modules`` for its dataclasses), both undone after."""
    import importlib
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop(name, None)


def cli(*args: str) -> tuple[int, str, str]:
    """``mpipe_tune.cli.main(args)`` in-process: exit code, stdout, stderr (argparse's own errors exit 2 too). What
    the console entry point adds (start-up, signals) is tested through a subprocess where a test needs it."""
    from mpipe_tune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def make_model(blocks, fwd=1.0, bwd=2.0, trainable=None, name="test") -> Model:
    """One explicit-cost layer per entry of ``blocks`` (e.g. ["encoder", "encoder", "llm", ...])."""
    trainable = trainable or [True] * len(blocks)
    layers = tuple(
        Layer(f"{b}{i}", b, t, ExplicitCost(fwd, bwd)) for i, (b, t) in enumerate(zip(blocks, trainable))
    )
    return Model(name, layers)


def uniform_workload(num_microbatches: int, image_tokens: int = 1, text_tokens: int = 1) -> Workload:
    return Workload(tuple(Microbatch(image_tokens, text_tokens) for _ in range(num_microbatches)), "uniform")


def with_link(collective: str, link, profile=None):
    """``profile`` (default: ``ideal``) with ``collective`` costing ``link`` (a LinkCost) on both link
    classes, the rest unchanged."""
    from mpipe_tune.cost import load_profile, parse_profile

    data = (profile or load_profile("ideal")).to_dict()
    for link_class in ("intra_node", "inter_node"):
        data["links"][link_class][collective] = {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
                                                 "source": "ideal"}
    return parse_profile(data, where="test")


def candidate(cut, schedule, num_ranks: int, num_microbatches: int, *, slab_counts=None, owners=None, options=None):
    """The Candidate of a cut, a schedule and P, M, with the degrees, dtype and memory policy of the cost
    ``options`` (default: none), for tests written against the cost model's settings."""
    from mpipe_tune.algebra import Candidate
    from mpipe_tune.cost import CostOptions

    o = options or CostOptions()
    return Candidate(str(schedule), tuple(cut.boundaries), pp=num_ranks, tp=o.degrees.tp, dp=o.degrees.dp,
                     num_microbatches=num_microbatches, slab_counts=slab_counts, owner_map=owners,
                     recompute=o.recompute, ep=o.degrees.ep, cp=o.degrees.cp, zero_stage=o.zero_stage,
                     sequence_parallel=o.sequence_parallel, encoder_tp=o.degrees.encoder_tp, dtype=o.dtype,
                     reshard_after_forward=o.reshard_after_forward if o.zero_stage == 3 else None)


def predict_plan(cut, schedule, model, workload, profile, num_ranks: int, *, num_microbatches=None, slab_counts=None,
                 microbatch_owners=None, options=None):
    """``predict`` of :func:`candidate` on one workload (its length is M unless given); owners given
    for a schedule without a transpose region (which has no owners) are left out."""
    from mpipe_tune.cost import CostOptions, predict

    M = len(workload) if num_microbatches is None else num_microbatches
    if "transpose" not in str(schedule).split(","):
        microbatch_owners = None
    c = candidate(cut, schedule, num_ranks, M, slab_counts=slab_counts, owners=microbatch_owners, options=options)
    return predict(c, model, workload, profile, options or CostOptions())


def walked_peaks(deltas, makespan_s: float) -> list[float]:
    """Per rank, the largest running sum of its ``(instant, bytes)`` allocations and frees, in time order;
    instants equal up to rounding are one instant, frees first (as the cost model's memory pass)."""
    tick = 1e-12 * makespan_s
    peaks = []
    for rank_deltas in deltas:
        running, peak = 0.0, 0.0
        for _, d in sorted((round(time / tick), d) for time, d in rank_deltas):
            running += d
            peak = max(peak, running)
        peaks.append(peak)
    return peaks


def charged_s(result):
    """Per event of a prediction, its seconds with the sharding actions placed at it added (ZeRO-2 and
    ZeRO-3 resharding after forward, :mod:`mpipe_tune.cost._sharding_events`): the old folded durations."""
    return result.timeline.charged_s()
