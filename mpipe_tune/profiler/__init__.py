"""Measure a device into a hardware profile: roofline, alpha-beta links, per-layer-kind efficiency.

``mpipe-tune profile`` drives it: :func:`profile_device` measures (torch, imported on first use) and
:func:`assemble_profile` turns the measurements into a schema-v1 profile. The fits are plain numpy and
usable without torch: :func:`fit_alpha_beta` / :func:`to_link_cost` for links, :func:`fit_efficiency`
for layer kinds.

Modules: ``device`` (importing torch for a device, timing on it), ``roofline`` (matmul peak, copy
bandwidth), ``links`` (spawned workers sweeping message sizes), ``calibrate`` (the runtime's layers
timed against the roofline), ``fit`` and ``stats`` (pure), ``settings`` (sweep sizes), ``build``.
"""

from mpipe_tune.profiler.build import Measurements, assemble_profile, profile_device
from mpipe_tune.profiler.fit import (
    AlphaBetaFit,
    EfficiencyFit,
    fit_alpha_beta,
    fit_efficiency,
    step_multipliers,
    to_link_cost,
)
from mpipe_tune.profiler.settings import SweepSettings, sweep_settings
from mpipe_tune.profiler.stats import Spread, summarize

__all__ = [
    "AlphaBetaFit",
    "EfficiencyFit",
    "Measurements",
    "Spread",
    "SweepSettings",
    "assemble_profile",
    "fit_alpha_beta",
    "fit_efficiency",
    "profile_device",
    "step_multipliers",
    "summarize",
    "sweep_settings",
    "to_link_cost",
]
