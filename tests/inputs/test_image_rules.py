"""Each family's image rule in dataset workloads: Qwen2.5-VL's, Qwen3-VL's (and Qwen3.5's) and GLM-4.1V's min/max
pixels with their patch merging, InternVL's dynamic tiles with a thumbnail, fixed SigLIP/CLIP tiles; a model folder's
preprocessor_config.json overrides what the reader gave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mpipe_tune.inputs._dataset_spec import ImageRule, image_rule_from_dims
from mpipe_tune.inputs import load_model, DatasetOptions, load_dataset

HF = Path(__file__).resolve().parent.parent / "fixtures" / "hf"


def rule_of(folder: str | Path) -> ImageRule:
    """The rule a dataset workload uses for the model in ``folder`` (and its preprocessor_config.json, if any)."""
    model = load_model(str(folder))
    dims = next(dict(u.cost.dims) for u in model.layers if getattr(u.cost, "kind", "") == "patch_embed")
    pre = Path(folder) / "preprocessor_config.json"
    return image_rule_from_dims(dims, json.loads(pre.read_text()) if pre.is_file() else None)


@pytest.mark.parametrize("folder, kind, factor, low, high", [
    ("Qwen2.5-VL-7B-Instruct", "dynamic", 28, 3136, 12845056),  # its preprocessor_config.json's pixels
    ("Qwen3-VL-8B-Instruct", "dynamic", 32, 65536, 16777216),  # 16 px patches merged 2 x 2; size's edges
    ("Qwen3.5-27B", "dynamic", 32, 65536, 16777216),
    ("GLM-4.1V-9B-Thinking", "dynamic", 28, 112 * 112, 28 * 28 * 15000),  # Glm4vImageProcessor's default size
])
def test_dynamic_resolution_families_resize_within_their_processor_s_pixels(folder, kind, factor, low, high):
    rule = rule_of(HF / folder)
    assert (rule.kind, rule.factor_px, rule.min_pixels, rule.max_pixels) == (kind, factor, low, high)


def test_qwen3_vl_gives_one_token_per_32_pixels_square_and_enlarges_small_images_to_its_minimum():
    rule = rule_of(HF / "Qwen3-VL-8B-Instruct")
    assert rule.tokens(np.array([448, 64]), np.array([448, 64])).tolist() == [196, 64]  # 14 x 14; 256 x 256 px


def test_internvl_tiles_an_image_by_its_aspect_ratio_and_adds_a_thumbnail():
    rule = rule_of(HF / "InternVL3-8B-hf")
    assert (rule.kind, rule.tile_tokens, rule.tile_px, rule.max_tiles) == ("tiles", 256, 448, 12)
    heights, widths = np.array([448, 448, 1080, 3000]), np.array([448, 896, 1920, 300])
    # one tile alone; 2 x 1 and a thumbnail; 4 x 2 (ties with 2 x 1, the image is large) and a thumbnail;
    # 1 x 10 and a thumbnail
    assert rule.tokens(heights, widths).tolist() == [256, 3 * 256, 9 * 256, 11 * 256]


def test_gemma3_and_llava_keep_one_fixed_tile():
    assert rule_of(HF / "gemma-3-4b-it").tokens(np.array([100, 4000]), np.array([3000, 50])).tolist() == [256, 256]
    assert rule_of(HF / "llava-1.5-7b-hf").tile_tokens == 576


def test_a_folder_s_preprocessor_config_overrides_the_family_s(tmp_path):
    folder = tmp_path / "internvl"
    shutil.copytree(HF / "InternVL3-8B-hf", folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"max_patches": 6}))
    assert rule_of(folder).max_tiles == 6
    qwen = tmp_path / "qwen3-vl"
    shutil.copytree(HF / "Qwen3-VL-8B-Instruct", qwen)
    (qwen / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 1024,
                                                                        "longest_edge": 1048576}}))
    assert (rule_of(qwen).min_pixels, rule_of(qwen).max_pixels) == (1024, 1048576)


def test_a_dataset_workload_counts_internvl_tiles(tmp_path):
    manifest = tmp_path / "m.csv"
    pd.DataFrame({"text_tokens": [4000, 4000], "num_images": [1, 1], "image_width": [896, 448],
                  "image_height": [448, 448]}).to_csv(manifest, index=False)
    model = load_model(str(HF / "InternVL3-8B-hf"))
    dataset, _ = load_dataset(str(manifest), str(HF / "InternVL3-8B-hf"), model, DatasetOptions())
    assert dataset.records.image_tokens.tolist() == [3 * 256, 256]
    assert "thumbnail" in dataset.spec.image_rule.describe()


def test_a_stored_tiles_rule_reads_back():
    from mpipe_tune.inputs import DatasetSpec, TextRule

    spec = DatasetSpec("/x.csv", ImageRule.tiled(256, 448, 12), TextRule())
    assert DatasetSpec.from_dict(spec.to_dict(), where="test") == spec
