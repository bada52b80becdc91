"""A stored plan predicted again: what ``show`` prints and ``report`` draws for every plan of a file.

:func:`repredict` resolves the plan (:func:`mpipe_tune.plan_file._resolve`: its model, profile and
workload checked against the file's hashes, its stored order against ``derive``'s) and predicts its
candidate on its stored workload with today's cost model, under the framework the file records.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mpipe_tune.cost import Framework, predict, Prediction
from mpipe_tune.errors import MpipeError
from mpipe_tune.plan_file import PlanFile, ResolvedPlan, damaged, resolve


@dataclass(frozen=True)
class Repredicted:
    """A resolved plan and its prediction now."""

    resolved: ResolvedPlan
    prediction: Prediction

    @property
    def recorded_s(self) -> float:
        """The step time the file records."""
        return self.resolved.section.predicted_step_s

    @property
    def now_s(self) -> float:
        """The step time predicted now."""
        return self.prediction.timeline.makespan_s

    @property
    def unchanged(self) -> bool:
        """Whether the cost model still predicts the recorded step time (to 1e-9 relative)."""
        return abs(self.now_s - self.recorded_s) <= 1e-9 * max(1.0, abs(self.recorded_s))


def repredict(source: str | os.PathLike | PlanFile, name: str | None = None, *, model: Any = None,
              profile: Any = None) -> Repredicted:
    """The plan ``name`` (default: the best) of ``source``, resolved and predicted again; ``model`` and
    ``profile`` are loaded inputs or the specs of where they moved (default: what the file names)."""
    resolved = resolve(source, name, model=model, profile=profile, predicting=True)
    section = resolved.section
    try:
        prediction = predict(section.candidate, resolved.model, section.workload, resolved.profile,
                             Framework.from_inputs(resolved.file.inputs))
    except MpipeError as exc:
        raise damaged(resolved.where, f"its stored candidate does not predict (the prediction refuses it: {exc})") from None
    return Repredicted(resolved, prediction)
