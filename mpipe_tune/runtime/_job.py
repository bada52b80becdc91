"""A run's settings and the checks that need no process group (no torch either).

:func:`preflight` is what ``mpipe-tune run`` calls before it starts anything: a corrupt plan, a plan
made for another model, a plan whose P differs from the world size, or a model the runtime cannot
build gets one line and exit code 2 there, before any process or process group exists; so does a plan
whose stored per-rank order is not the one ``derive`` gives for its stored candidate, and a choice of
per-step owners or sampled steps the plan cannot run (:func:`~mpipe_tune.runtime._steps.resolve_modes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mpipe_tune.errors import MpipeError
from mpipe_tune.algebra import DTYPE_BYTES
from mpipe_tune.runtime._blueprint import blueprint, validate_tensor_parallel, validate_variants, validate_workload
from mpipe_tune.runtime._plan_view import PlanView, read_plan_file, validate_runnable
from mpipe_tune.runtime._steps import StepPlanner, resolve_modes

COMPUTE_MODES = ("real", "emulated")
DTYPE_NAMES = ("fp32", "fp64", "bf16", "fp16")


@dataclass(frozen=True)
class RunJob:
    plan_path: str
    plan_name: str | None = None
    """Which plan of the file: ``best`` (the default) or a stored baseline's name."""
    model_spec: str | None = None
    """Built-in model name or YAML file; default: the spec stored in the plan."""
    steps: int = 3
    compute: str = "real"
    """``real``: run the MLLM; ``emulated``: sleep each compute event's predicted duration."""
    dtype: str | None = None
    """Real compute dtype; default: the plan's (the dtype it was predicted for)."""
    seed: int = 0
    lr: float = 1e-3
    trace: bool = False
    """Return the Chrome trace with rank 0's result."""
    grads_dir: str | None = None
    """Checks: each rank saves its first step's gradients and losses (before the update) here."""
    weights_dir: str | None = None
    """Checks: each rank saves its weights after the last step here, whole (gathered over their shards),
    with the element count it holds of each (:meth:`~mpipe_tune.runtime._mllm.LayerStack.held_weights`)."""
    owners: str | None = None
    """``per-step`` (each step's owner map from the plan's policy on that step's metadata) or
    ``fixed`` (the stored map every step); None: the plan's default (:mod:`mpipe_tune.runtime._steps`)."""
    data: str | None = None
    """``sampled`` (each step draws its microbatches from the plan's mix) or ``stored``; None: the default."""
    profile_spec: str | None = None
    """The plan's hardware profile where it moved (read when steps are predicted at run time)."""
    progress: bool = False
    """Rank 0 writes a line to stderr as each step finishes (``mpipe-tune run``)."""

    def dtype_for(self, view: PlanView) -> str:
        """The dtype this job computes in: its own, else the plan's."""
        return self.dtype or view.dtype

    def validate(self) -> None:
        if self.compute not in COMPUTE_MODES:
            raise MpipeError(f"compute mode {self.compute!r} is unknown; use one of {', '.join(COMPUTE_MODES)}",
                             quantities=("compute mode",))
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise MpipeError(f"dtype {self.dtype!r} is unknown; use one of {', '.join(DTYPE_NAMES)}", quantities=("dtype",))
        if self.steps < 1:
            raise MpipeError(f"step count is {self.steps}, but a run needs at least one step", quantities=("step count",))


def preflight(job: RunJob, world_size: int | None = None) -> PlanView:
    """Every check that needs no process group; one-line :class:`MpipeError` on failure."""
    job.validate()
    view = read_plan_file(job.plan_path, plan_name=job.plan_name, model_spec=job.model_spec)
    model = view.model
    validate_runnable(view, world_size, job.compute)
    modes = resolve_modes(view, job.owners, job.data)
    if not modes.is_stored_plan:
        StepPlanner(view, modes, profile_spec=job.profile_spec)  # the profile is there and the plan's
    if job.compute == "real":
        dtype = job.dtype_for(view)
        if dtype not in DTYPE_NAMES:
            raise MpipeError(f"plan file {view.path} was predicted in {dtype}, which the runtime cannot compute "
                             f"in; run with dtype one of {', '.join(DTYPE_NAMES)} or re-plan with dtype bf16",
                             quantities=("dtype",))
        specs = blueprint(model)
        validate_workload(specs, view.microbatches)
        validate_tensor_parallel(specs, view.layout.tp)
        validate_variants(specs, tp_degree=view.layout.tp, cp_degree=view.layout.cp, ep_degree=view.layout.ep)
    return view


def validate_memory(view: PlanView, job: RunJob, local_ranks: Sequence[int], available_bytes: float, *,
                    shared: bool, where: str) -> None:
    """Refuse a real-compute run whose predicted memory exceeds what the device has.

    ``local_ranks`` are the global ranks on this host; with ``shared`` (host memory, the CPU) their
    predicted peaks add up against ``available_bytes``, otherwise each rank's peak is compared with
    its own device's ``available_bytes``. A job in another dtype than the plan's scales the
    prediction by the ratio of element sizes. Emulated compute allocates no model: nothing to check.
    """
    if job.compute != "real":
        return
    scale = DTYPE_BYTES[job.dtype_for(view)] / DTYPE_BYTES.get(view.dtype, DTYPE_BYTES[job.dtype_for(view)])
    peaks = [view.predicted_peak_bytes[view.layout.coordinates(g)[0]] * scale for g in local_ranks]
    need = sum(peaks) if shared else max(peaks, default=0.0)
    if need > available_bytes:
        what = f"{len(peaks)} local ranks together" if shared else "its busiest rank"
        raise MpipeError(
            f"plan file {Path(view.path).name} needs {need / 2**30:.2f} GiB of predicted memory ({what}, "
            f"{job.dtype_for(view)}) but {where} has {available_bytes / 2**30:.2f} GiB available; use compute mode "
            f"emulated, or re-plan for more devices or a smaller workload (e.g. smoke)", quantities=("compute mode",)
        )


def validate_local_processes(view: PlanView, num_local: int, process_bytes: float, available_bytes: float) -> None:
    """Refuse starting ``num_local`` rank processes on this host when their interpreters alone (each
    about ``process_bytes``, this process's resident size with torch loaded) exceed the host's
    available memory: a plan for hundreds of devices runs under torchrun across nodes, not here."""
    need = num_local * process_bytes
    if need > available_bytes:
        fits = int(available_bytes // process_bytes)
        raise MpipeError(
            f"plan file {view.path} runs on {view.layout.world_size} ranks ({view.layout}); starting {num_local} "
            f"rank processes here needs about {need / 2**30:.0f} GiB ({process_bytes / 2**20:.0f} MiB each, this "
            f"process's size with torch loaded) but this host has {available_bytes / 2**30:.1f} GiB available "
            f"(room for about {fits}); run it under torchrun on enough nodes, or re-plan for at most {fits} devices"
        )


def check_host(view: PlanView, job: RunJob, device_kind: str) -> list[str]:
    """The device checks of a run on this host, after :func:`preflight`: the device gives every local
    rank one device, and a real-compute run fits its memory (one-line errors). Returns notes to show
    before the run starts (a dtype the device lacks or is slow in)."""
    from mpipe_tune.runtime import _launch as launch

    ranks = launch.local_ranks(view.layout.world_size)
    launch.check_device(device_kind, len(ranks))
    validate_local_processes(view, len(ranks), launch.process_bytes(), launch.available_memory("cpu")[0])
    if job.compute != "real":
        return []
    available, shared, where = launch.available_memory(device_kind)
    validate_memory(view, job, ranks, available, shared=shared, where=where)
    notes = [launch.dtype_note(device_kind, job.dtype_for(view)), builtin_profile_note(view, job, device_kind),
             launch.shared_cores_note(device_kind, len(ranks), f"measured/predicted is fair only with at most "
                                                               f"{launch.usable_cores()} ranks on this host")]
    return [note for note in notes if note]


def builtin_profile_note(view: PlanView, job: RunJob, device_kind: str) -> str | None:
    """A note when the plan was predicted on a built-in profile (a machine described, not this host
    measured): its measured/predicted ratio then compares two machines."""
    from mpipe_tune.cost import builtin_profiles

    profile = view.file.inputs.profile
    if (job.profile_spec or profile.spec) not in builtin_profiles():
        return None
    return (f"the plan was predicted on the built-in profile '{profile.name}', not on a profile of this host, so "
            f"measured/predicted compares the two machines; to predict this host, measure it (mpipe-tune profile "
            f"--device {device_kind} --out host.json) and plan with host.json as the hardware profile")
