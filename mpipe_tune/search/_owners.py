"""The owner policies, as the search names them: they live in :mod:`mpipe_tune.cost._owners`, below
both the search and the runtime (which chooses each step's owners at run time), and are re-exported
here for the search's modules and its users."""

from mpipe_tune.cost import (
    OPTIMAL_MAX_NODES, POLICIES, greedy_owners, max_spill, optimal_owners, owners_for, rank_excess,
)

__all__ = ["OPTIMAL_MAX_NODES", "POLICIES", "greedy_owners", "max_spill", "optimal_owners", "owners_for",
           "rank_excess"]
