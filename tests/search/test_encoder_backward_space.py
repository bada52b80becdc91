"""The encoder backward placement as a search choice: offered where the transposed region is trainable,
evaluated as predict does."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpipe_tune.algebra import PLACEMENTS
from mpipe_tune.search import Evaluator, Problem, SearchSpace, SpaceOptions
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model


def _space(placements, frozen=()):
    model = load_model("qwen2vl-vit-llama3-8b")
    if frozen:
        model = model.with_frozen(frozen)
    problem = Problem(model, load_profile("h100-sxm"), 8, 32, mix="balanced", num_samples=1)
    evaluator = Evaluator(problem)
    options = SpaceOptions(skeletons=("1f1b",), max_chunks=1, cut_window=0, owner_policies=("round-robin",),
                           max_microbatches=16, pp=(4, 8), tp=(1, 2), encoder_backward=placements)
    return SearchSpace(problem, evaluator.reference_weights(), options), evaluator


def test_the_choice_is_offered_for_a_trainable_transposed_encoder_only():
    space, _ = _space(PLACEMENTS)
    points = list(space.enumerate())
    transposed = [(params, c) for params, c in points if c.has_transpose]
    assert transposed and all(params["encoder_backward"] == c.encoder_backward for params, c in transposed)
    assert {c.encoder_backward for _, c in transposed} == set(PLACEMENTS)
    assert all("encoder_backward" not in params and c.encoder_backward == "cooldown"
               for params, c in points if not c.has_transpose)
    frozen, _ = _space(PLACEMENTS, frozen=("encoder", "projector"))
    assert all("encoder_backward" not in params for params, _ in frozen.enumerate())
    cooldown_only, _ = _space(("cooldown",))
    assert cooldown_only.size() == len(points) - 2 * len(transposed) // 3


def test_the_evaluator_predicts_each_placement_as_predict_does():
    space, evaluator = _space(PLACEMENTS)
    c = next(c for _, c in space.enumerate() if c.has_transpose and c.pp == 4 and c.encoder_backward == "optimised")
    for placement in PLACEMENTS:
        candidate = replace(c, encoder_backward=placement)
        prediction, _ = evaluator.prediction(candidate)
        assert evaluator.evaluate(candidate).makespans_s[0] == pytest.approx(prediction.timeline.makespan_s, rel=1e-12)
    optimised, _ = evaluator.prediction(c)
    assert optimised.candidate.encoder_backward_slots == evaluator.encoder_backward_slots(c, 0)

