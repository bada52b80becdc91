"""What every rank runs: read the plan, build its part, execute steps, gather the timings on rank 0.

:func:`run_jobs` is the function the launchers call (locally spawned or under ``torchrun``); it runs
one or more :class:`RunJob` in turn on the same process group, so a check of several plans with the
same P pays the process start-up once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpipe_tune.algebra.model import Model
from mpipe_tune.runtime.blueprint import blueprint, output_shape, validate_workload
from mpipe_tune.runtime.compute import EmulatedCompute, RealCompute
from mpipe_tune.runtime.executor import Executor
from mpipe_tune.runtime.launch import RankContext
from mpipe_tune.runtime.measure import chrome_trace, summary
from mpipe_tune.runtime.mllm import DTYPES, LayerStack
from mpipe_tune.runtime.plan_view import PlanView, read_plan_file, validate_model_matches, validate_runnable
from mpipe_tune.runtime.transport import Transport

COMPUTE_MODES = ("real", "emulated")


@dataclass(frozen=True)
class RunJob:
    plan_path: str
    model_spec: str | None = None
    """Built-in model name or YAML file; default: the spec stored in the plan."""
    steps: int = 3
    compute: str = "real"
    """``real``: run the MLLM; ``emulated``: sleep each compute event's predicted duration."""
    dtype: str = "fp32"
    seed: int = 0
    lr: float = 1e-3
    trace: bool = False
    """Return the Chrome trace with rank 0's result."""
    grads_dir: str | None = None
    """Checks: each rank saves its first step's gradients and losses (before the update) here."""


def resolve_model(view: PlanView, model_spec: str | None) -> Model:
    """The plan's model (or ``model_spec``) with the plan's frozen blocks, checked against its hash."""
    from mpipe_tune.specs import load_model

    inputs = view.record["inputs"]["model"]
    model = load_model(model_spec or inputs["spec"])
    frozen = tuple(inputs.get("frozen") or ())
    if frozen:
        model = model.with_frozen(frozen)
    validate_model_matches(view, model)
    return model


def preflight(job: RunJob, world_size: int | None = None) -> PlanView:
    """Every check that needs no process group; one-line :class:`MpipeError` on failure."""
    view = read_plan_file(job.plan_path)
    model = resolve_model(view, job.model_spec)
    validate_runnable(view, world_size)
    if job.compute == "real":
        validate_workload(blueprint(model), view.microbatches)
    return view


def run_jobs(ctx: RankContext, jobs: list[RunJob]) -> list[dict[str, Any]] | None:
    results = [run_job(ctx, job) for job in jobs]
    return results if ctx.rank == 0 else None


def run_job(ctx: RankContext, job: RunJob) -> dict[str, Any] | None:
    view = read_plan_file(job.plan_path)
    validate_runnable(view, ctx.world_size)
    rank, device = ctx.rank, ctx.device
    if job.compute == "real":
        specs = blueprint(resolve_model(view, job.model_spec))
        dtype = DTYPES[job.dtype]
        stack = LayerStack.build(specs, view.layers_of(rank), seed=job.seed, dtype=dtype, device=device)
        compute = RealCompute(view, rank, stack, seed=job.seed, dtype=dtype, device=device, lr=job.lr)
        transport = Transport(view, rank, dtype=dtype, device=device,
                              shape_of=lambda t: output_shape(specs[t.boundary_layer], view.microbatches[t.mb]))
    else:
        compute = EmulatedCompute(view, rank, device)
        transport = Transport(view, rank, dtype=torch.float64, device=device, shape_of=lambda t: (1,),
                              link_delay_s=lambda t: view.durations_s[t.index])
    executor = Executor(view, rank, compute, transport)
    records = []
    for step in range(job.steps):
        hook = None
        if job.grads_dir and step == 0:
            def hook() -> None:
                torch.save({"grads": compute.stack.named_gradients(), "losses": dict(compute.losses)},
                           Path(job.grads_dir) / f"rank{rank}.pt")
        records.append(executor.run_step(hook))
    gathered = [None] * ctx.world_size if rank == 0 else None
    dist.gather_object(records, gathered, dst=0)
    if rank != 0:
        return None
    about = {"device": ctx.device_kind, "backend": ctx.backend, "compute": job.compute,
             "dtype": job.dtype if job.compute == "real" else None, "world_size": ctx.world_size}
    result = {"summary": summary(view, gathered, **about)}
    if job.trace:
        result["trace"] = chrome_trace(view, gathered)
    return result
