"""The cost model: hardware profiles, each layer's kernels and seconds, the compiled plan and its
timeline, memory, and :class:`Predictor`, the one place a prediction is composed.

Its public API is :data:`__all__`: what the search, the runtime, the profiler, the report and the
command line (and the benchmarks) import. Other packages import these names from here; the modules
behind them are the implementation. Imported eagerly, as the algebra is: every layer above reads it.
"""

from mpipe_tune.cost._arch import estimate_arch_work, expert_parallel_fits, tensor_parallel_fits
from mpipe_tune.cost._arch_layers import ROPE_FORMS
from mpipe_tune.cost._arch_pieces import ATTENTION_BWD_KERNELS
from mpipe_tune.cost._bound_by import bound_text, rank_bounds
from mpipe_tune.cost._compiled import CompiledPlan
from mpipe_tune.cost._durations import TableSums, table_sums
from mpipe_tune.cost._framework import Framework
from mpipe_tune.cost._encoder_backward import optimise
from mpipe_tune.cost._kernel_model import AttentionCurve, GemmCurve, MemoryCurve
from mpipe_tune.cost._layers import CostOptions, LayerTable, build_layer_table, layer_seconds
from mpipe_tune.cost._memory import static_bytes_of
from mpipe_tune.cost._owners import (
    OPTIMAL_MAX_NODES, POLICIES, OwnerChoice, choose_owners, greedy_owners, max_spill, optimal_owners, owners_for,
    rank_excess,
)
from mpipe_tune.cost._predict import predict, predict_fastest_placement
from mpipe_tune.cost._predictor import Prediction, Predictor, chooses_owners, layer_weights
from mpipe_tune.cost._profile import (
    DTYPES, SCHEMA_VERSION, HardwareProfile, LinkCost, builtin_profiles, dump_profile, estimate_collective_s,
    load_profile, parse_profile, sharded_half_s,
)
from mpipe_tune.cost._timing import longest_path_reference

__all__ = [
    "ATTENTION_BWD_KERNELS", "DTYPES", "OPTIMAL_MAX_NODES", "POLICIES", "ROPE_FORMS", "SCHEMA_VERSION",
    "AttentionCurve", "CompiledPlan", "CostOptions", "Framework", "GemmCurve", "HardwareProfile", "LayerTable",
    "LinkCost", "MemoryCurve", "OwnerChoice", "Prediction", "Predictor", "TableSums",
    "bound_text", "build_layer_table", "builtin_profiles", "choose_owners", "chooses_owners", "dump_profile",
    "estimate_arch_work", "estimate_collective_s", "expert_parallel_fits", "greedy_owners", "layer_seconds", "layer_weights",
    "load_profile", "longest_path_reference", "optimise", "max_spill", "optimal_owners", "owners_for", "parse_profile", "predict",
    "predict_fastest_placement", "rank_bounds", "rank_excess", "sharded_half_s", "static_bytes_of", "table_sums",
    "tensor_parallel_fits",
]
