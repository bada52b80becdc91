"""Issue 37 on a CPU: the profile's ``host.issue`` says how the device consumes the host's queue; an ``inline``
device (each kernel on the issuing thread) pays issue plus device time per pass, an ``async`` one the larger."""

import numpy as np
import pytest

from mpipe_tune.cost._arch import estimate_layer
from mpipe_tune.cost._kernel_passes import pass_kernels
from mpipe_tune.cost import CostOptions, build_layer_table, load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model, Microbatch, Workload

DISPATCH_S = 10e-6
DECODER = 5  # a decoder block of tiny-vit-llm


def host(issue=None):
    table = {"dispatch_s": {"value": DISPATCH_S, "source": "ideal"}, "sync_s": {"value": 20e-6, "source": "ideal"}}
    return table if issue is None else {**table, "issue": issue}


def ideal(**extra):
    return parse_profile({**load_profile("ideal").to_dict(), **extra}, where="test")


def table(profile, tokens):
    workload = Workload((Microbatch(0, tokens),), "w")
    return build_layer_table(load_model("tiny-vit-llm"), workload, profile, CostOptions(kernel_mode="eager"))


def issue_s(tokens):
    """The host's seconds issuing the decoder block's (forward, dgrad, wgrad) kernels, eager."""
    dims = load_model("tiny-vit-llm").layers[DECODER].cost.dims_dict()
    pieces = estimate_layer("dense_block", dims, Microbatch(0, tokens), dtype_bytes=2)[1].pieces
    return np.array(pass_kernels(pieces, "eager")) * DISPATCH_S


def passes(t, row=DECODER):
    return np.array([t.fwd_s[row, 0], t.dgrad_s[row, 0], t.wgrad_s[row, 0]])


@pytest.mark.parametrize("tokens", [16, 4096])
def test_an_inline_device_pays_issue_plus_device_and_an_async_one_the_larger(tokens):
    device = passes(table(ideal(), tokens))
    issue = issue_s(tokens)
    assert np.all(issue > 0) or issue[2] == 0
    inline = passes(table(ideal(host=host("inline")), tokens))
    asynchronous = passes(table(ideal(host=host("async")), tokens))
    assert inline == pytest.approx(device + issue, rel=1e-9)
    assert asynchronous == pytest.approx(np.maximum(device, issue), rel=1e-9)
    assert np.all(inline > asynchronous)


def test_an_inline_pass_splits_its_seconds_into_issue_and_device_parts():
    t = table(ideal(host=host("inline")), 4096)
    compute, memory, host_s, comm = (b[DECODER, 0] for b in t.bound_s)
    assert host_s == pytest.approx(issue_s(4096).sum(), rel=1e-9)
    assert compute + memory == pytest.approx(passes(table(ideal(), 4096)).sum(), rel=1e-9) and comm == 0


def test_a_profile_without_issue_reads_as_async_and_inline_survives_its_json_form():
    plain = ideal(host=host())
    assert plain.host.issue == "async" and not plain.host.inline
    assert passes(table(plain, 16)) == pytest.approx(passes(table(ideal(host=host("async")), 16)), rel=1e-12)
    assert "issue" not in plain.to_dict()["host"]  # the default is not written: existing profiles keep their hash
    inline = ideal(host=host("inline"))
    again = parse_profile(inline.to_dict(), where="again")
    assert again == inline and again.host.inline and again != plain


@pytest.mark.parametrize("value", ["sync", "", 1, None])
def test_a_bad_issue_is_one_line_naming_the_field_and_the_allowed_values(value):
    with pytest.raises(MpipeError) as error:
        ideal(host=host(value) if value is not None else {**host(), "issue": None})
    message = str(error.value)
    assert "host.issue" in message and "async, inline" in message and "\n" not in message


def test_an_inline_device_adds_the_optimizer_issue_to_its_update():
    from mpipe_tune.algebra import Cut, parse_schedule
    from conftest import predict_plan

    model = load_model("tiny-vit-llm")
    workload = Workload(tuple(Microbatch(0, 64) for _ in range(2)), "two")
    slow = {**host(), "dispatch_s": {"value": 1.0, "source": "ideal"}}  # the issue dwarfs the update

    def update_s(profile):
        result = predict_plan(Cut(()), parse_schedule("1f1b"), model, workload, profile, 2,
                              options=CostOptions(dtype="fp32", kernel_mode="eager"))
        last = [i for i in result.plan.order.nodes[0]][-2]  # the rank's last event before the step barrier
        return float(result.timeline.durations_s[last])

    device, asynchronous = update_s(ideal()), update_s(ideal(host=slow))
    inline = update_s(ideal(host={**slow, "issue": "inline"}))
    assert asynchronous > 1.0 > device
    assert inline - asynchronous == pytest.approx(device, rel=1e-6)


def test_a_kind_calibrated_on_the_runtime_s_layers_keeps_its_fit_over_the_kernel_model():
    # Its fixed seconds per call were fitted to whole layer calls, issue included: neither the curves nor an
    # inline host's issue are charged on top; a kind without its own calibrated entry still gets both.
    curves = {"gemm": {"max": 0.8, "half_dim": 128, "tile_m": 128, "tile_n": 128, "units": 132, "source": "ideal"}}
    base = load_profile("ideal").to_dict()
    calibrated = {**base, "efficiency": {**base["efficiency"], "dense_block": {
        "value": 0.5, "forward_overhead_s": 1e-3, "backward_overhead_s": 2e-3, "source": "ideal"}}}
    fitted_only = passes(table(parse_profile(calibrated, where="t"), 64))
    both = parse_profile({**calibrated, "host": host("inline"), "kernel_efficiency": curves}, where="t")
    assert both.calibrated("dense_block") and not both.calibrated("lm_head")
    assert passes(table(both, 64)) == pytest.approx(fitted_only, rel=1e-12)
    head = len(load_model("tiny-vit-llm").layers) - 1
    assert passes(table(both, 64), head)[0] > passes(table(parse_profile(calibrated, where="t"), 64), head)[0]
