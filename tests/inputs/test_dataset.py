"""Datasets as workloads: image and text rules, manifests, conversation files, the seeded draw, packing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import Dataset, DatasetDraw, draw_from_dict, read_dataset
from mpipe_tune.inputs._dataset_spec import DatasetSpec, ImageRule, Records, TextRule, image_rule_from_dims
from mpipe_tune.inputs._workload import MixDraw, image_tokens_for
from mpipe_tune.inputs import load_model, DatasetOptions, is_dataset, load_dataset

FIXTURES = Path(__file__).parent.parent / "fixtures"
LLAVA = FIXTURES / "llava" / "llava-mini.json"


def spec_for(path, *, seq_len=None, rule=None, text=None) -> DatasetSpec:
    return DatasetSpec(str(Path(path).resolve()), rule or ImageRule.dynamic(), text or TextRule(), seq_len)


# ----------------------------------------------------------------------------------- rules


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_the_vectorised_resize_is_qwen2vl_s_rule_image_by_image(h, w):
    if max(h, w) > 200 * min(h, w):
        return
    rule = ImageRule.dynamic()
    assert rule.tokens(np.array([h]), np.array([w])).tolist() == [image_tokens_for(h, w)]


def test_rules_from_the_model_qwen2vl_dynamic_clip_and_siglip_fixed_tiles():
    qwen = load_model("qwen2vl-vit-qwen2-7b")
    dims = next(dict(u.cost.dims) for u in qwen.layers if getattr(u.cost, "kind", "") == "patch_embed")
    rule = image_rule_from_dims(dims, None)
    assert (rule.kind, rule.factor_px) == ("dynamic", 28)
    assert rule.tokens(np.array([448]), np.array([448])).tolist() == [256]
    siglip = load_model("siglip-so400m")
    dims = next(dict(u.cost.dims) for u in siglip.layers if getattr(u.cost, "kind", "") == "patch_embed")
    assert image_rule_from_dims(dims, None).tokens(np.array([50, 3000]), np.array([80, 2000])).tolist() == [729, 729]
    llava = load_model(str(FIXTURES / "hf" / "llava-1.5-7b-hf"))  # CLIP ViT-L/14 at 336 px, a class token
    dims = next(dict(u.cost.dims) for u in llava.layers if getattr(u.cost, "kind", "") == "patch_embed")
    assert image_rule_from_dims(dims, None).tile_tokens == 576


def test_the_model_folder_s_tokenizer_and_preprocessor_are_used(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    folder = tmp_path / "qwen"
    shutil.copytree(FIXTURES / "hf" / "Qwen2-VL-7B-Instruct", folder)
    words = {w: i for i, w in enumerate(["[UNK]", "a", "cat", "sat"])}
    tokenizer = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 28 * 28 * 64}))
    data = tmp_path / "d.json"
    (tmp_path / "im.png").write_bytes((FIXTURES / "llava" / "images" / "wide-1920x1080.jpg").read_bytes())
    data.write_text(json.dumps([{"image": "im.png", "conversations": [
        {"from": "human", "value": "<image>\na cat sat"}, {"from": "gpt", "value": "a cat"}]}]))
    dataset, notes = load_dataset(str(data), str(folder), load_model(str(folder)), DatasetOptions())
    assert notes == []
    assert dataset.records.text_tokens.tolist() == [5]  # words, the <image> placeholder removed
    assert dataset.records.image_tokens.tolist() == [image_tokens_for(1080, 1920, max_pixels=28 * 28 * 64)]
    assert dataset.records.image_tokens[0] <= 64


def test_without_a_tokenizer_text_is_counted_by_characters_and_a_note_says_so():
    model = load_model("qwen2vl-vit-qwen2-7b")
    dataset, notes = load_dataset(str(LLAVA), "qwen2vl-vit-qwen2-7b", model, DatasetOptions(chars_per_token=2.0))
    assert notes == []
    record = json.loads(LLAVA.read_text())[3]  # text only
    text = "\n".join(t["value"] for t in record["conversations"])
    assert dataset.records.text_tokens[3] == -(-len(text) // 2)
    _, notes = load_dataset(str(LLAVA), "qwen2vl-vit-qwen2-7b", model, DatasetOptions())
    assert len(notes) == 1 and "4 characters per token" in notes[0]


# ------------------------------------------------------------------------- conversation files


def test_the_llava_fixture_reads_sizes_from_the_image_headers():
    dataset = read_dataset(spec_for(LLAVA))
    r = dataset.records
    assert dataset.kind == "conversations" and len(r) == 6
    assert r.images_per_record.tolist() == [1, 1, 1, 0, 2, 1]
    # (height, width) of each file, as its name says
    sizes = [(480, 640), (768, 1024), (1100, 850), (224, 224), (1080, 1920), (1080, 1920)]
    assert r.image_tokens.tolist() == [image_tokens_for(h, w) for h, w in sizes]


def test_sharegpt_messages_and_jsonl(tmp_path):
    shutil.copy(FIXTURES / "llava" / "images" / "thumb-224x224.png", tmp_path / "t.png")
    lines = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "abcd"}]},
                           {"role": "assistant", "content": "efgh"}], "images": ["t.png", "t.png"]},
             {"messages": [{"role": "user", "content": "12345678"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert is_dataset(str(path))
    r = read_dataset(spec_for(path, text=TextRule(None, 1.0))).records
    assert r.images_per_record.tolist() == [2, 0]
    assert r.image_tokens.tolist() == [64, 64]
    assert r.text_tokens.tolist() == [9, 8]  # "abcd\nefgh"


@pytest.mark.parametrize("records,message", [
    ({"a": 1}, "top level must be a list"),
    ([{"image": "nowhere.png", "conversations": []}], "image nowhere.png is not in"),
    ([{"conversations": [{"from": "human"}]}], "turn 0"),
    ([{"image": 3, "conversations": []}], "must be a path or a list of paths"),
    ([{"id": 1}], "no 'conversations' or 'messages'"),
])
def test_bad_conversation_files_are_one_line(tmp_path, records, message):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    with pytest.raises(MpipeError, match=message):
        read_dataset(spec_for(path))


def test_an_unreadable_image_is_one_line(tmp_path):
    (tmp_path / "x.png").write_text("not an image")
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"image": "x.png", "conversations": []}]))
    with pytest.raises(MpipeError, match="cannot be read as an image"):
        read_dataset(spec_for(path))


# ------------------------------------------------------------------------------------ manifests


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".jsonl"])
def test_manifests_with_pixel_sizes_or_token_counts(tmp_path, suffix):
    table = pd.DataFrame({"text_tokens": [100, 200, 300], "num_images": [0, 2, 1],
                          "image_width": [None, 448, 1920], "image_height": [None, 448, 1080]})
    path = tmp_path / f"m{suffix}"
    {".csv": lambda: table.to_csv(path, index=False), ".parquet": lambda: table.to_parquet(path),
     ".jsonl": lambda: table.to_json(path, orient="records", lines=True)}[suffix]()
    dataset = read_dataset(spec_for(path))
    assert dataset.kind == "manifest"
    r = dataset.records
    assert r.text_tokens.tolist() == [100, 200, 300]
    assert r.images_per_record.tolist() == [0, 2, 1]
    assert r.image_tokens.tolist() == [256, 256, image_tokens_for(1080, 1920)]
    tokens = tmp_path / f"t{suffix}"
    table = pd.DataFrame({"text_tokens": [10, 20], "image_tokens": [None, 729]})  # one image where sized
    {".csv": lambda: table.to_csv(tokens, index=False), ".parquet": lambda: table.to_parquet(tokens),
     ".jsonl": lambda: table.to_json(tokens, orient="records", lines=True)}[suffix]()
    r = read_dataset(spec_for(tokens)).records
    assert r.images_per_record.tolist() == [0, 1] and r.image_tokens.tolist() == [729]


@pytest.mark.parametrize("text,message", [
    ("tokens\n3\n", "lack text_tokens"),
    ("text_tokens,num_images\n3,1\n", "lack the image sizes"),
    ("text_tokens,image_tokens\n-3,4\n", "row 0 column text_tokens = -3: must be"),  # the value, not numpy's repr
    ("text_tokens,image_tokens\n3,4.5\n", "row 0 column image_tokens"),
    ("text_tokens,num_images,image_tokens\n3,1,\n", "row 0 has 1 images but no image size"),
    ("text_tokens,image_width,image_height\n3,1,900\n", "aspect ratio"),
    ("text_tokens,image_width\n10,100\n", "image_width but no image_height"),
    ("text_tokens,num_images,image_height\n10,1,100\n", "image_height but no image_width"),
])
def test_bad_manifests_are_one_line(tmp_path, text, message):
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(MpipeError, match=message):
        read_dataset(spec_for(path))


# ------------------------------------------------------------------------------- the draw


def _dataset(seq_len=None) -> Dataset:
    records = Records.from_counts(np.array([10, 300, 50, 0]), np.array([0, 1, 2, 1]), np.array([100, 40, 60, 900]))
    return Dataset(DatasetSpec("/x.csv", ImageRule.dynamic(), TextRule(), seq_len), records, "manifest")


def test_a_draw_samples_records_by_seed_and_its_prefix_is_stable():
    d = _dataset()
    a, b = d.sequences(700, 5), d.sequences(50, 5)
    assert a[:50] == b and d.sequences(700, 6) != a
    lengths = {10: 0, 400: 0, 150: 0, 900: 0}
    for mb in a:  # each sequence is one record: its text and its images spliced into the backbone sequence
        lengths[mb.text_tokens] += 1
    assert all(count > 100 for count in lengths.values())  # every record drawn, about a quarter each
    assert {mb.images for mb in a} == {(), (100,), (40, 60), (900,)}


def test_packing_fills_sequences_of_the_trainer_s_length():
    d = _dataset(seq_len=512)
    sequences = d.sequences(300, 1)
    assert all(mb.text_tokens == 512 for mb in sequences)
    assert all(mb.image_tokens <= 512 for mb in sequences)
    assert 900 not in {x for mb in sequences for x in mb.images}  # an image longer than a sequence is left out
    assert sum(len(mb.images) for mb in sequences) > 300  # several records a sequence
    assert d.sequences(40, 1) == sequences[:40]


def test_a_stored_dataset_draw_round_trips_and_redraws_its_steps(tmp_path):
    spec = spec_for(LLAVA, seq_len=4096)
    dataset = read_dataset(spec)
    workload = dataset.workload(4, 11)
    draw = draw_from_dict(json.loads(json.dumps(workload.draw.to_dict())), where="test")
    assert isinstance(draw, DatasetDraw) and draw == workload.draw
    assert draw.step(0, 4).microbatches == workload.microbatches
    assert draw.step(1, 4).microbatches == dataset.workload(4, 12).microbatches
    assert isinstance(draw_from_dict({"mix": "smoke", "seed": 1, "sequences_per_microbatch": 1}, where="t"), MixDraw)
    with pytest.raises(MpipeError, match="damaged or was edited"):
        draw_from_dict({"dataset": {"path": 3}, "seed": 1, "sequences_per_microbatch": 1}, where="t")
