"""The layer table costs every microbatch of a layer in one elementwise pass: the same figures as one
microbatch at a time, and the same tables whether workloads are built alone or together."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpipe_tune.algebra import Degrees, ArchCost
from mpipe_tune.cost._layers import CostOptions, arch_columns, arch_seconds, build_layer_table, build_layer_tables
from mpipe_tune.cost import load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload, load_workload

# Sampled microbatches, plus a text-only one, an image-only one and one of three images of unequal size.
MICROBATCHES = (*load_workload("balanced", num_microbatches=6, seed=3).microbatches,
                Microbatch(0, 100), Microbatch(300, 0), Microbatch(50, 20, (10, 30, 10)))
CASES = [("qwen2vl-vit-llama3-8b", "h100-sxm", Degrees(1, tp=tp, cp=cp), sp, "bf16")
         for tp, cp, sp in itertools.product((1, 2, 8), (1, 2), (False, True))]
CASES += [("qwen2vl-vit-deepseek-v3", "ascend-910c-cm384", Degrees(1, tp=tp, ep=ep, cp=cp), False, "bf16")
          for tp, ep, cp in ((1, 1, 1), (2, 8, 1), (4, 16, 2))]
CASES += [("qwen2vl-vit-llama3-8b", "h100-sxm", Degrees(1, tp=4), True, "fp8")]


@pytest.mark.parametrize("model_name,profile_name,degrees,sequence_parallel,dtype", CASES)
def test_a_layer_on_all_microbatches_at_once_costs_what_each_costs_alone(model_name, profile_name, degrees,
                                                                         sequence_parallel, dtype):
    model, profile = load_model(model_name), load_profile(profile_name)
    options = CostOptions(dtype=dtype, degrees=degrees, sequence_parallel=sequence_parallel)
    for cost in {u.cost for u in model.layers if isinstance(u.cost, ArchCost)}:
        columns = arch_columns(cost, MICROBATCHES, profile, options)
        assert columns.shape == (13, len(MICROBATCHES))
        for m, mb in enumerate(MICROBATCHES):
            alone = np.array(arch_seconds(cost, mb, profile, options), dtype=float)
            np.testing.assert_allclose(columns[:, m], alone, rtol=1e-12, atol=0.0, err_msg=f"{cost.kind} {mb}")


def test_a_layer_without_tokens_of_its_stream_costs_nothing():
    model, profile = load_model("qwen2vl-vit-llama3-8b"), load_profile("h100-sxm")
    options = CostOptions(degrees=Degrees(1, tp=2, cp=2))
    vit = next(u.cost for u in model.layers if u.cost.kind == "vit_block")
    text = next(u.cost for u in model.layers if u.cost.kind == "dense_block")
    assert not arch_columns(vit, (Microbatch(0, 100),), profile, options).any()
    assert not arch_columns(text, (Microbatch(300, 0),), profile, options).any()
    assert arch_columns(vit, (Microbatch(300, 0),), profile, options)[0].all()  # its forward takes time


@pytest.mark.parametrize("encoder_tp", [None, 1])
def test_the_tables_of_several_workloads_built_together_equal_each_built_alone(encoder_tp):
    model, profile = load_model("qwen2vl-vit-llama3-8b"), load_profile("h100-sxm")
    options = CostOptions(degrees=Degrees(1, tp=4, encoder_tp=encoder_tp), recompute="selective")
    workloads = [Workload(MICROBATCHES[:4]), Workload(MICROBATCHES[4:5]), Workload(MICROBATCHES[5:])]
    for together, workload in zip(build_layer_tables(model, workloads, profile, options), workloads):
        alone = build_layer_table(model, workload, profile, options)
        for name, value in vars(alone).items():
            if value is None:
                assert getattr(together, name) is None, name
            else:
                np.testing.assert_array_equal(getattr(together, name), value, err_msg=name)
