"""What a split layer call costs beyond its price (``tp_overhead_s`` fixed, ``tp_slowdown`` per priced
second; ``ep_overhead_s`` and ``ep_slowdown`` for a MoE layer's experts spread): parsed and written back by the
profile, charged by the cost model at the profiled tensor- or expert-parallel degree only, and fitted by the
profiler so that the cost model reproduces the split layers it timed."""

import json

import numpy as np
import pytest

from mpipe_tune.algebra import Degrees
from mpipe_tune.cost import CostOptions, build_layer_table, layer_seconds, load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.profiler._build import split_call_entries
from mpipe_tune.profiler._calibrate import LayerPoint, calibration_microbatch
from mpipe_tune.profiler import summarize
from mpipe_tune.inputs import load_model

MODEL = load_model("tiny-vit-llm")
RUNTIME = CostOptions(dtype="fp32", degrees=Degrees(1, tp=2), rope="none")
"""How the profiler prices the layers the runtime timed (it applies no RoPE) at tp 2."""
FWD_S, BWD_S = 4e-4, 9e-4


def with_overhead(kind="dense_block", table=None):
    data = load_profile("ideal").to_dict()
    data["efficiency"][kind] = {"value": 1.0, "tp_overhead_s": {"2": [FWD_S, BWD_S]} if table is None else table, "source": "ideal"}
    return parse_profile(data, where="test")


def test_the_profile_reads_and_writes_the_split_overheads():
    profile = with_overhead()
    assert profile.tp_overhead_for("dense_block", 2) == (FWD_S, BWD_S)
    assert profile.tp_overhead_for("dense_block", 4) == (0.0, 0.0)  # a degree it was not measured at
    assert profile.tp_overhead_for("vit_block", 2) == (0.0, 0.0)  # the default entry gives none
    assert parse_profile(json.loads(json.dumps(profile.to_dict())), where="round trip") == profile


@pytest.mark.parametrize("table, words", [
    ({"1": [0.0, 0.0]}, "is keyed by a parallel degree"),
    ({"2": [1e-4]}, "must be [forward, backward]"),
    ({"2": [-1e-4, 0.0]}, "must be >= 0"),
    ({}, "must be a non-empty object"),
])
def test_a_bad_split_overhead_is_one_line_naming_the_field(table, words):
    with pytest.raises(MpipeError, match="tp_overhead_s") as caught:
        with_overhead(table=table)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_split_layers_pay_it_per_call_at_that_degree_only():
    workload = Workload((Microbatch(16, 64), Microbatch(0, 32), Microbatch(16, 0)), "three")
    dense = np.array([u.cost.kind == "dense_block" for u in MODEL.layers])
    assert dense.any()
    for tp, paid in ((2, True), (1, False)):
        options = CostOptions(dtype="fp32", degrees=Degrees(1, tp=tp))
        plain = build_layer_table(MODEL, workload, load_profile("ideal"), options)
        charged = build_layer_table(MODEL, workload, with_overhead(), options)
        has_text = np.array([1.0, 1.0, 0.0])  # a layer with no tokens makes no call
        np.testing.assert_allclose(charged.fwd_s[dense] - plain.fwd_s[dense],
                                   np.outer(np.ones(dense.sum()), has_text * FWD_S * paid), atol=1e-15)
        np.testing.assert_allclose((charged.backward_s(MODEL) - plain.backward_s(MODEL))[dense],
                                   np.outer(np.ones(dense.sum()), has_text * BWD_S * paid), atol=1e-15)
        np.testing.assert_array_equal(charged.fwd_s[~dense], plain.fwd_s[~dense])


def test_fitted_overheads_make_the_cost_model_reproduce_the_timed_split_layers():
    """Split layers timed at (priced x (1 + slowdown) + overhead) per phase: the fit recovers both
    numbers of each kind, and the cost model on the fitted profile reproduces every timed point."""
    base = load_profile("ideal").to_dict()
    priced = parse_profile(base, where="test")
    names = {u.cost.kind: u.name for u in MODEL.layers}
    # kind -> ((forward overhead, slowdown), (backward overhead, slowdown))
    truth = {"dense_block": ((2e-3, 0.0), (5e-3, 0.0)), "vit_block": ((1e-3, 0.5), (0.0, 1.5)),
             "lm_head": ((-1e-3, 0.0), (-1e-3, 0.0))}
    points = []
    for kind, ((fwd_a, fwd_c), (bwd_a, bwd_c)) in truth.items():
        layer = next(u for u in MODEL.layers if u.name == names[kind])
        for tokens in (64, 256, 512):
            fwd, dgrad, wgrad, call = layer_seconds(layer.cost, layer.block, calibration_microbatch(MODEL, tokens),
                                                    priced, RUNTIME)
            bwd = dgrad + wgrad + call
            points.append(LayerPoint(layer.name, kind, tokens, "fwd", 0.0, 0.0,
                                     summarize([fwd * (1 + fwd_c) + fwd_a]), tp=2))
            points.append(LayerPoint(layer.name, kind, tokens, "bwd", 0.0, 0.0,
                                     summarize([bwd * (1 + bwd_c) + bwd_a]), tp=2, input_grad=True))
    for kind in truth:
        base["efficiency"][kind] = {"value": 1.0, "source": "ideal"}
    split_call_entries(base, points, MODEL, "fp32")
    fitted = parse_profile(base, where="fitted")
    for kind in ("dense_block", "vit_block"):
        (fwd_a, fwd_c), (bwd_a, bwd_c) = truth[kind]
        assert fitted.tp_overhead_for(kind, 2) == pytest.approx((fwd_a, bwd_a), abs=1e-12)
        assert fitted.tp_slowdown_for(kind, 2) == pytest.approx((fwd_c, bwd_c), abs=1e-9)
    # faster than priced: nothing taken off
    assert fitted.tp_overhead_for("lm_head", 2) == fitted.tp_slowdown_for("lm_head", 2) == (0.0, 0.0)
    for point in points:
        if point.kind == "lm_head":
            continue
        layer = next(u for u in MODEL.layers if u.name == point.layer_name)
        fwd, dgrad, wgrad, call = layer_seconds(layer.cost, layer.block, calibration_microbatch(MODEL, point.tokens),
                                                fitted, RUNTIME)
        assert (fwd if point.phase == "fwd" else dgrad + wgrad + call) == pytest.approx(point.seconds.median, rel=1e-9)
    evidence = fitted.provenance["efficiency.dense_block"]["tp_calibration"]["2"]
    assert len(evidence["median_s"]) == len(evidence["predicted_s"]) == 6
    assert sum(fitted.tp_overhead_for("default", 2)) + sum(fitted.tp_slowdown_for("default", 2)) > 0  # every kind's points


def test_a_slowdown_charges_a_large_split_call_more_than_a_small_one():
    data = load_profile("ideal").to_dict()
    data["efficiency"]["dense_block"] = {"value": 1.0, "tp_slowdown": {"2": [0.5, 1.0]}, "source": "ideal"}
    slowed = parse_profile(data, where="test")
    assert parse_profile(json.loads(json.dumps(slowed.to_dict())), where="round trip") == slowed
    layer = next(u for u in MODEL.layers if u.cost.kind == "dense_block")
    for tokens in (64, 512):
        mb = calibration_microbatch(MODEL, tokens)
        for tp, factors in ((2, (1.5, 2.0)), (1, (1.0, 1.0))):
            options = CostOptions(dtype="fp32", degrees=Degrees(1, tp=tp))
            fwd, dgrad, wgrad, call = layer_seconds(layer.cost, layer.block, mb, load_profile("ideal"), options)
            s_fwd, s_dgrad, s_wgrad, s_call = layer_seconds(layer.cost, layer.block, mb, slowed, options)
            assert s_fwd == pytest.approx(fwd * factors[0])
            assert s_dgrad + s_wgrad + s_call == pytest.approx((dgrad + wgrad + call) * factors[1])
    with pytest.raises(MpipeError, match="tp_slowdown.2"):
        data["efficiency"]["dense_block"]["tp_slowdown"] = {"2": [-0.1, 0.0]}
        parse_profile(data, where="test")


def test_split_calls_are_fitted_to_their_median_time():
    """A split point whose repeats have a slow tail is charged its median, the typical call, not its mean: in a
    step the ranks run in lockstep and its split calls do not pay the calibration's tail (measured, with the
    host's drift taken out, in docs/profiling.md); the mean stays in the evidence beside it."""
    base = load_profile("ideal").to_dict()
    priced = parse_profile(base, where="test")
    layer = next(u for u in MODEL.layers if u.cost.kind == "dense_block")
    points = []
    for tokens in (64, 256, 512):
        fwd, dgrad, wgrad, call = layer_seconds(layer.cost, layer.block, calibration_microbatch(MODEL, tokens),
                                                priced, RUNTIME)
        for phase, price in (("fwd", fwd), ("bwd", dgrad + wgrad + call)):
            samples = [price + 1e-3] * 3 + [price + 9e-3]  # median 1 ms over the price, mean 3 ms over it
            points.append(LayerPoint(layer.name, "dense_block", tokens, phase, 0.0, 0.0, summarize(samples), tp=2,
                                     input_grad=phase == "bwd"))
    base["efficiency"]["dense_block"] = {"value": 1.0, "source": "ideal"}
    split_call_entries(base, points, MODEL, "fp32")
    fitted = parse_profile(base, where="fitted")
    assert fitted.tp_overhead_for("dense_block", 2) == pytest.approx((1e-3, 1e-3), abs=1e-12)
    assert fitted.tp_slowdown_for("dense_block", 2) == pytest.approx((0.0, 0.0), abs=1e-9)
    evidence = fitted.provenance["efficiency.dense_block"]["tp_calibration"]["2"]
    assert evidence["median_s"] == pytest.approx([p.seconds.median for p in points])
    assert evidence["mean_s"] == pytest.approx([p.seconds.median + 2e-3 for p in points])


def test_expert_parallel_calls_are_fitted_and_charged_for_the_moe_kind_at_that_degree_only():
    """MoE layers timed with their experts over two ranks at (priced x (1 + slowdown) + overhead): the fit
    recovers both numbers for the kind (no default entry: no other kind spreads experts), and the cost model
    charges them to that kind at ep 2 alone, reproducing every timed point."""
    moe = load_model("tests/runtime/tiny-mla-moe.yaml")
    at_ep = CostOptions(dtype="fp32", degrees=Degrees(1, dp=2, ep=2), rope="none")
    base = load_profile("ideal").to_dict()
    priced = parse_profile(base, where="test")
    (fwd_a, fwd_c), (bwd_a, bwd_c) = (2e-3, 0.25), (1e-3, 0.5)
    points = []
    for layer in (u for u in moe.layers if u.cost.kind == "moe_block"):
        for tokens in (16, 64, 256):
            fwd, dgrad, wgrad, call = layer_seconds(layer.cost, layer.block, calibration_microbatch(moe, tokens),
                                                    priced, at_ep)
            points.append(LayerPoint(layer.name, "moe_block", tokens, "fwd", 0.0, 0.0,
                                     summarize([fwd * (1 + fwd_c) + fwd_a]), ep=2))
            points.append(LayerPoint(layer.name, "moe_block", tokens, "bwd", 0.0, 0.0,
                                     summarize([(dgrad + wgrad + call) * (1 + bwd_c) + bwd_a]), ep=2))
    base["efficiency"]["moe_block"] = {"value": 1.0, "source": "ideal"}
    split_call_entries(base, points, moe, "fp32", split="ep")
    fitted = parse_profile(json.loads(json.dumps(base)), where="fitted")
    assert fitted.ep_overhead_for("moe_block", 2) == (pytest.approx((fwd_a, bwd_a), abs=1e-12),
                                                      pytest.approx((fwd_c, bwd_c), abs=1e-9))
    assert fitted.ep_overhead_for("moe_block", 4) == fitted.ep_overhead_for("dense_block", 2) == ((0.0, 0.0),) * 2
    assert "ep_overhead_s" not in base["efficiency"]["default"] and fitted.tp_overhead_for("moe_block", 2) == (0, 0)
    assert parse_profile(fitted.to_dict(), where="round trip") == fitted
    for point in points:
        layer = next(u for u in moe.layers if u.name == point.layer_name)
        fwd, dgrad, wgrad, call = layer_seconds(layer.cost, layer.block, calibration_microbatch(moe, point.tokens),
                                                fitted, at_ep)
        assert (fwd if point.phase == "fwd" else dgrad + wgrad + call) == pytest.approx(point.seconds.median, rel=1e-9)
    whole = CostOptions(dtype="fp32", degrees=Degrees(1, dp=2), rope="none")  # ep 1: nothing spread, nothing charged
    layer = next(u for u in moe.layers if u.cost.kind == "moe_block")
    mb = calibration_microbatch(moe, 64)
    assert layer_seconds(layer.cost, layer.block, mb, fitted, whole) == layer_seconds(layer.cost, layer.block, mb,
                                                                                      priced, whole)
    evidence = fitted.provenance["efficiency.moe_block"]["ep_calibration"]["2"]
    assert len(evidence["median_s"]) == len(points) and "experts spread over 2 ranks" in evidence["ref"]
