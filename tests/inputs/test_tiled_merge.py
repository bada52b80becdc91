"""A fixed-tile encoder that merges patches (a position table, merge factor 4) counts the tokens its tiles
become after the merge, from the rule to a dataset's records (a dropped merge factor passed every other test:
they use merge factor 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import yaml

from mpipe_tune.inputs._dataset_spec import image_rule_from_dims
from mpipe_tune.inputs import load_model, DatasetOptions, load_dataset

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def test_a_fixed_tile_with_merge_factor_4_has_a_quarter_of_its_patches():
    rule = image_rule_from_dims({"patch_size": 14, "merge_factor": 4, "positions": 577}, None)  # 24x24 patches
    assert (rule.kind, rule.tile_tokens) == ("fixed", 144)
    assert rule.tokens(np.array([336, 1080]), np.array([336, 1920])).tolist() == [144, 144]


def test_a_dataset_for_a_merging_fixed_tile_encoder_counts_the_merged_tokens(tmp_path):
    spec = yaml.safe_load((ROOT / "models" / "siglip-so400m.yaml").read_text())
    for layer in spec["layers"]:
        if "merge_factor" in layer:
            layer["merge_factor"] = 4  # 27x27 = 729 patches, merged 2x2: 729 // 4 = 182 tokens a tile
    model_file = tmp_path / "siglip-merged.yaml"
    model_file.write_text(yaml.safe_dump(spec))
    shutil.copy(FIXTURES / "llava" / "images" / "thumb-224x224.png", tmp_path / "t.png")
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"images": ["t.png", "t.png"], "conversations": [{"from": "human", "value": "ab"}]}]))
    model = load_model(str(model_file))
    dataset, _ = load_dataset(str(data), str(model_file), model, DatasetOptions())
    assert dataset.records.image_tokens.tolist() == [182, 182]
