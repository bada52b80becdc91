"""The runtime: execute a plan file on torch.distributed and measure it beside the prediction.

- :mod:`~mpipe_tune.runtime._plan_view` reads plan.json (:mod:`mpipe_tune.plan_file`), derives its
  candidate again and reads the derived Plan into per-rank event lists and transfers;
- :mod:`~mpipe_tune.runtime._blueprint` checks what the runtime can build from a model spec;
- :mod:`~mpipe_tune.runtime._layout` numbers the plan's pp x dp x cp x tp ranks as the cost model lays them
  out, and :mod:`~mpipe_tune.runtime._mesh` builds them into torch's ``DeviceMesh`` with the process
  groups of the plan's reduces;
- :mod:`~mpipe_tune.runtime._job` holds a run's settings and the pre-flight checks (plan, model,
  world size, tensor-parallel splits, the host's memory and dtype);
- :mod:`~mpipe_tune.runtime._layers`, :mod:`~mpipe_tune.runtime._data` and :mod:`~mpipe_tune.runtime._mllm`
  build the MLLM per layer, its synthetic microbatches, and the single-process reference step;
  :mod:`~mpipe_tune.runtime._tensor_parallel` splits its layers with ``torch.distributed.tensor.parallel``,
  :mod:`~mpipe_tune.runtime._experts` shards MoE experts over expert-parallel groups, and
  :mod:`~mpipe_tune.runtime._ring_attention` runs context parallelism's ring attention on the shares
  :mod:`~mpipe_tune.runtime._sequence_split` gives each context-parallel rank;
- :mod:`~mpipe_tune.runtime._steps` builds each step's view of the plan: the step's microbatches (the
  stored ones, or drawn from the plan's mix), its owner map (the stored one, or the plan's policy on
  that step's metadata) and the stored order re-timed for it;
- :mod:`~mpipe_tune.runtime._executor` walks a rank's events with :mod:`~mpipe_tune.runtime._compute`
  (real or emulated) and :mod:`~mpipe_tune.runtime._transport` (point-to-point transfers);
- :mod:`~mpipe_tune.runtime._launch` starts ranks (local spawner or torchrun) on gloo, NCCL or HCCL;
- :mod:`~mpipe_tune.runtime._session` is what ``run`` and ``bench`` share: check every job, start the
  ranks once, run the jobs in turn and hand back each result as it finishes;
- :mod:`~mpipe_tune.runtime._worker` is what every rank runs; :mod:`~mpipe_tune.runtime._measure` turns
  its timings into step times and a Chrome trace.

Importing this package imports no torch; plan_view, steps, layout, blueprint, sequence_split, job, launch, session and
measure never do.
Nothing here imports ``report`` or ``search`` (tests/test_layering.py).

Its public API is :data:`__all__`: what the command line, the profiler and users import, each name
loaded from its module when first asked for (:data:`_LAZY`: torch loads only with a name that needs
it), except :func:`blueprint`, bound here (its module imports no torch) because it shares its module's name.
"""

from mpipe_tune import lazy_exports
from mpipe_tune.runtime._blueprint import blueprint

_LAZY = {
    "mpipe_tune.runtime._blueprint": ("output_shape", "validate_tensor_parallel"),
    "mpipe_tune.runtime._compute": ("sgd_update",),
    "mpipe_tune.runtime._data": ("MicrobatchInputs",),
    "mpipe_tune.runtime._experts": ("ExpertShard",),
    "mpipe_tune.runtime._job": ("RunJob",),
    "mpipe_tune.runtime._launch": ("disable_backend_autoload", "launch_local", "shared_cores_note", "usable_cores"),
    "mpipe_tune.runtime._layers": ("build_layer",),
    "mpipe_tune.runtime._measure": ("dump_trace",),
    "mpipe_tune.runtime._mesh": ("ALL_GATHER_INTO", "REDUCE_SCATTER_FROM"),
    "mpipe_tune.runtime._plan_view": ("PlanView", "read_plan_file"),
    "mpipe_tune.runtime._session": ("run_session",),
    "mpipe_tune.runtime._steps": ("StepModes", "StepPlanner", "resolve_modes"),
    "mpipe_tune.runtime._tensor_parallel": ("parallelize_layer", "tp_context"),
    "mpipe_tune.runtime._torchrun_env": ("NodePlace", "is_under_torchrun", "join_env_world", "place_from_env"),
    "mpipe_tune.runtime._worker": ("run_job", "run_jobs"),
}
__all__ = ["blueprint", *(n for names in _LAZY.values() for n in names)]
__getattr__ = lazy_exports(__name__, _LAZY)
