"""Today's layer variants on the executor: a 2-rank pipelined plan of a model with Gated DeltaNet (dense and MoE),
gated sliding-window attention, a windowed ViT with layer scale, a DeepStack tap whose feature crosses the stage
boundary to the first decoder layer, and InternVL's pixel shuffle computes the single-process step (float64)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from runtime_plans import WORKLOAD, assert_case_equals_reference, run_plan_cases  # noqa: E402

from mpipe_tune.errors import MpipeError  # noqa: E402
from mpipe_tune.inputs import load_model  # noqa: E402
from mpipe_tune.runtime._blueprint import blueprint, output_shape, validate_variants  # noqa: E402

VARIANTS = str(Path(__file__).with_name("tiny-mllm-variants.yaml"))
FIRST_LLM = 5
CASES = {
    # the encoder and the embedding on rank 0: the DeepStack feature crosses to rank 1 packed with the sequence
    "1f1b, encoder in the first stage": {"schedule": "1f1b", "cut": (), "num_ranks": 2, "model_spec": VARIANTS},
    # the encoder replicated: the Gather carries the projector's output with the feature beside it
    "transpose,1f1b": {"schedule": "transpose,1f1b", "cut": (FIRST_LLM,), "num_ranks": 2, "model_spec": VARIANTS},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_plan_cases(tmp_path_factory.mktemp("variants"), CASES, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_the_single_process_step(runs, case):
    assert_case_equals_reference(runs, case, CASES[case], 2)


def test_a_boundary_before_the_injection_carries_the_deepstack_feature():
    specs = blueprint(load_model(VARIANTS))
    mb = WORKLOAD.microbatches[0]  # 3 image tokens, 8 text tokens
    assert output_shape(specs[FIRST_LLM], mb) == (8 * 16 + 3 * 16,)
    assert output_shape(specs[FIRST_LLM + 1], mb) == (8, 16)  # injected: nothing carried past it


def test_splitting_a_variant_layer_is_one_line():
    with pytest.raises(MpipeError, match="tensor-, context- and expert-parallel degrees 1 only"):
        validate_variants(blueprint(load_model(VARIANTS)), tp_degree=2, cp_degree=1, ep_degree=1)
