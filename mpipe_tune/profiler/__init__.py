"""Measure a device into a hardware profile: roofline, alpha-beta links, per-layer-kind efficiency.

``mpipe-tune profile`` drives it: :func:`profile_device` measures (torch, imported on first use) and
:func:`assemble_profile` turns the measurements into a schema-v1 profile. The fits are plain numpy and
usable without torch: :func:`fit_alpha_beta` / :func:`to_link_cost` for links, :func:`fit_efficiency`
for layer kinds.

Modules: ``device`` (importing torch for a device, timing on it), ``roofline`` (matmul peak, copy
bandwidth), ``links`` (spawned workers sweeping message sizes), ``calibrate`` (the runtime's layers
timed against the roofline), ``fit`` and ``stats`` (pure), ``settings`` (sweep sizes), ``build``.

Its public API is :data:`__all__`: what the command line and users import, each name loaded from its
module when first asked for (:data:`_LAZY`).
"""

from mpipe_tune import lazy_exports

_LAZY = {
    "mpipe_tune.profiler._build": (
        "Measurements", "assemble_profile", "count_steps", "merge_link_classes", "profile_device",
    ),
    "mpipe_tune.profiler._calibrate": ("calibration_layers",),
    "mpipe_tune.profiler._device": ("import_torch",),
    "mpipe_tune.profiler._fit": (
        "AlphaBetaFit", "EfficiencyFit", "fit_alpha_beta", "fit_efficiency", "step_multipliers", "to_link_cost",
    ),
    "mpipe_tune.profiler._links": ("LINK_COLLECTIVES",),
    "mpipe_tune.profiler._nodes": ("measure_link_classes",),
    "mpipe_tune.profiler._roofline": ("TORCH_DTYPES", "shares_memory"),
    "mpipe_tune.profiler._settings": ("MAX_PROCESSES", "SweepSettings", "sweep_settings"),
    "mpipe_tune.profiler._shapes": ("kernel_sweep_settings",),
    "mpipe_tune.profiler._stats": ("Spread", "summarize"),
    "mpipe_tune.profiler._together": ("probed_run_jobs", "profile_probe_s"),
}
__all__ = [n for names in _LAZY.values() for n in names]
__getattr__ = lazy_exports(__name__, _LAZY)
