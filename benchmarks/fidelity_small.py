"""The fidelity benchmark's small-model, short-sequence set (issue 37 item 6).

Language models of width 128, 256 and 512 (``benchmarks/models/small-llm-h*.yaml``, 4 decoder blocks,
vocabulary 2,048) trained at micro-batch 1 on samples of 64-256 tokens: kernels so small that on these
CPUs the host's cost per operator, not FLOPs or bytes, sets the step. Each case runs as a pipeline of
2 stages, 2 data-parallel replicas and 2 tensor-parallel ranks (2 ranks each: one core per rank),
predicted on the same 2-rank profile as the main set (calibrated on ``small-vit-llm``: these models
are held out of every fit), and beside each prediction stands what the roofline alone would have
predicted: the same profile without the host's issue cost, the kernel-efficiency curves or any fixed
seconds per call (:func:`roofline_profile`).
"""

from __future__ import annotations

from pathlib import Path

from mpipe_tune.cost import HardwareProfile, parse_profile
from mpipe_tune.inputs import Microbatch, Workload

HERE = Path(__file__).resolve().parent
SMALL_SAMPLES = 4
"""Samples in a step's global batch, one per microbatch."""
CASES = ((128, 64), (128, 256), (256, 64), (256, 128), (512, 64))
"""(model width, tokens a sample)."""
LAYOUTS = (("pp2 M=4", {"pp": 2, "num_microbatches": 4}),
           ("dp2 M=2", {"pp": 1, "dp": 2, "num_microbatches": 2}),
           ("tp2 M=4", {"pp": 1, "tp": 2, "num_microbatches": 4}))
"""Each case's plans: a label and the Spec fields that set the layout (2 ranks each)."""
QUICK = ("small h128 64tok pp2 M=4", "small h256 64tok tp2 M=4")
_PER_CALL = ("forward_overhead_s", "backward_overhead_s", "forward_image_overhead_s", "backward_image_overhead_s",
             "tp_overhead_s", "tp_slowdown", "tp_calibration")
_ISSUE_TABLES = ("host", "kernel_efficiency")


def model_path(width: int) -> Path:
    return HERE / "models" / f"small-llm-h{width}.yaml"


def cases() -> list[tuple[str, Path, int, dict]]:
    """Every plan of the set: (label, model file, tokens a sample, layout fields)."""
    return [(f"small h{width} {tokens}tok {name}", model_path(width), tokens, layout)
            for width, tokens in CASES for name, layout in LAYOUTS]


def text_workload(tokens: int, num_microbatches: int, dp: int = 1) -> Workload:
    """One replica's share of ``SMALL_SAMPLES`` text samples of ``tokens``, one sample a microbatch."""
    assert num_microbatches * dp == SMALL_SAMPLES, (num_microbatches, dp)
    return Workload(tuple(Microbatch(0, tokens, ()) for _ in range(num_microbatches)),
                    f"small-{SMALL_SAMPLES // dp}x{tokens}/M{num_microbatches}")


def roofline_profile(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` as the roofline alone sees it: each kind's efficiency kept, its fixed seconds per call,
    per image and per split call dropped, and no host issue cost or kernel-efficiency curves."""
    data = profile.to_dict()
    for table in _ISSUE_TABLES:
        data.pop(table, None)
    for entry in data["efficiency"].values():
        for key in _PER_CALL:
            entry.pop(key, None)
    return parse_profile(data, where=f"{profile.name} without its per-call terms")
