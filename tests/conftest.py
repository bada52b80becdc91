"""Shared test helpers: small explicit-cost models and uniform workloads."""

from __future__ import annotations

import os

from hypothesis import settings

from mpipe_tune.algebra.model import ExplicitCost, Layer, Model
from mpipe_tune.cost.workload import Microbatch, Workload

# A fast profile for local runs, a thorough one for CI (CI=true).
settings.register_profile("fast", max_examples=40, deadline=None)
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile("thorough" if os.environ.get("CI") else "fast")


def make_model(blocks, fwd=1.0, bwd=2.0, trainable=None, name="test") -> Model:
    """One explicit-cost layer per entry of ``blocks`` (e.g. ["encoder", "encoder", "llm", ...])."""
    trainable = trainable or [True] * len(blocks)
    layers = tuple(
        Layer(f"{b}{i}", b, t, ExplicitCost(fwd, bwd)) for i, (b, t) in enumerate(zip(blocks, trainable))
    )
    return Model(name, layers)


def uniform_workload(num_microbatches: int, image_tokens: int = 1, text_tokens: int = 1) -> Workload:
    return Workload(tuple(Microbatch(image_tokens, text_tokens) for _ in range(num_microbatches)), "uniform")


def with_link(collective: str, link, profile=None):
    """``profile`` (default: ``ideal``) with ``collective`` costing ``link`` (a LinkCost) on both link
    classes, the rest unchanged."""
    from mpipe_tune.cost.profile import load_profile, parse_profile

    data = (profile or load_profile("ideal")).to_dict()
    for link_class in ("intra_node", "inter_node"):
        data["links"][link_class][collective] = {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
                                                 "source": "ideal"}
    return parse_profile(data, where="test")
