"""Hugging Face config.json as a model spec: the published configurations of tests/fixtures/hf map to the
built-in specs' layers, load and predict, and a configuration the reader cannot map is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from mpipe_tune.algebra import ArchCost, Model
from mpipe_tune.cli import main
from conftest import cli
from mpipe_tune.cost._arch import activated_param_count, param_count
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs._hf_config import from_hf_config
from mpipe_tune.inputs import load_model

HF = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
QWEN2_VL = HF / "Qwen2-VL-7B-Instruct" / "config.json"
LLAVA = HF / "llava-1.5-7b-hf"
DEEPSEEK_V3 = HF / "DeepSeek-V3" / "config.json"
LLAMA3 = HF / "Meta-Llama-3-8B"


def params_by_block(model: Model, count=param_count) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for layer in model.layers:
        assert isinstance(layer.cost, ArchCost)
        totals[layer.block] += count(layer.cost.kind, layer.cost.dims_dict())
    return dict(totals)


def arch_layers(model: Model) -> list[tuple]:
    return [(u.name, u.block, u.trainable, u.cost) for u in model.layers]


# --- published configurations against the built-in specs --------------------------------------------

@pytest.mark.parametrize("config, builtin", [
    (QWEN2_VL, "qwen2vl-vit-qwen2-7b"),
    (DEEPSEEK_V3, "deepseek-v3"),
    (LLAMA3, "llama3-8b"),
])
def test_published_config_gives_the_built_in_layers(config, builtin):
    hf, ours = load_model(config), load_model(builtin)
    assert arch_layers(hf) == arch_layers(ours)
    reference = params_by_block(ours)
    assert params_by_block(hf).keys() == reference.keys()
    for block, count in params_by_block(hf).items():
        assert count == pytest.approx(reference[block], rel=0.01), block


def test_qwen2_vl_predict_equals_the_built_in_spec(capsys):
    args = ["predict", "--pp", "4", "--microbatches", "8", "--schedule", "transpose,1f1b", "--profile", "h100-sxm",
            "--json"]
    assert main([*args, "--model", str(QWEN2_VL)]) == 0
    hf = json.loads(capsys.readouterr().out)
    assert main([*args, "--model", "qwen2vl-vit-qwen2-7b"]) == 0
    builtin = json.loads(capsys.readouterr().out)
    assert hf["makespan_s"] == pytest.approx(builtin["makespan_s"], rel=1e-9)
    assert [r["busy_s"] for r in hf["ranks"]] == pytest.approx([r["busy_s"] for r in builtin["ranks"]], rel=1e-9)


def test_qwen2_vl_layers_in_order_from_vision_config():
    spec = from_hf_config(QWEN2_VL)
    assert [(e["name"], e["kind"], e.get("repeat", 1)) for e in spec["layers"]] == [
        ("patch_embed", "patch_embed", 1), ("vit", "vit_block", 32), ("merger", "merger", 1),
        ("embed", "embedding", 1), ("decoder", "dense_block", 28), ("head", "lm_head", 1)]
    vit, merger = spec["layers"][1], spec["layers"][2]
    assert (vit["hidden"], vit["ffn"], vit["merge_factor"], merger["out_hidden"]) == (1280, 5120, 4, 3584)
    assert spec["name"] == "Qwen2-VL-7B-Instruct"  # no _name_or_path: the folder's name


def test_llava_maps_clip_tower_projector_and_default_filled_vicuna():
    model = load_model(LLAVA)
    assert model.name == "llava-1.5-7b-hf" and model.blocks() == ("encoder", "projector", "llm")
    spec = from_hf_config(LLAVA)
    patch, vit, projector, embed, decoder, head = spec["layers"]
    # CLIP ViT-L/14 at 336px: 24 x 24 patches and a class token; vision_feature_layer -2 runs 23 of 24 blocks
    assert (patch["positions"], patch["bias"], vit["repeat"], vit["heads"], vit["ffn"]) == (577, False, 23, 16, 4096)
    assert (projector["kind"], projector["in_hidden"], projector["hidden"]) == ("projector", 1024, 4096)
    # the sparse text_config takes LlamaConfig's defaults (Vicuna-7B is Llama-2-7B's shape)
    assert (decoder["repeat"], decoder["hidden"], decoder["heads"], decoder["ffn"]) == (32, 4096, 32, 11008)
    assert embed["vocab"] == head["vocab"] == 32064
    # LLaVA-1.5-7B: about 7.06B parameters (CLIP-L 0.30B, projector 21M, Vicuna-7B 6.74B)
    assert sum(params_by_block(model).values()) == pytest.approx(7.06e9, rel=0.01)


def test_qwen2_5_vl_style_vision_config_maps_its_swiglu_vit(tmp_path):
    data = json.loads(QWEN2_VL.read_text())
    data["model_type"] = "qwen2_5_vl"  # Qwen2.5-VL-7B's published vision_config fields
    data["vision_config"] = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                             "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                             "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                             "fullatt_block_indexes": [7, 15, 23, 31]}
    (tmp_path / "config.json").write_text(json.dumps(data))
    spec = from_hf_config(tmp_path)
    vit = spec["layers"][1]
    merger = next(layer for layer in spec["layers"] if layer["kind"] == "merger")
    assert (vit["activation"], vit["ffn"], merger["out_hidden"]) == ("swiglu", 3420, 3584)


def test_deepseek_v3_keeps_published_active_parameters():
    model = load_model(DEEPSEEK_V3)
    assert sum(params_by_block(model).values()) == pytest.approx(671e9, rel=0.01)
    assert sum(params_by_block(model, activated_param_count).values()) == pytest.approx(37e9, rel=0.05)


def test_name_comes_from_name_or_path(tmp_path):
    data = json.loads((LLAMA3 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}))
    assert load_model(tmp_path).name == "meta-llama/Meta-Llama-3-8B"


def test_a_pairing_file_composes_a_config_json(tmp_path):
    pairing = tmp_path / "pair.yaml"
    pairing.write_text(f"name: siglip-llama3\ncompose:\n  - siglip-so400m\n"
                       f"  - layers: [{{name: projector, block: projector, kind: projector, in_hidden: 1152, hidden: 4096}}]\n"
                       f"  - {LLAMA3}\n")
    model = load_model(pairing)
    assert model.blocks() == ("encoder", "projector", "llm")
    assert arch_layers(model)[-34:] == arch_layers(load_model("llama3-8b"))


def test_hf_reader_needs_neither_torch_nor_transformers():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            f"from mpipe_tune.inputs._specs import load_model; print(load_model({str(LLAVA)!r}).num_layers)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "59"


# --- the CLI ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, args", [
    (LLAVA, ["--schedule", "transpose,1f1b", "--frozen", "encoder,projector"]),
    (DEEPSEEK_V3, ["--schedule", "1f1b"]),  # text only: one Sharded region, no cut
])
def test_llava_and_deepseek_v3_configs_predict(model, args):
    code, stdout, stderr = cli("predict", "--model", str(model), "--pp", "4", "--microbatches", "8", *args, "--json")
    assert code == 0, stderr
    record = json.loads(stdout)
    assert record["makespan_s"] > 0 and len(record["ranks"]) == 4


def _without(path: Path, *fields: str) -> dict:
    data = json.loads(path.read_text())
    for field in fields:
        del data[field]
    return data


@pytest.mark.parametrize("content, words", [
    (json.dumps(_without(LLAMA3 / "config.json", "num_hidden_layers")), "missing field 'num_hidden_layers'"),
    (json.dumps({**json.loads(QWEN2_VL.read_text()), "vision_config": {"depth": 32}}),
     "missing field 'vision_config.embed_dim'"),
    (json.dumps(_without(LLAMA3 / "config.json", "model_type")), "missing field 'model_type'"),
    (json.dumps({**json.loads((LLAMA3 / "config.json").read_text()), "model_type": "gpt2"}),
     "field 'model_type' = 'gpt2' is not supported"),
    (json.dumps({**json.loads(DEEPSEEK_V3.read_text()), "moe_layer_freq": 2}), "field 'moe_layer_freq' = 2"),
    (json.dumps({**json.loads((LLAMA3 / "config.json").read_text()), "hidden_size": "4096"}),
     "field 'hidden_size' = '4096' must be a positive integer"),
    ('{"model_type": "llama",', "is not valid JSON at line 1"),
    ("[1, 2]", "a Hugging Face configuration is a JSON object"),
], ids=["missing-field", "missing-nested-field", "missing-model-type", "unknown-model-type", "unsupported-value",
        "not-an-integer", "not-json", "not-an-object"])
def test_unmappable_config_is_one_line_naming_file_and_field_and_exit_2(tmp_path, content, words):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, stderr = cli("predict", "--model", str(path), "--schedule", "1f1b")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(path) in lines[0] and words in lines[0]


def test_folder_without_config_json_is_one_line(tmp_path):
    with pytest.raises(MpipeError, match="holds no config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("model_type", ["gpt2", None])
def test_an_unknown_or_missing_model_type_is_a_whole_line_with_its_fix(tmp_path, monkeypatch, capsys, model_type):
    """The 27 mapped types listed in full ran past 300 characters and the line was cut before its fix."""
    from mpipe_tune.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    data = {k: v for k, v in json.loads((LLAMA3 / "config.json").read_text()).items() if k != "model_type"}
    (tmp_path / "m" / "config.json").write_text(json.dumps({**data, "model_type": model_type} if model_type else data))
    assert main(["predict", "--model", "m/config.json", "--schedule", "1f1b"]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "characters)" not in line and "YAML model spec" in line and "docs/inputs.md" in line, line
