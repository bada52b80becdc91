"""Workloads: files, named mixes, Qwen2-VL image tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpipe_tune.inputs._workload import (
    DEFAULT_NUM_MICROBATCHES, MIXES, Microbatch, Mix, Workload, dump_workload, image_tokens_for, load_workload,
    parse_workload, sample_workload, workload_hash,
)
from mpipe_tune.errors import MpipeError

# ---------------------------------------------------------------------------- image tokens


@pytest.mark.parametrize(
    ("height", "width", "tokens"),
    [
        (448, 448, 16 * 16),
        (224, 224, 8 * 8),
        (28, 28, 2 * 2),  # 784 px < min_pixels 3136: scaled up by 2 to 56x56
        (1, 1, 2 * 2),
        (896, 1120, 32 * 40),  # exactly max_pixels
        (8960, 11200, 32 * 40),  # 10x too large per side: scaled down onto max_pixels
        (10000, 10000, 35 * 35),  # clamped down, rounded down: 980x980 px
        (480, 640, 17 * 23),  # 476x644: each side to the nearest multiple of 28
        (50, 2000, 2 * 71),  # long and thin: 56x1988
    ],
)
def test_image_tokens_for_known_values(height: int, width: int, tokens: int) -> None:
    assert image_tokens_for(height, width) == tokens


def test_image_tokens_for_custom_bounds() -> None:
    assert image_tokens_for(448, 448, max_pixels=28 * 28 * 64) == 64
    assert image_tokens_for(28, 28, min_pixels=28 * 28 * 16) == 16
    assert image_tokens_for(3508, 2480, max_pixels=28 * 28 * 4096) <= 4096


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000))
def test_image_tokens_for_stays_in_bounds(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(MpipeError, match="aspect ratio <= 200"):
            image_tokens_for(height, width)
        return
    tokens = image_tokens_for(height, width)
    assert 4 <= tokens <= 1280  # min_pixels / 28^2 and max_pixels / 28^2


# ------------------------------------------------------------------------------------ mixes


@pytest.mark.parametrize("name", sorted(MIXES))
def test_sampling_is_deterministic_by_seed(name: str) -> None:
    a = sample_workload(name, 12, seed=3)
    assert a == sample_workload(MIXES[name], 12, seed=3)
    assert sample_workload(name, 5, seed=3).microbatches == a.microbatches[:5]  # a prefix
    assert len(a) == 12
    for mb in a.microbatches:
        assert mb.text_tokens == MIXES[name].seq_len
        assert mb.image_tokens == sum(mb.images) <= mb.text_tokens


def _sample_with_choice(mix: Mix, n: int, seed: int) -> tuple[Microbatch, ...]:
    """The sampler as first written, with ``rng.choice(n, p=...)``: the draws it must keep."""
    rng = np.random.default_rng(seed)
    counts = [k for k, _ in mix.images_per_sample]
    out = []
    for _ in range(n):
        images: list[int] = []
        for _ in range(mix.samples_per_microbatch):
            if rng.random() < mix.text_only_share:
                continue
            for _ in range(counts[rng.choice(len(counts), p=[p for _, p in mix.images_per_sample])]):
                height, width, _p = mix.resolutions[rng.choice(len(mix.resolutions), p=[p for *_, p in mix.resolutions])]
                if mix.jitter:
                    fh, fw = rng.uniform(1 - mix.jitter, 1 + mix.jitter, size=2)
                    height, width = max(1, round(height * fh)), max(1, round(width * fw))
                tokens = image_tokens_for(height, width, min_pixels=mix.min_pixels, max_pixels=mix.max_pixels)
                if sum(images) + tokens <= mix.seq_len:
                    images.append(tokens)
        out.append(Microbatch(sum(images), mix.seq_len, tuple(images)))
    return tuple(out)


@pytest.mark.parametrize("name", sorted(MIXES))
def test_sampling_draws_what_rng_choice_draws(name: str) -> None:
    for seed in (0, 7):
        assert sample_workload(name, 200, seed).microbatches == _sample_with_choice(MIXES[name], 200, seed)


@pytest.mark.parametrize("name", ["text-heavy", "balanced", "image-heavy", "doc-ocr"])
def test_seeds_differ(name: str) -> None:
    assert sample_workload(name, 8, seed=0) != sample_workload(name, 8, seed=1)


def test_uniform_small_is_identical_microbatches() -> None:
    workload = sample_workload("uniform-small", 6, seed=11)
    assert set(workload.microbatches) == {Microbatch(2048, 4096, (256,) * 8)}


def test_mixes_span_text_heavy_to_image_heavy() -> None:
    def mean_image_tokens(name: str) -> float:
        return float(np.mean([mb.image_tokens for mb in sample_workload(name, 400, seed=0).microbatches]))

    text_heavy, balanced, image_heavy = map(mean_image_tokens, ["text-heavy", "balanced", "image-heavy"])
    assert text_heavy < balanced < image_heavy
    text_only = [mb.image_tokens == 0 for mb in sample_workload("text-heavy", 400, seed=0).microbatches]
    assert any(text_only)  # 0.8**8 of microbatches carry no image at all
    doc = sample_workload("doc-ocr", 50, seed=0)
    assert max(max(mb.images, default=0) for mb in doc.microbatches) > 1280  # beyond the default cap


def test_mix_definition_is_checked() -> None:
    with pytest.raises(MpipeError, match=r"mix 'bad': resolutions probabilities sum to 1 must hold"):
        Mix("bad", "", 0.5, ((1, 1.0),), ((448, 448, 0.5),), 4, 4096)
    with pytest.raises(MpipeError, match="text_only_share"):
        Mix("bad", "", 1.5, ((1, 1.0),), ((448, 448, 1.0),), 4, 4096)
    with pytest.raises(MpipeError, match="unknown workload mix 'video'; mixes: text-heavy, balanced"):
        sample_workload("video", 4, 0)


# ------------------------------------------------------------------------------ file loading


def test_load_mix_by_name() -> None:
    assert len(load_workload("balanced")) == DEFAULT_NUM_MICROBATCHES
    assert load_workload("balanced", num_microbatches=16, seed=4) == sample_workload("balanced", 16, 4)


def test_unknown_name_lists_the_mixes(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MpipeError, match=r"unknown workload 'videos'.*mixes: text-heavy, balanced, image-heavy"):
        load_workload("videos")
    with pytest.raises(MpipeError, match="cannot read"):
        load_workload("absent.yaml")


YAML_TEXT = """\
name: mine
microbatches:
  - {image_tokens: 0, text_tokens: 4096}
  - {image_tokens: 1280, text_tokens: 4096, images: [256, 1024]}
  - image_tokens: 64
    text_tokens: 2048
"""
EXPECTED = Workload(
    (Microbatch(0, 4096), Microbatch(1280, 4096, (256, 1024)), Microbatch(64, 2048)), "mine"
)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_load_yaml_file(tmp_path, suffix: str) -> None:
    path = tmp_path / f"w{suffix}"
    path.write_text(YAML_TEXT)
    assert load_workload(path) == EXPECTED
    assert load_workload(str(path), num_microbatches=3) == EXPECTED


def test_load_json_file_and_default_name(tmp_path) -> None:
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"microbatches": [{"image_tokens": 7, "text_tokens": 9, "images": [7]}]}))
    assert load_workload(path) == Workload((Microbatch(7, 9, (7,)),), "steps")


def test_file_length_mismatch(tmp_path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(YAML_TEXT)
    with pytest.raises(MpipeError, match=r"w\.yaml has 3 microbatches but the microbatch count M is 16: .*16 entries"):
        load_workload(path, num_microbatches=16)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_dump_load_round_trip(tmp_path, suffix: str) -> None:
    for workload in (EXPECTED, sample_workload("image-heavy", 5, seed=2)):
        path = tmp_path / f"out{suffix}"
        dump_workload(workload, path)
        assert load_workload(path) == workload
        assert workload_hash(load_workload(path)) == workload_hash(workload)


def test_workload_hash_tracks_the_data() -> None:
    changed = Workload((Microbatch(0, 4096), Microbatch(1280, 4096, (256, 1024)), Microbatch(64, 2047)), "mine")
    assert workload_hash(changed) != workload_hash(EXPECTED)
    assert len(workload_hash(EXPECTED)) == 64


def test_dump_rejects_unknown_suffix(tmp_path) -> None:
    with pytest.raises(MpipeError, match="unknown workload file suffix '.txt'"):
        dump_workload(EXPECTED, tmp_path / "w.txt")


def test_invalid_syntax_is_one_line(tmp_path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("microbatches: [\n  {image_tokens: 1\n")
    with pytest.raises(MpipeError, match=r"bad\.yaml: not valid YAML \(line") as info:
        load_workload(bad_yaml)
    assert "\n" not in str(info.value)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"microbatches": [}')
    with pytest.raises(MpipeError, match=r"bad\.json: not valid JSON \(line 1 column 19"):
        load_workload(bad_json)


# ------------------------------------------------------------------------------ parse errors

GOOD = {"image_tokens": 256, "text_tokens": 1024}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([GOOD], r"<top level> = \[\{.*\}\]: must be a mapping with a 'microbatches' list"),
        (None, r"the file is empty; write `microbatches: "),  # YAML's reading of an empty file, not '= None'
        ({}, "microbatches is missing and must be a non-empty list"),
        ({"microbatches": []}, r"microbatches = \[\]: must be a non-empty list"),
        ({"microbatches": [GOOD], "seed": 1}, "seed = 1: is not a workload field"),
        ({"microbatches": [GOOD], "name": ""}, "name = '': must be a non-empty string"),
        ({"microbatches": [GOOD, 5]}, r"microbatches\[1\] = 5: must be a mapping"),
        ({"microbatches": [GOOD, {"text_tokens": 8}]}, r"microbatches\[1\]\.image_tokens is missing"),
        ({"microbatches": [GOOD, {"image_tokens": 8}]}, r"microbatches\[1\]\.text_tokens is missing"),
        ({"microbatches": [GOOD, GOOD, {"image_tokens": -1, "text_tokens": 8}]},
         r"microbatches\[2\]\.image_tokens = -1: must be an integer from 0 to 16777216"),
        ({"microbatches": [{"image_tokens": 0, "text_tokens": 0}]},
         r"microbatches\[0\]\.text_tokens = 0: must be an integer from 1 to 16777216"),
        ({"microbatches": [{"image_tokens": 2.5, "text_tokens": 8}]}, r"microbatches\[0\]\.image_tokens = 2\.5"),
        ({"microbatches": [{"image_tokens": "256", "text_tokens": 8}]}, r"microbatches\[0\]\.image_tokens = '256'"),
        ({"microbatches": [{"image_tokens": 1, "text_tokens": True}]}, r"microbatches\[0\]\.text_tokens = True"),
        ({"microbatches": [{**GOOD, "images": [100, 100]}]},
         r"microbatches\[0\]\.images = \[100, 100\]: must sum to image_tokens = 256"),
        ({"microbatches": [{**GOOD, "images": [256, 0]}]},
         r"microbatches\[0\]\.images\[1\] = 0: must be an integer from 1 to 16777216"),
        ({"microbatches": [{**GOOD, "images": 256}]}, r"microbatches\[0\]\.images = 256: must be a list"),
        ({"microbatches": [{**GOOD, "video_tokens": 9}]},
         r"microbatches\[0\]\.video_tokens = 9: is not a microbatch field"),
    ],
)
def test_parse_errors_name_the_entry_and_field(data: object, message: str) -> None:
    with pytest.raises(MpipeError, match=message) as info:
        parse_workload(data, where="w.yaml")  # type: ignore[arg-type]
    text = str(info.value)
    assert text.startswith("w.yaml: ") and "\n" not in text and ";" in text
