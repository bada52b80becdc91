"""The schedule algebra: model, cut, skeletons, schedules, normal form, footprint, the candidate,
``derive`` and the IR it produces (``Plan``, ``Order``; :mod:`mpipe_tune.algebra.plan`).

Imports nothing heavy: no torch, no Optuna, no seconds; nothing from ``cost``, ``search``,
``report`` or ``runtime`` (tests/test_layering.py walks the imports).
"""

from mpipe_tune.algebra.candidate import Candidate, default_cut
from mpipe_tune.algebra.degrees import Degrees
from mpipe_tune.algebra.derive import Owners, derive
from mpipe_tune.algebra.events import (
    Bwd, Coll, Comm, DpReduce, EdgeKind, Event, Fwd, Group, Loss, StepBarrier, Wgrad, parse_event,
)
from mpipe_tune.algebra.footprint import Footprint, footprint
from mpipe_tune.algebra.model import ArchCost, ExplicitCost, Layer, Model, parse_model
from mpipe_tune.algebra.placement import ByLayer, ByMicrobatch, RegionPlacement, balanced_counts, round_robin
from mpipe_tune.algebra.plan import Collectives, Order, Plan, Seam
from mpipe_tune.algebra.schedule import (
    Cut, Layout, Schedule, Skeleton, normalize, parse_cut, parse_schedule, validate_schedule,
)

__all__ = [
    "ArchCost", "Bwd", "ByLayer", "ByMicrobatch", "Candidate", "Coll", "Collectives", "Comm", "Cut", "Degrees", "DpReduce",
    "EdgeKind", "Event", "ExplicitCost", "Footprint", "Fwd", "Group", "Layer", "Layout", "Loss", "Model",
    "Order", "Owners", "Plan", "RegionPlacement", "Schedule", "Seam", "Skeleton", "StepBarrier", "Wgrad",
    "balanced_counts", "default_cut", "derive", "footprint", "normalize", "parse_cut", "parse_event", "parse_model",
    "parse_schedule", "round_robin", "validate_schedule",
]
