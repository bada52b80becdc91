"""Planning: owner-map policies, baselines in the algebra, the search space, and the search driver.

The driver (:func:`run_search`), the run and strategies it drives (:mod:`.search_run`, :mod:`.strategy`,
:mod:`.bound_order`, :mod:`.exhaustive`, :mod:`.sampling`) and :mod:`mpipe_tune.search.trials` (a study's
trials as a table) are the only places Optuna is imported; the driver is loaded on first use so that
importing the rest of the planner stays cheap. The points it samples are :class:`~mpipe_tune.algebra.candidate.Candidate`
values, defined in the algebra below both the cost model and the search (re-exported here).

Its public API is :data:`__all__`: what the command line, the report and users import, each name loaded
from its module when first asked for (:data:`_LAZY`), so that importing the package imports no Optuna.
"""

from mpipe_tune import lazy_exports

_LAZY = {
    "mpipe_tune.algebra.candidate": ("Candidate",),
    "mpipe_tune.plan_file.names": ("BASELINES", "REFERENCE"),
    "mpipe_tune.search.baselines": ("baseline", "even_split"),
    "mpipe_tune.search.compare": (
        "COLUMNS", "comparison_frame", "comparison_rows", "evaluate_baselines", "format_comparison", "format_rows",
    ),
    "mpipe_tune.search.driver": (
        "DEFAULT_STORAGE", "SAMPLERS", "STRATEGIES", "SearchResult", "default_study_name", "problem_key",
        "run_search",
    ),
    "mpipe_tune.search.evaluate": ("Evaluation", "Evaluator"),
    "mpipe_tune.search.families": ("search_family",),
    "mpipe_tune.search.outcome": ("outcome_record",),
    "mpipe_tune.search.owners": ("POLICIES", "greedy_owners", "max_spill", "optimal_owners", "owners_for"),
    "mpipe_tune.search.planner": (
        "KNOBS", "SearchOptions", "SpaceRequest", "build_problem", "plan", "space_options",
    ),
    "mpipe_tune.search.problem": ("Problem", "pack"),
    "mpipe_tune.search.space": ("SearchSpace", "SpaceOptions"),
    "mpipe_tune.search.trials": ("format_trials", "load_trials_study", "summary_line", "trials_frame"),
}
__all__ = [n for names in _LAZY.values() for n in names]
__getattr__ = lazy_exports(__name__, _LAZY)
