"""What ``plan`` writes from a :class:`~mpipe_tune.search._planner.PlanOutcome`: plan.json's record (the
search owns its outcome; report reads the file).

:func:`outcome_record` predicts every stored plan once more from the search's evaluator (the
winner, each baseline at its degrees, each family's own best and the current layout) and builds the
file with :func:`mpipe_tune.plan_file.plan_record`, the search summary as its ``search`` section.
"""

from __future__ import annotations

from typing import Any

from mpipe_tune.cost import bound_text, rank_bounds
from mpipe_tune.plan_file import PlanInputs, plan_record, plan_section, CURRENT
from mpipe_tune.search._evaluate import Evaluation
from mpipe_tune.search._planner import PlanOutcome


def outcome_record(outcome: PlanOutcome, inputs: PlanInputs) -> dict[str, Any]:
    """plan.json for a plan that found a winner: the winner at the top level, the baselines at its
    degrees, the plans at layouts of their own (each family's best, the current layout), the summary."""
    evaluator = outcome.evaluator
    assert outcome.best is not None, "no plan fits: nothing to write"

    def section(evaluation: Evaluation) -> dict[str, Any]:
        return plan_section(*evaluator.prediction(evaluation.candidate))

    alternatives = {f.label: section(f.best) for f in outcome.families if f.best is not None}
    if outcome.current is not None:
        alternatives[CURRENT] = section(outcome.current)
    prediction, workload = evaluator.prediction(outcome.best.candidate)
    p = outcome.problem
    record = plan_record(prediction, p.model, workload, p.profile, inputs,
                         baselines={name: section(e) for name, e in outcome.baselines if e is not None},
                         alternatives=alternatives)
    record["search"] = summary = outcome.summary()
    evaluations = {"best": outcome.best, CURRENT: outcome.current, **{f.label: f.best for f in outcome.families},
                   **dict(outcome.baselines)}
    for row in [*summary["comparison"], *summary.get("own_best", []), *([summary["current"]] if summary.get("current")
                                                                         else [])]:
        if evaluations.get(row["plan"]) is not None:  # what bounds each rank of the row's plan (issue 37)
            row["bound_by"] = bound_text(rank_bounds(evaluator.prediction(evaluations[row["plan"]].candidate)[0]))
    return record
