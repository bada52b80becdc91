"""Recomputation granularity: none, selective (the attention core) and full, in time and memory."""

from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.cost import _arch as arch, CostOptions, build_layer_table, load_profile
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model

IDEAL = load_profile("ideal")
TINY = load_model("tiny-vit-llm")
WORKLOAD = Workload((Microbatch(64, 128), Microbatch(16, 256)), "two")


def tables():
    return {g: build_layer_table(TINY, WORKLOAD, IDEAL, CostOptions(recompute=g))
            for g in ("none", "selective", "full")}


def test_selective_recomputation_re_runs_the_attention_core_before_the_backward():
    t = tables()
    peak, bandwidth = IDEAL.peak("bf16"), IDEAL.memory_bytes_per_s
    for i, layer in enumerate(TINY.layers):
        for m, mb in enumerate(WORKLOAD.microbatches):
            core = 0.0
            if layer.cost.kind in ("vit_block", "dense_block"):
                work = arch.estimate_arch_work(layer.cost.kind, layer.cost.dims_dict(), mb, dtype_bytes=2)
                core = max(work.attention_core_fwd_flops / peak, work.attention_core_fwd_bytes / bandwidth)
                assert core > 0
            assert t["selective"].recompute_s[i, m] == pytest.approx(core, rel=1e-12, abs=0)
    backward = {g: table.backward_s(TINY) for g, table in t.items()}
    assert np.all(backward["none"] <= backward["selective"]) and np.all(backward["selective"] <= backward["full"])
    assert np.array_equal(t["none"].fwd_s, t["selective"].fwd_s)


def test_selective_recomputation_frees_nothing_under_fused_attention():
    # The fused core saves no score matrix, its inputs q, k, v are what a re-run needs, and its output
    # is the output projection's saved input: Megatron Bridge's activation-recomputation guide advises
    # comparing core_attn against no recomputation with fused or flash attention for this reason
    # (https://docs.nvidia.com/nemo/megatron-bridge/latest/training/activation-recomputation.html).
    t = tables()
    assert np.array_equal(t["selective"].saved_bytes, t["none"].saved_bytes)
    assert np.array_equal(t["full"].saved_bytes, t["full"].boundary_bytes)  # full keeps each layer's input


def test_full_and_none_are_the_old_booleans():
    t = tables()
    old_full = build_layer_table(TINY, WORKLOAD, IDEAL, CostOptions(recompute=True))
    old_none = build_layer_table(TINY, WORKLOAD, IDEAL, CostOptions(recompute=False))
    for new, old in ((t["full"], old_full), (t["none"], old_none)):
        assert np.array_equal(new.saved_bytes, old.saved_bytes) and np.array_equal(new.recompute_s, old.recompute_s)
    assert np.array_equal(t["full"].recompute_s, t["full"].fwd_s)
    assert not t["none"].recompute_s.any()

def test_recompute_granularity_reads_the_old_spellings():
    assert CostOptions(recompute=True) == CostOptions(recompute="full")
    assert CostOptions(recompute=False) == CostOptions(recompute="none") == CostOptions()
    assert CostOptions(recompute="selective").recompute_granularity == "selective"
    with pytest.raises(MpipeError, match="is not a granularity; use one of none, selective, full"):
        CostOptions(recompute="partial")
    assert replace(CostOptions(), recompute="full").recompute is True
