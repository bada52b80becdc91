"""A run's settings and the checks that need no process group (no torch either).

:func:`preflight` is what ``mpipe-tune run`` calls before it starts anything: a corrupt plan, a plan
made for another model, a plan whose P differs from the world size, or a model the runtime cannot
build gets one line and exit code 2 there, before any process or process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpipe_tune.algebra.model import Model
from mpipe_tune.errors import MpipeError
from mpipe_tune.runtime.blueprint import blueprint, validate_workload
from mpipe_tune.runtime.plan_view import PlanView, read_plan_file, validate_model_matches, validate_runnable
from mpipe_tune.specs import load_model

COMPUTE_MODES = ("real", "emulated")
DTYPE_NAMES = ("fp32", "fp64", "bf16", "fp16")


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

    def validate(self) -> None:
        if self.compute not in COMPUTE_MODES:
            raise MpipeError(f"--compute {self.compute!r}: use one of {', '.join(COMPUTE_MODES)}")
        if self.dtype not in DTYPE_NAMES:
            raise MpipeError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
        if self.steps < 1:
            raise MpipeError(f"--steps is {self.steps}, but a run needs at least one step")


def resolve_model(view: PlanView, model_spec: str | None) -> Model:
    """The plan's model (or ``model_spec``) with the plan's frozen blocks, checked against its hash."""
    inputs = view.record["inputs"]["model"]
    model = load_model(model_spec or inputs["spec"])
    frozen = tuple(inputs.get("frozen") or ())
    if frozen:
        model = model.with_frozen(frozen)
    validate_model_matches(view, model)
    return model


def preflight(job: RunJob, world_size: int | None = None) -> PlanView:
    """Every check that needs no process group; one-line :class:`MpipeError` on failure."""
    job.validate()
    view = read_plan_file(job.plan_path)
    model = resolve_model(view, job.model_spec)
    validate_runnable(view, world_size)
    if job.compute == "real":
        validate_workload(blueprint(model), view.microbatches)
    return view
