"""Planning: owner-map policies, baselines in the algebra, the search space, and the search driver.

The driver (:func:`run_search`), the run and strategies it drives (:mod:`._search_run`, :mod:`._strategy`,
:mod:`._bound_order`, :mod:`._exhaustive`, :mod:`._sampling`) and :mod:`mpipe_tune.search._trials` (a study's
trials as a table) are the only places Optuna is imported; the driver is loaded on first use so that
importing the rest of the planner stays cheap. The points it samples are :class:`~mpipe_tune.algebra._candidate.Candidate`
values, defined in the algebra below both the cost model and the search (re-exported here).

Its public API is :data:`__all__`: what the command line, the report and users import, each name loaded
from its module when first asked for (:data:`_LAZY`), so that importing the package imports no Optuna.
"""

from mpipe_tune import lazy_exports

_LAZY = {
    "mpipe_tune.algebra._candidate": ("Candidate",),
    "mpipe_tune.plan_file._names": ("BASELINES", "REFERENCE"),
    "mpipe_tune.search._baselines": ("baseline", "even_split"),
    "mpipe_tune.search._compare": (
        "COLUMNS", "comparison_frame", "comparison_rows", "evaluate_baselines", "format_comparison", "format_rows",
    ),
    "mpipe_tune.search._driver": (
        "DEFAULT_STORAGE", "SAMPLERS", "STRATEGIES", "SearchResult", "default_study_name", "problem_key",
        "run_search",
    ),
    "mpipe_tune.search._evaluate": ("Evaluation", "Evaluator"),
    "mpipe_tune.search._families": ("search_family",),
    "mpipe_tune.search._outcome": ("outcome_record",),
    "mpipe_tune.search._owners": ("POLICIES", "greedy_owners", "max_spill", "optimal_owners", "owners_for"),
    "mpipe_tune.search._planner": (
        "KNOBS", "SearchOptions", "SpaceRequest", "build_problem", "plan", "space_options",
    ),
    "mpipe_tune.search._problem": ("Problem", "pack"),
    "mpipe_tune.search._space": ("SearchSpace", "SpaceOptions"),
    "mpipe_tune.search._trials": ("format_trials", "load_trials_study", "summary_line", "trials_frame"),
}
__all__ = [n for names in _LAZY.values() for n in names]
__getattr__ = lazy_exports(__name__, _LAZY)
