"""A microbatch without images skips the encoder's layers, as the cost model charges them (nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import FIRST_LLM, TEST_MODEL, WORKLOAD, make_plan  # noqa: E402

from mpipe_tune.algebra import Bwd, Fwd  # noqa: E402
from mpipe_tune.runtime import blueprint  # noqa: E402
from mpipe_tune.runtime._compute import RealCompute  # noqa: E402
from mpipe_tune.runtime import MicrobatchInputs  # noqa: E402
from mpipe_tune.runtime._mllm import LayerStack  # noqa: E402
from mpipe_tune.runtime import read_plan_file  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402

EMPTY = next(m for m, mb in enumerate(WORKLOAD.microbatches) if mb.image_tokens == 0)


def compute_of(tmp_path, schedule, cut, rank=0):
    """Pipeline rank ``rank``'s compute of a 2-rank plan, in this process (no transfers: it only runs slabs)."""
    view = read_plan_file(str(make_plan(tmp_path, schedule, cut, 2, dtype="fp64")))
    specs = blueprint(load_model(TEST_MODEL))
    stack = LayerStack.build(specs, view.layers_of(rank), seed=0, dtype=torch.float64, device=torch.device("cpu"))
    mesh = SimpleNamespace(pp_rank=rank, dp_rank=0, tp_mesh=None, encoder_mesh=None)
    compute = RealCompute(view, mesh, stack, seed=0, dtype=torch.float64, device=torch.device("cpu"), lr=0.0)
    calls = {i: 0 for i in stack.modules}
    for i, module in stack.modules.items():
        module.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return view, compute, stack, calls


def event_index(view, kind, region, mb, rank=0):
    return next(i for i in view.nodes[rank] if isinstance(e := view.events[i], kind) and (e.region, e.mb) == (region, mb))


def test_a_first_stage_runs_only_its_text_layers_on_a_microbatch_without_images(tmp_path):
    view, compute, stack, calls = compute_of(tmp_path, "1f1b", ())
    start, stop = view.slab(1, 0)
    assert start == 0 < FIRST_LLM < stop  # the encoder and some of the backbone in stage 0
    fwd = event_index(view, Fwd, 1, EMPTY)
    y = compute.forward(fwd, view.events[fwd], None)
    assert all(calls[i] == 0 for i in range(FIRST_LLM)) and all(calls[i] == 1 for i in range(FIRST_LLM, stop))
    # the same as running every layer on the empty inputs
    inputs = MicrobatchInputs(view.microbatches[EMPTY], EMPTY, 0, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(y, stack.run(start, stop, None, inputs).detach(), rtol=0, atol=0)
    bwd = event_index(view, Bwd, 1, EMPTY)
    assert compute.backward(bwd, view.events[bwd], torch.ones_like(y)) is None  # the backbone's part runs
    assert any(float(p.grad.abs().sum()) > 0 for p in stack.modules[FIRST_LLM + 1].parameters())


def test_an_encoder_slab_without_images_calls_nothing_and_hands_on_an_empty_tensor(tmp_path):
    view, _, _, _ = compute_of(tmp_path, "transpose,1f1b", (FIRST_LLM,))
    owner = next(r for r in range(2) for i in view.nodes[r]
                 if isinstance(e := view.events[i], Fwd) and (e.region, e.mb) == (1, EMPTY))
    view, compute, stack, calls = compute_of(tmp_path, "transpose,1f1b", (FIRST_LLM,), rank=owner)
    fwd = event_index(view, Fwd, 1, EMPTY, owner)
    y = compute.forward(fwd, view.events[fwd], None)
    assert sum(calls.values()) == 0 and y.shape[0] == 0  # no layer called; the gather carries nothing
    bwd = event_index(view, Bwd, 1, EMPTY, owner)
    assert compute.backward(bwd, view.events[bwd], torch.zeros_like(y)) is None  # the source needs no input grad
