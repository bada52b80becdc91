"""Planning: owner-map policies, baselines in the algebra, the search space, and the search driver.

The driver (:func:`run_search`), the run and strategies it drives (:mod:`.search_run`, :mod:`.strategy`,
:mod:`.bound_order`, :mod:`.exhaustive`, :mod:`.sampling`) and :mod:`mpipe_tune.search.trials` (a study's
trials as a table) are the only places Optuna is imported; the driver is loaded on first use so that
importing the rest of the planner stays cheap. The points it samples are :class:`~mpipe_tune.algebra.candidate.Candidate`
values, defined in the algebra below both the cost model and the search (re-exported here).
"""

from mpipe_tune.plan_file.names import BASELINES, REFERENCE
from mpipe_tune.search.baselines import baseline, even_split
from mpipe_tune.algebra.candidate import Candidate
from mpipe_tune.search.compare import comparison_rows, evaluate_baselines, format_rows
from mpipe_tune.search.evaluate import Evaluation, Evaluator
from mpipe_tune.search.owners import POLICIES, greedy_owners, max_spill, optimal_owners, owners_for
from mpipe_tune.search.problem import Problem, pack
from mpipe_tune.search.space import SearchSpace, SpaceOptions

_DRIVER = ("DEFAULT_STORAGE", "SAMPLERS", "STRATEGIES", "SearchResult", "run_search", "default_study_name")

__all__ = [
    "BASELINES", "Candidate", "Evaluation", "Evaluator", "POLICIES", "Problem", "REFERENCE", "SearchSpace",
    "SpaceOptions", "baseline", "comparison_rows", "evaluate_baselines", "even_split", "format_rows",
    "greedy_owners", "max_spill", "optimal_owners", "owners_for", "pack", *_DRIVER,
]


def __getattr__(name: str):
    if name in _DRIVER:
        from mpipe_tune.search import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'mpipe_tune.search' has no attribute {name!r}")
