"""Reading a plan for execution: transfers, what each rank holds, shapes; checks without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from runtime_plans import FIRST_LLM, TEST_MODEL, WORKLOAD, make_plan

from mpipe_tune.algebra import Bwd, Coll, Comm, Fwd
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.runtime import blueprint, output_shape, read_plan_file
from mpipe_tune.inputs import load_model


def test_every_coll_becomes_one_transfer_between_the_right_events(tmp_path):
    view = read_plan_file(str(make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 2)))
    transfers = {t.index: t for ts in view.sends.values() for t in ts}
    colls = [i for i, e in enumerate(view.events) if isinstance(e, Coll)]
    assert sorted(transfers) == colls
    assert {t.index: t for ts in view.recvs.values() for t in ts} == transfers
    for t in transfers.values():
        coll, producer, consumer = view.events[t.index], view.events[t.producer], view.events[t.consumer]
        assert (t.src_rank, t.dst_rank) == (coll.src[1], coll.dst[1])
        if coll.comm is Comm.GATHER:  # the encoder's output, from its owner into the first backbone stage
            assert isinstance(producer, Fwd) and isinstance(consumer, Fwd) and not t.gradient
            assert t.boundary_layer == FIRST_LLM - 1
        if coll.comm is Comm.SCATTER:  # the gradient of that same tensor, back to the owner
            assert isinstance(producer, Bwd) and isinstance(consumer, Bwd) and t.gradient
            assert t.boundary_layer == FIRST_LLM - 1
        if coll.comm is Comm.SEND:
            assert t.boundary_layer == view.slab(*coll.src)[1] - 1
    assert any(t.is_local for t in transfers.values())  # rank 0's own encodes feed its stage locally


def test_every_rank_holds_the_replicated_region_even_without_microbatches_of_it(tmp_path):
    two = Workload(WORKLOAD.microbatches[:2], "two")
    view = read_plan_file(str(make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 4, workload=two)))
    for rank in range(4):
        start, stop = view.slab(2, rank)
        assert view.layers_of(rank) == tuple(range(FIRST_LLM)) + tuple(range(start, stop))


def test_input_gradients_follow_the_footprint(tmp_path):
    frozen = read_plan_file(str(make_plan(tmp_path, "transpose,1f1b", (FIRST_LLM,), 2, frozen=("encoder", "projector"))))
    first_stage_bwds = [i for i, e in enumerate(frozen.events) if isinstance(e, Bwd) and (e.region, e.rank) == (2, 0)]
    assert first_stage_bwds and not any(frozen.needs_input_grad(i) for i in first_stage_bwds)
    assert not any(frozen.records_autograd(e) for e in frozen.events if isinstance(e, Fwd) and e.region == 1)


def test_output_shapes_match_the_modules():
    torch = pytest.importorskip("torch")
    from mpipe_tune.runtime import MicrobatchInputs
    from mpipe_tune.runtime._mllm import LayerStack

    specs = blueprint(load_model(TEST_MODEL))
    stack = LayerStack.build(specs, range(len(specs)), seed=0, dtype=torch.float64, device=torch.device("cpu"))
    for m, mb in enumerate(WORKLOAD.microbatches):
        x = None
        for spec in specs:
            x = stack.modules[spec.index](x, MicrobatchInputs(mb, m, 0, torch.float64, torch.device("cpu")))
            assert tuple(x.shape) == output_shape(spec, mb), spec.name


@pytest.mark.parametrize("layers,words", [
    ([{"name": "a", "block": "llm", "kind": "dense_block", "hidden": 8, "heads": 2, "ffn": 8}], "takes a sequence tensor"),
    ([{"name": "e", "block": "llm", "kind": "embedding", "vocab": 8, "hidden": 8},
      {"name": "a", "block": "llm", "kind": "dense_block", "hidden": 8, "heads": 2, "ffn": 8}], "needs an lm_head"),
    ([{"name": "e", "block": "llm", "kind": "embedding", "vocab": 8, "hidden": 8},
      {"name": "h", "block": "llm", "kind": "lm_head", "hidden": 16, "vocab": 8}], "input width 16"),
])
def test_models_the_runtime_cannot_build_get_one_line(tmp_path, layers, words):
    from mpipe_tune.algebra import parse_model

    with pytest.raises(MpipeError, match=words):
        blueprint(parse_model({"name": "bad", "layers": layers}, where="test"))


def test_image_tokens_must_fit_in_the_sequence(tmp_path):
    too_many = Workload((Microbatch(8, 4),), "bad")
    path = make_plan(tmp_path, "1f1b", (), 2, workload=too_many)
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "run", str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "image_tokens <= text_tokens" in proc.stderr


def test_pre_flight_needs_no_torch(tmp_path):
    """The run command's checks import no torch: a corrupt plan fails in one line with torch blocked."""
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    code = ("import sys; sys.modules['torch'] = None; from mpipe_tune.cli import main; "
            f"sys.exit(main(['run', {str(bad)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
