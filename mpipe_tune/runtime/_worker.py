"""What every rank runs: read the plan, build its part, execute steps, gather the timings on rank 0.

:func:`run_jobs` is the function the launchers call (locally spawned or under ``torchrun``); it runs
one or more :class:`RunJob` in turn on the same process group, so a check of several plans with the
same P pays the process start-up once. Before each step every rank builds the step's plan
(:class:`~mpipe_tune.runtime._steps.StepPlanner`: its microbatches and owner map) and, unless the run
is the stored plan as it is, checks with :func:`validate_agreement` that all ranks built the same one.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpipe_tune.errors import MpipeError
from mpipe_tune.runtime._blueprint import blueprint, output_shape, validate_workload
from mpipe_tune.runtime._compute import EmulatedCompute, RealCompute
from mpipe_tune.runtime._executor import Executor
from mpipe_tune.runtime._experts import ExpertShard
from mpipe_tune.runtime._full_shard import is_fully_sharded, shard_layers
from mpipe_tune.runtime._job import RunJob
from mpipe_tune.runtime._launch import RankContext
from mpipe_tune.runtime._measure import chrome_trace, summary
from mpipe_tune.runtime._mesh import rank_mesh
from mpipe_tune.runtime._mllm import DTYPES, LayerStack
from mpipe_tune.runtime._plan_view import read_plan_file, validate_runnable
from mpipe_tune.runtime._ring_attention import Ring
from mpipe_tune.runtime._sequence_split import ContextSplit
from mpipe_tune.runtime._steps import StepPlanner, resolve_modes
from mpipe_tune.runtime._transport import Transport


def run_jobs(ctx: RankContext, jobs: list[RunJob]) -> list[dict[str, Any]] | None:
    results = [run_job(ctx, job) for job in jobs]
    return results if ctx.rank == 0 else None


def run_job(ctx: RankContext, job: RunJob, after_step: Callable[[int], None] | None = None) -> dict[str, Any] | None:
    """Run ``job`` on this rank; rank 0 returns its result. ``after_step(step)``, when given, is called
    on every rank after each step, outside the timed steps (each step starts after a barrier)."""
    view = read_plan_file(job.plan_path, plan_name=job.plan_name, model_spec=job.model_spec)
    validate_runnable(view, ctx.world_size, job.compute)
    modes = resolve_modes(view, job.owners, job.data)
    device = ctx.device
    mesh = rank_mesh(view.layout, device.type)
    rank = mesh.pp_rank  # the pipeline rank whose order this process runs
    if job.compute == "real":
        specs = blueprint(view.model)
        planner = StepPlanner(view, modes, profile_spec=job.profile_spec,
                              validate_microbatches=lambda microbatches: validate_workload(specs, microbatches))
        dtype = DTYPES[job.dtype_for(view)]
        shard = None if mesh.ep_group is None else ExpertShard(
            mesh.ep_group, view.layout.expert_coordinates(ctx.rank)[2], view.layout.ep)
        sequence_parallel = view.candidate.sequence_parallel and view.layout.tp > 1
        shards = view.layout.tp if sequence_parallel else 1
        ring = None if mesh.cp_group is None else Ring(
            ContextSplit(view.layout.cp, mesh.cp_rank), mesh.cp_group, mesh.cp_neighbour(1), mesh.cp_neighbour(-1))
        stack = LayerStack.build(specs, planner.held_layers(rank), seed=job.seed, dtype=dtype, device=device,
                                 tp_mesh=mesh.tp_mesh, expert_shard=shard, encoder_tp_mesh=mesh.encoder_tp_mesh,
                                 encoder_end=view.model.encoder_end, ring=ring, sequence_parallel=sequence_parallel)
        if is_fully_sharded(view.candidate.zero_stage, mesh):
            shard_layers(stack.modules, mesh, reshard_after_forward=view.candidate.reshards_after_forward,
                         sync_once=view.candidate.zero_stage == 3 and not view.candidate.reshards_after_forward)
        compute = RealCompute(view, mesh, stack, seed=job.seed, dtype=dtype, device=device, lr=job.lr)
        context = None if ring is None else ring.split
        transport = Transport(view, rank, dtype=dtype, device=device, peer=mesh.peer, pairs=planner.rank_pairs(),
                              shape_of=lambda v, t: output_shape(specs[t.boundary_layer], v.microbatches[t.mb], context,
                                                                 shards))
    else:
        planner = StepPlanner(view, modes, profile_spec=job.profile_spec)
        compute = EmulatedCompute(view, mesh, device)
        transport = Transport(view, rank, dtype=torch.float64, device=device, shape_of=lambda v, t: (1,),
                              peer=mesh.peer, pairs=planner.rank_pairs(),
                              link_delay_s=lambda v, t: v.durations_s[t.index])
    transport.connect()
    executor = Executor(view, rank, compute, transport)
    records, steps = [], []
    started, cpu_started = time.perf_counter(), time.process_time()
    with frozen_heap():
        for step in range(job.steps):
            step_plan = planner.plan(step)
            if not modes.is_stored_plan:
                validate_agreement(step_plan.key, f"step {step}'s microbatch metadata and owner map", device)
            hook = None
            if job.grads_dir and step == 0:
                def hook() -> None:
                    compute.restore_gradients()
                    torch.save({"grads": compute.stack.named_gradients(), "losses": dict(compute.losses)},
                               Path(job.grads_dir) / f"rank{ctx.rank}.pt")
            records.append(executor.run_step(hook, step_plan.view))
            steps.append(step_plan)
            if after_step is not None:
                after_step(step)
            if job.progress:  # every rank: the step's time is its slowest rank's
                step_s = slowest_s(records[-1].end - records[-1].start, device)
                if ctx.rank == 0:
                    print(f"mpipe-tune run: step {step + 1}/{job.steps} done in {step_s * 1e3:.1f} ms (predicted "
                          f"{step_plan.view.predicted_step_s * 1e3:.1f} ms), {time.perf_counter() - started:.1f} s in",
                          file=sys.stderr, flush=True)
    cpu_s = time.process_time() - cpu_started  # this rank's CPU seconds over its steps (every thread)
    if job.weights_dir and job.compute == "real":
        torch.save(compute.stack.held_weights(), Path(job.weights_dir) / f"rank{ctx.rank}.pt")
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object((records, cpu_s), gathered, dst=0)
    if ctx.rank != 0:
        return None
    gathered, steps_cpu_s = [g[0] for g in gathered], [g[1] for g in gathered]
    about = {"device": ctx.device_kind, "backend": ctx.backend, "compute": job.compute,
             "dtype": job.dtype_for(view) if job.compute == "real" else None, "world_size": ctx.world_size,
             "owners": modes.owners, "data": modes.data, "policy": view.candidate.owner_policy,
             "steps_cpu_s": steps_cpu_s}
    views = [p.view for p in steps]
    result = {"summary": summary(view, gathered, per_step=[p.record() for p in steps], views=views, **about)}
    if job.trace:
        result["trace"] = chrome_trace(views, gathered)
    return result


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Everything alive on entry (the imported modules, the built layers, the process groups) is kept
    out of the garbage collector's passes until exit (:func:`gc.freeze`): a full pass over torch's
    few hundred thousand objects takes a few hundred milliseconds on a CPU, and it would land inside
    whichever timed step happened to trigger it. Objects made inside are collected as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def slowest_s(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (one all-reduce, outside any timed step)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


def validate_agreement(key: int, what: str, device: torch.device) -> None:
    """Every rank holds the same ``key`` (a 63-bit digest of ``what``), checked with one all-reduce of
    ``(key, -key)`` under MAX (the largest key and the negated smallest); a one-line
    :class:`MpipeError` on every rank when they differ."""
    both = torch.tensor([key, -key], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    highest, lowest = int(both[0]), -int(both[1])
    if highest != lowest:
        raise MpipeError(f"the ranks disagree on {what} (digests from {lowest:016x} to {highest:016x}, this rank's "
                         f"{key:016x}); every rank must run the same plan file and draw the same step metadata")
