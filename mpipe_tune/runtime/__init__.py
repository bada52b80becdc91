"""The runtime: execute a plan file on torch.distributed and measure it beside the prediction.

- :mod:`~mpipe_tune.runtime.plan_view` reads plan.json into per-rank event lists and transfers;
- :mod:`~mpipe_tune.runtime.blueprint` checks what the runtime can build from a model spec;
- :mod:`~mpipe_tune.runtime.job` holds a run's settings and the pre-flight checks;
- :mod:`~mpipe_tune.runtime.layers`, :mod:`~mpipe_tune.runtime.data` and :mod:`~mpipe_tune.runtime.mllm`
  build the MLLM per layer, its synthetic microbatches, and the single-process reference step;
- :mod:`~mpipe_tune.runtime.executor` walks a rank's events with :mod:`~mpipe_tune.runtime.compute`
  (real or emulated) and :mod:`~mpipe_tune.runtime.transport` (point-to-point transfers);
- :mod:`~mpipe_tune.runtime.launch` starts ranks (local spawner or torchrun) on gloo, NCCL or HCCL;
- :mod:`~mpipe_tune.runtime.worker` is what every rank runs; :mod:`~mpipe_tune.runtime.measure` turns
  its timings into step times and a Chrome trace.

Importing this package imports no torch; plan_view, blueprint, job, launch and measure never do.
"""
