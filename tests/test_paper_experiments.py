"""The paper's two experiments as ``benchmarks/bench_paper_configs.py`` states them: the CapsFusion-shaped data is
what its generator writes and reads as one image and a short caption a sample; Experiment A's layout is a plan
on 512 dies of the per-die 910C profile."""

from dataclasses import replace

import numpy as np
import pytest

from conftest import benchmark_module
from mpipe_tune.search import baseline, Evaluator


@pytest.fixture(scope="module")
def paper():
    yield from benchmark_module("bench_paper_configs")


def test_the_shipped_manifest_is_what_the_generator_writes(paper) -> None:
    rows = paper.capsfusion_rows()
    lines = paper.CAPSFUSION.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "text_tokens,image_width,image_height"
    assert [tuple(map(int, line.split(","))) for line in lines[1:]] == rows


def test_capsfusion_shaped_samples_are_one_image_and_a_short_caption(paper) -> None:
    from mpipe_tune.inputs import load_model, DatasetOptions, load_dataset

    b = next(e for e in paper.EXPERIMENTS if e.key == "B")
    model = load_model(b.model)
    dataset, _ = load_dataset(str(paper.CAPSFUSION), b.model, model, DatasetOptions())
    step = dataset.workload(64, seed=0)  # unpacked: one sample a sequence
    assert all(len(mb.images) == 1 for mb in step.microbatches)
    text = np.array([mb.text_tokens - mb.image_tokens for mb in step.microbatches])
    assert 20 <= text.mean() <= 40  # 22.74 words a caption at 1.3 tokens a word
    assert np.mean([mb.image_tokens for mb in step.microbatches]) > 5 * text.mean()  # the image dominates


def test_experiment_a_is_a_plan_on_512_dies_that_fits_with_recomputation(paper) -> None:
    a = next(e for e in paper.EXPERIMENTS if e.key == "A")
    problem = replace(a.problem(), num_samples=1)
    assert problem.profile.name == "ascend-910c-cm384-die" and problem.devices == 512
    evaluator = Evaluator(problem)
    for name in (a.baseline, "mpipe-rr"):
        c = replace(baseline(name, problem.model, a.pp, a.tp, a.dp, a.microbatches), recompute=True, ep=a.ep)
        assert c.degrees.num_devices == 512
        result = evaluator.evaluate(c)
        assert result.fits, (name, result.peak_bytes / 2**30)
