"""The schedule algebra: model, cut, skeletons, schedules, normal form, footprint, the candidate,
``derive`` and the IR it produces (``Plan``, ``Order``; :mod:`mpipe_tune.algebra._plan`).

Imports nothing heavy: no torch, no Optuna, no seconds; nothing from ``cost``, ``search``,
``report`` or ``runtime`` (tests/test_layering.py walks the imports).

Its public API is :data:`__all__`: what the other packages (and users) import, from here; the modules
behind it are the implementation. Imported eagerly: every layer above reads the algebra.
"""

from mpipe_tune.algebra._candidate import (
    DEFAULT_KERNEL_MODE, GRAD_REDUCE_DTYPES, KERNEL_MODES, MAX_DEVICES, MOE_DISPATCHERS, ROUND_ROBIN,
    ZERO_SETTINGS, ZERO_STAGES, Candidate, default_cut, default_reshard_after_forward,
)
from mpipe_tune.algebra._candidate_text import (
    DTYPE_BYTES, RECOMPUTE_GRANULARITIES, RECOMPUTE_WORDS, TORCH_DTYPE_NAMES, normalize_recompute, parse_recompute,
    recompute_granularity,
)
from mpipe_tune.algebra._degrees import Degrees
from mpipe_tune.algebra._derive import Owners, collector_paused, derive
from mpipe_tune.algebra._encoder_backward import (
    COOLDOWN, EARLIEST, OPTIMISED, PLACEMENTS, BackboneSteps, EncoderBackward, moved_count, plan_steps,
    runs_encoder_backward, validate_placement,
)
from mpipe_tune.algebra._events import (
    Action, Bwd, Coll, Comm, DpReduce, EdgeKind, Event, Fwd, Group, Loss, ReduceGrad, Reshard, StepBarrier,
    Unshard, Wgrad, parse_event,
)
from mpipe_tune.algebra._footprint import Footprint, footprint
from mpipe_tune.algebra._kernels import topological_order
from mpipe_tune.algebra._model import ENCODER_BLOCK, ArchCost, ExplicitCost, Layer, Model, parse_model
from mpipe_tune.algebra._order import is_interleavable, num_rounds
from mpipe_tune.algebra._placement import (
    ByLayer, ByMicrobatch, RegionPlacement, balanced_counts, round_robin, validate_owners,
)
from mpipe_tune.algebra._plan import (
    BARRIER, BWD, COLL, COMMS, EDGE_KINDS, FWD, GROUPS, LOSS, REDUCE, WGRAD, Collectives, Order, OrderColumns,
    Plan, Seam, replicated_of,
)
from mpipe_tune.algebra._schedule import (
    Cut, Layout, Schedule, Skeleton, normalize, parse_cut, parse_schedule, validate_schedule,
)
from mpipe_tune.algebra._sharding import UNSHARD, microbatch_actions, sharded_program
from mpipe_tune.algebra._stages import rank_slabs, wavefront_stages
from mpipe_tune.algebra._topology import sequence_edges, sort_topologically

__all__ = [
    # the candidate, its settings and its text form
    "Candidate", "Degrees", "default_cut", "default_reshard_after_forward", "DEFAULT_KERNEL_MODE", "DTYPE_BYTES",
    "GRAD_REDUCE_DTYPES", "KERNEL_MODES", "MAX_DEVICES", "MOE_DISPATCHERS", "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_WORDS", "ROUND_ROBIN", "TORCH_DTYPE_NAMES", "ZERO_SETTINGS", "ZERO_STAGES", "normalize_recompute",
    "parse_recompute", "recompute_granularity",
    # the model, the cut and the schedule
    "ArchCost", "ENCODER_BLOCK", "ExplicitCost", "Layer", "Model", "parse_model", "Cut", "Layout", "Schedule",
    "Skeleton", "normalize", "parse_cut", "parse_schedule", "validate_schedule", "is_interleavable", "num_rounds",
    "Footprint", "footprint",
    # derive and the IR it produces (events, placement, the plan and its columns)
    "derive", "Owners", "collector_paused", "rank_slabs", "wavefront_stages", "sequence_edges",
    "sort_topologically", "topological_order", "sharded_program", "microbatch_actions", "UNSHARD",
    "Action", "Bwd", "Coll", "Comm", "DpReduce", "EdgeKind", "Event", "Fwd", "Group", "Loss", "ReduceGrad",
    "Reshard", "StepBarrier", "Unshard", "Wgrad", "parse_event",
    "ByLayer", "ByMicrobatch", "RegionPlacement", "balanced_counts", "round_robin", "validate_owners",
    "Collectives", "Order", "OrderColumns", "Plan", "Seam", "replicated_of",
    "BARRIER", "BWD", "COLL", "COMMS", "EDGE_KINDS", "FWD", "GROUPS", "LOSS", "REDUCE", "WGRAD",
    # the encoder backward's placement
    "COOLDOWN", "EARLIEST", "OPTIMISED", "PLACEMENTS", "BackboneSteps", "EncoderBackward", "moved_count",
    "plan_steps", "runs_encoder_backward", "validate_placement",
]
