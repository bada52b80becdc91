"""One-call prediction of a :class:`~mpipe_tune.algebra._candidate.Candidate`: the
:class:`~mpipe_tune.cost._predictor.Predictor`'s prediction for callers that predict one candidate.

``predict(candidate, model, workload, profile, options)``: the candidate fixes the plan (cut,
schedule, slabs, owners, encoder backward placement, degrees, dtype, recomputation, frozen blocks;
an ``optimised`` placement without its slots has them chosen on the workload,
:func:`~mpipe_tune.cost._encoder_backward.optimise`); ``options`` carries the framework, the cost
model's settings that are not a planning choice (:class:`~mpipe_tune.cost._framework.Framework`: the
MoE load imbalance, optimizer bytes, ...), or a whole :class:`~mpipe_tune.cost._layers.CostOptions`
whose framework part is read (its degrees are the candidate's).
"""

from __future__ import annotations

from dataclasses import replace

from mpipe_tune.algebra import Candidate, COOLDOWN, PLACEMENTS, runs_encoder_backward, Model
from mpipe_tune.cost._framework import Framework
from mpipe_tune.cost._layers import CostOptions
from mpipe_tune.cost._predictor import Prediction, Predictor, layer_weights, resolved
from mpipe_tune.cost._profile import HardwareProfile
from mpipe_tune.inputs import Workload

__all__ = ["Prediction", "cost_options", "layer_weights", "predict", "predict_fastest_placement", "resolved"]


def _framework(options: CostOptions | Framework) -> Framework:
    return options if isinstance(options, Framework) else Framework.of(options)


def cost_options(candidate: Candidate, options: CostOptions | Framework = Framework()) -> CostOptions:
    """The cost options of ``candidate`` under the framework of ``options`` (:meth:`Framework.options`)."""
    return _framework(options).options(candidate)


def predict(
    candidate: Candidate,
    model: Model,
    workload: Workload,
    profile: HardwareProfile,
    options: CostOptions | Framework = Framework(),
) -> Prediction:
    """Derive the plan for one candidate on ``model`` (its frozen blocks frozen) and read its predicted
    timeline and memory on ``workload``, one step of ``num_microbatches`` microbatches."""
    return Predictor(model, profile, _framework(options)).predict(candidate, workload)


def predict_fastest_placement(
    candidate: Candidate,
    model: Model,
    workload: Workload,
    profile: HardwareProfile,
    options: CostOptions | Framework = Framework(),
) -> Prediction:
    """:func:`predict` of ``candidate`` under each encoder backward placement (:data:`PLACEMENTS`), the
    fastest kept (ties to the earlier placement); a plan without encoder backwards is predicted once."""
    predictor = Predictor(model, profile, _framework(options))

    def under(placement: str) -> Prediction:
        return predictor.predict(replace(candidate, encoder_backward=placement, encoder_backward_slots=None,
                                         encoder_backward_ranks=None), workload)

    best = under(COOLDOWN)
    if not runs_encoder_backward(best.plan):
        return best
    for placement in PLACEMENTS[1:]:
        other = under(placement)
        if other.timeline.makespan_s < best.timeline.makespan_s:
            best = other
    return best
