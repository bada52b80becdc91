"""Today's families from their published Hugging Face configurations (tests/fixtures/hf/README.md): each maps to the
layer kinds its architecture needs, predicts, and has the published parameter count within 1%."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpipe_tune.algebra import ArchCost
from mpipe_tune.cost._arch import activated_param_count, model_param_count, param_count
from mpipe_tune.inputs._hf_config import from_hf_config
from mpipe_tune.inputs import load_model

HF = Path(__file__).resolve().parent.parent / "fixtures" / "hf"

PUBLISHED = {  # folder -> (total parameters, (activated per token, its tolerance) or None); sources in
    # tests/fixtures/hf/README.md. An activated figure of two digits ("3.3B") or a name's "A3B" holds to its rounding.
    "Qwen3-8B": (8.2e9, None),
    "Qwen3-30B-A3B": (30.5e9, (3.3e9, 0.02)),
    "Mixtral-8x7B-v0.1": (46.7e9, (12.9e9, 0.01)),
    "gemma-3-4b-it": (4.301e9, None),
    "Qwen2.5-VL-7B-Instruct": (8.29e9, None),
    "Qwen3-VL-8B-Instruct": (8.77e9, None),
    "Qwen3.5-35B-A3B-text": (35e9, (3e9, 0.17)),
    "InternVL3-8B-hf": (7.94e9, None),
    "GLM-4.1V-9B-Thinking": (10.3e9, None),
}


def activated(model) -> int:
    return sum(activated_param_count(u.cost.kind, u.cost.dims_dict()) for u in model.layers)


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_parameter_count_is_within_one_percent_of_the_published_size(folder):
    model = load_model(HF / folder)
    total, active = PUBLISHED[folder]
    assert model_param_count(model) == pytest.approx(total, rel=0.01)
    if active is not None:
        figure, tolerance = active
        assert activated(model) == pytest.approx(figure, rel=tolerance)


def test_qwen3_5_27b_language_model_is_the_published_27b():
    """Qwen3.5-27B: the card's "27B" is the language model's size: its 48 Gated DeltaNet and 16 gated-attention
    layers with untied 248,320-token tables sum to 26.90B (within 1%); with the 27-block ViT the configuration holds
    27.36B (1.3% above the card's figure), which the exact sum by hand checks to 0.1%."""
    model = load_model(HF / "Qwen3.5-27B")
    language = sum(param_count(u.cost.kind, u.cost.dims_dict()) for u in model.layers if u.block == "llm")
    assert language == pytest.approx(27e9, rel=0.01)
    assert model_param_count(model) == pytest.approx(27.357e9, rel=0.001)


def kinds(folder: str) -> list[tuple]:
    return [(u.cost.kind, u.cost.dims_dict().get("attention", ""))
            for u in load_model(HF / folder).layers if isinstance(u.cost, ArchCost)]


def test_qwen3_5_alternates_three_deltanet_layers_and_one_gated_attention_layer():
    spec = from_hf_config(HF / "Qwen3.5-27B")
    decoders = [e for e in spec["layers"] if e["kind"] == "dense_block"]
    assert [(e["attention"] if "attention" in e else "gqa", e["repeat"]) for e in decoders[:2]] == [
        ("gated_deltanet", 3), ("gqa", 1)]
    assert sum(e["repeat"] for e in decoders) == 64
    deltanet, full = decoders[0], decoders[1]
    assert (deltanet["heads"], deltanet["kv_heads"], deltanet["head_dim"], deltanet["value_head_dim"]) == (48, 16, 128,
                                                                                                           128)
    assert (full["attention_gate"], full["qk_norm"], full["head_dim"], full["rope_dim"]) == (True, True, 256, 64)


def test_qwen3_vl_carries_deepstack_features_from_three_vit_blocks_into_three_decoder_layers():
    spec = from_hf_config(HF / "Qwen3-VL-8B-Instruct")
    taps = [e for e in spec["layers"] if e.get("deepstack_out")]
    injected = [e for e in spec["layers"] if e.get("deepstack_in")]
    assert len(taps) == 3 and sum(e["repeat"] for e in injected) == 3
    merger = next(e for e in spec["layers"] if e["kind"] == "merger")
    assert merger["side_width"] == 3 * 4096
    assert [e.get("side_width", 0) for e in injected] == [2 * 4096, 4096, 0]


def test_qwen2_5_vl_windows_all_but_its_full_attention_blocks():
    spec = from_hf_config(HF / "Qwen2.5-VL-7B-Instruct")
    blocks = [(e.get("window"), e["repeat"]) for e in spec["layers"] if e["kind"] == "vit_block"]
    assert blocks == [(64, 7), (None, 1)] * 4  # 112 px windows of 14 px patches; blocks 7, 15, 23, 31 full


def test_internvl_and_gemma3_and_glm4v_map_their_towers():
    assert ("pixel_shuffle", "") in kinds("InternVL3-8B-hf")
    internvl = from_hf_config(HF / "InternVL3-8B-hf")["layers"]
    assert [e["kind"] for e in internvl[:4]] == ["patch_embed", "vit_block", "pixel_shuffle", "projector"]
    assert internvl[3]["in_hidden"] == 4096 and internvl[1]["merge_factor"] == 4  # 2 x 2 patches a token
    gemma = from_hf_config(HF / "gemma-3-4b-it")["layers"]
    assert gemma[1]["merge_factor"] == 16 and gemma[-1]["tied"] is True  # 4,096 patches pooled to 256 tokens
    local = [e for e in gemma if e.get("sliding_window")]
    assert sum(e["repeat"] for e in local) == 34 - 34 // 6  # five local layers to each global one
    glm = from_hf_config(HF / "GLM-4.1V-9B-Thinking")["layers"]
    assert glm[1]["ffn"] == 4096 and glm[1]["activation"] == "swiglu"


@pytest.mark.parametrize("folder, args", [
    ("Qwen3.5-27B", ["--schedule", "transpose,1f1b"]),
    ("Qwen3-VL-8B-Instruct", ["--schedule", "1f1b,1f1b"]),
    ("Qwen3-VL-30B-A3B-Instruct", ["--schedule", "transpose,1f1b"]),
    ("InternVL3-8B-hf", ["--schedule", "transpose,1f1b"]),
    ("gemma-3-4b-it", ["--schedule", "transpose,1f1b"]),
    ("GLM-4.1V-9B-Thinking", ["--schedule", "transpose,1f1b"]),
    ("Qwen2.5-VL-7B-Instruct", ["--schedule", "transpose,1f1b"]),
    ("Qwen3-30B-A3B", ["--schedule", "1f1b"]),
    ("Mixtral-8x7B-v0.1", ["--schedule", "1f1b"]),
    ("Qwen3-8B", ["--schedule", "1f1b"]),
    ("Qwen3.5-35B-A3B-text", ["--schedule", "1f1b"]),
])
def test_predict_runs_on_each_family(folder, args):
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "predict", "--model", str(HF / folder / "config.json"),
                           "--pp", "4", "--microbatches", "8", "--profile", "h100-sxm", *args, "--json"],
                          capture_output=True, text=True, timeout=300)  # a hang guard
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["makespan_s"] > 0 and len(record["ranks"]) == 4


def test_unknown_layer_type_is_one_line(tmp_path):
    data = json.loads((HF / "Qwen3.5-27B" / "config.json").read_text())
    data["text_config"]["layer_types"][0] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "predict", "--model", str(tmp_path), "--schedule",
                           "1f1b"], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "text_config.layer_types" in lines[0], proc.stderr


def test_the_built_in_qwen3_5_27b_is_its_published_configuration():
    """models/qwen3.5-27b.yaml (the Qwen3.5-based MLLM of the paper's Experiment B) plans the layers of its config.json."""
    ours, published = load_model("qwen3.5-27b"), load_model(HF / "Qwen3.5-27B")
    assert [(u.block, u.cost) for u in ours.layers] == [(u.block, u.cost) for u in published.layers]


def test_internvl_chat_format_reads_as_the_transformers_format():
    """OpenGVLab's own internvl_chat configuration (InternVL3-1B) maps to the layers of the same InternViT-300M tower,
    pixel shuffle and projector as transformers' internvl format (InternVL3-8B-hf), and its max_dynamic_patch tiles."""
    chat, hf = (from_hf_config(HF / name)["layers"] for name in ("InternVL3-1B", "InternVL3-8B-hf"))
    assert [e["kind"] for e in chat[:4]] == [e["kind"] for e in hf[:4]]
    assert chat[:3] == hf[:3]  # the same tower: patch embedding, 24 blocks with layer scale, pixel shuffle
    assert (chat[3]["in_hidden"], chat[3]["hidden"], chat[3]["norm"]) == (4096, 896, True)


def test_an_internvit_6b_tower_is_one_line(tmp_path):
    data = json.loads((HF / "InternVL3-1B" / "config.json").read_text())
    data["vision_config"].update(qk_normalization=True, norm_type="rms_norm")
    (tmp_path / "config.json").write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "mpipe_tune.cli", "predict", "--model", str(tmp_path), "--schedule",
                           "1f1b"], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "vision_config.qk_normalization" in lines[0], proc.stderr


def test_qwen3_vl_moe_is_qwen3_30b_a3b_behind_the_qwen3_vl_tower():
    """Qwen3-VL-30B-A3B: its backbone has Qwen3-30B-A3B's published 30.5B parameters (the DeepStack injections add
    none), its ViT the same blocks as Qwen3-VL-8B's, the merger and DeepStack mergers projecting to 2,048."""
    def by_block(folder):
        model = load_model(HF / folder)
        return {block: sum(param_count(u.cost.kind, u.cost.dims_dict()) for u in model.layers if u.block == block)
                for block in model.blocks()}

    moe, dense = by_block("Qwen3-VL-30B-A3B-Instruct"), by_block("Qwen3-VL-8B-Instruct")
    assert moe["llm"] == pytest.approx(30.5e9, rel=0.01)
    assert moe["llm"] == model_param_count(load_model(HF / "Qwen3-30B-A3B"))
    merged = 4 * 1152
    narrower = 4 * (merged * (4096 - 2048) + (4096 - 2048))  # the merger and 3 DeepStack mergers' second linear
    assert dense["encoder"] - moe["encoder"] == narrower
