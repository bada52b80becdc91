"""What every rank runs: read the plan, build its part, execute steps, gather the timings on rank 0.

:func:`run_jobs` is the function the launchers call (locally spawned or under ``torchrun``); it runs
one or more :class:`RunJob` in turn on the same process group, so a check of several plans with the
same P pays the process start-up once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpipe_tune.runtime.blueprint import blueprint, output_shape
from mpipe_tune.runtime.compute import EmulatedCompute, RealCompute
from mpipe_tune.runtime.executor import Executor
from mpipe_tune.runtime.job import RunJob
from mpipe_tune.runtime.launch import RankContext
from mpipe_tune.runtime.measure import chrome_trace, summary
from mpipe_tune.runtime.mesh import rank_mesh
from mpipe_tune.runtime.mllm import DTYPES, LayerStack
from mpipe_tune.runtime.plan_view import read_plan_file, validate_runnable
from mpipe_tune.runtime.transport import Transport

def run_jobs(ctx: RankContext, jobs: list[RunJob]) -> list[dict[str, Any]] | None:
    results = [run_job(ctx, job) for job in jobs]
    return results if ctx.rank == 0 else None


def run_job(ctx: RankContext, job: RunJob) -> dict[str, Any] | None:
    view = read_plan_file(job.plan_path, plan_name=job.plan_name, model_spec=job.model_spec)
    validate_runnable(view, ctx.world_size)
    device = ctx.device
    mesh = rank_mesh(view.layout, device.type)
    rank = mesh.pp_rank  # the pipeline rank whose order this process runs
    if job.compute == "real":
        specs = blueprint(view.model)
        dtype = DTYPES[job.dtype_for(view)]
        stack = LayerStack.build(specs, view.layers_of(rank), seed=job.seed, dtype=dtype, device=device,
                                 tp_mesh=mesh.tp_mesh)
        compute = RealCompute(view, mesh, stack, seed=job.seed, dtype=dtype, device=device, lr=job.lr)
        transport = Transport(view, rank, dtype=dtype, device=device, peer=mesh.peer,
                              shape_of=lambda t: output_shape(specs[t.boundary_layer], view.microbatches[t.mb]))
    else:
        compute = EmulatedCompute(view, mesh, device)
        transport = Transport(view, rank, dtype=torch.float64, device=device, shape_of=lambda t: (1,),
                              peer=mesh.peer, link_delay_s=lambda t: view.durations_s[t.index])
    transport.connect()
    executor = Executor(view, rank, compute, transport)
    records = []
    for step in range(job.steps):
        hook = None
        if job.grads_dir and step == 0:
            def hook() -> None:
                torch.save({"grads": compute.stack.named_gradients(), "losses": dict(compute.losses)},
                           Path(job.grads_dir) / f"rank{ctx.rank}.pt")
        records.append(executor.run_step(hook))
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(records, gathered, dst=0)
    if ctx.rank != 0:
        return None
    about = {"device": ctx.device_kind, "backend": ctx.backend, "compute": job.compute,
             "dtype": job.dtype_for(view) if job.compute == "real" else None, "world_size": ctx.world_size}
    result = {"summary": summary(view, gathered, **about)}
    if job.trace:
        result["trace"] = chrome_trace(view, gathered)
    return result
