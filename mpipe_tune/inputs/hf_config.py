"""Hugging Face ``config.json`` -> the model spec the YAML reader produces, read offline.

:func:`from_hf_config` turns the configuration of a published model into the mapping
:func:`mpipe_tune.algebra.model.parse_model` takes (``name``, ``source``, ``layers`` with ``name``, ``block``,
``kind``, ``repeat`` and the kind's dimensions), so a config.json plans like a file of ``models/``:
the encoder (block ``encoder``), the projector (block ``projector``) and the backbone (block ``llm``), in order.

Families it maps, by ``model_type``:

- ``qwen2_vl``, ``qwen2_5_vl``: ``vision_config`` -> ``patch_embed``, ``vit_block`` x ``depth``, ``merger``
  (the ViT and its PatchMerger, all block ``encoder``, as ``models/qwen2-vl-vit.yaml``), then the Qwen2
  backbone from the top-level (or ``text_config``) fields;
- ``llava``, ``llava_next``: a CLIP or SigLIP ``vision_config`` -> ``patch_embed``, ``vit_block`` for every
  layer up to ``vision_feature_layer``, a 2-layer ``projector``, then the ``text_config`` backbone;
- ``llama``, ``mistral``, ``qwen2`` (text only): ``embedding``, ``dense_block`` x ``num_hidden_layers``, ``lm_head``;
- ``deepseek_v2``, ``deepseek_v3`` (text only): MLA attention, ``first_k_dense_replace`` dense blocks, then
  ``moe_block`` layers (the multi-token-prediction module is left out, as in ``models/deepseek-v3.yaml``).

transformers writes a nested configuration (LLaVA's ``text_config``, ``vision_config``) without the fields
that equal its class's defaults; :data:`NESTED_DEFAULTS` restores them for the classes those files nest.
A field the reader needs and cannot find or use is one :class:`MpipeError` line that names the file and
the field. Plain ``json``: no transformers, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpipe_tune.errors import MpipeError

__all__ = ["NESTED_DEFAULTS", "from_hf_config", "is_hf_config"]

CONFIG_FILE = "config.json"
_YAML_FIX = "or describe the model in a YAML model spec (docs/inputs.md, Model)"
_GELU_ACTS = frozenset({"gelu", "quick_gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"})

NESTED_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32},
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                          "hidden_act": "quick_gelu"},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "hidden_act": "gelu_pytorch_tanh"},
}
"""Nested ``model_type`` -> the class defaults of transformers' ``LlamaConfig``, ``CLIPVisionConfig`` and
``SiglipVisionConfig`` for the fields this reader uses (what a nested configuration leaves out)."""

_MISSING = object()


@dataclass(frozen=True)
class _Section:
    """One JSON object of a configuration file, read one checked field at a time."""

    data: Mapping[str, Any]
    file: str
    prefix: str = ""
    """Where the object sits in the file (``vision_config.``), for messages."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values of the fields the object leaves out (its class defaults, :data:`NESTED_DEFAULTS`)."""

    def _raw(self, name: str) -> Any:
        return self.data.get(name, self.defaults.get(name, _MISSING))

    def has(self, name: str) -> bool:
        return self._raw(name) not in (_MISSING, None)

    def missing(self, name: str, what: str) -> MpipeError:
        return MpipeError(f"{self.file}: missing field '{self.prefix}{name}' ({what}); add it, {_YAML_FIX}")

    def unsupported(self, name: str, why: str) -> MpipeError:
        return MpipeError(
            f"{self.file}: field '{self.prefix}{name}' = {self._raw(name)!r} is not supported ({why}); "
            f"describe the model in a YAML model spec instead (docs/inputs.md, Model)"
        )

    def count(self, name: str, what: str, default: Any = _MISSING, *, lowest: int = 1) -> int:
        """An integer field >= ``lowest``; ``default`` where it is absent or null."""
        value = self._raw(name)
        if value in (_MISSING, None):
            if default is _MISSING:
                raise self.missing(name, what)
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            must = "a positive integer" if lowest == 1 else f"an integer >= {lowest}"
            raise MpipeError(f"{self.file}: field '{self.prefix}{name}' = {value!r} must be {must} ({what}); correct it")
        return value

    def number(self, name: str, what: str) -> float:
        value = self._raw(name)
        if value in (_MISSING, None):
            raise self.missing(name, what)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise MpipeError(f"{self.file}: field '{self.prefix}{name}' = {value!r} must be a positive number ({what})")
        return value

    def text(self, name: str, default: str) -> str:
        value = self._raw(name)
        return default if value in (_MISSING, None) else str(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self._raw(name)
        if value in (_MISSING, None):
            return default
        if not isinstance(value, bool):
            raise MpipeError(f"{self.file}: field '{self.prefix}{name}' = {value!r} must be true or false")
        return value

    def section(self, name: str, what: str, *, default_type: str | None = None) -> _Section:
        """The nested object ``name``, with the class defaults of its ``model_type`` (or ``default_type``)."""
        value = self.data.get(name)
        if value is None:
            raise self.missing(name, what)
        if not isinstance(value, Mapping):
            raise MpipeError(f"{self.file}: field '{self.prefix}{name}' must be an object ({what}), got {value!r}")
        model_type = value.get("model_type", default_type)
        return _Section(value, self.file, f"{self.prefix}{name}.", NESTED_DEFAULTS.get(model_type, {}))


# --- the encoders -----------------------------------------------------------------------------------

def _qwen_vit(vision: _Section, *, width: int, ffn: int, activation: str, out_hidden: int) -> list[dict]:
    """Qwen2-VL's and Qwen2.5-VL's ViT: 3D patch embedding, blocks, PatchMerger (all block ``encoder``)."""
    merge = vision.count("spatial_merge_size", "patches merged per side into one token") ** 2
    in_channels = vision.count("in_chans", "image channels", None) or vision.count("in_channels", "image channels", 3)
    common = {"block": "encoder", "hidden": width, "merge_factor": merge}
    return [
        {"name": "patch_embed", **common, "kind": "patch_embed",
         "patch_size": vision.count("patch_size", "pixels per patch side"),
         "temporal_patch": vision.count("temporal_patch_size", "frames per patch"), "in_channels": in_channels},
        {"name": "vit", **common, "kind": "vit_block", "repeat": vision.count("depth", "ViT block count"),
         "heads": vision.count("num_heads", "ViT attention heads"), "ffn": ffn, "activation": activation},
        {"name": "merger", **common, "kind": "merger", "out_hidden": out_hidden},
    ]


def _qwen2_vl_encoder(vision: _Section) -> list[dict]:
    """Qwen2-VL: ``embed_dim`` is the ViT's width and ``hidden_size`` the merger's output width."""
    width = vision.count("embed_dim", "ViT width")
    ffn = width * vision.number("mlp_ratio", "ViT MLP width over its width")
    if ffn != int(ffn):
        raise vision.unsupported("mlp_ratio", f"embed_dim {width} x mlp_ratio must be a whole MLP width")
    act = vision.text("hidden_act", "quick_gelu")
    if act not in _GELU_ACTS:
        raise vision.unsupported("hidden_act", "Qwen2-VL's ViT MLP is a GELU MLP")
    return _qwen_vit(vision, width=width, ffn=int(ffn), activation="gelu",
                     out_hidden=vision.count("hidden_size", "merger output width, the backbone's"))


def _qwen2_5_vl_encoder(vision: _Section) -> list[dict]:
    """Qwen2.5-VL: ``hidden_size`` is the ViT's width, ``out_hidden_size`` the merger's; gated (SwiGLU) MLP.

    Its window attention is charged as full attention inside each image (an upper bound)."""
    return _qwen_vit(vision, width=vision.count("hidden_size", "ViT width"),
                     ffn=vision.count("intermediate_size", "ViT MLP width"), activation="swiglu",
                     out_hidden=vision.count("out_hidden_size", "merger output width, the backbone's"))


def _clip_like_encoder(vision: _Section, num_blocks: int, *, cls_token: bool, patch_bias: bool) -> list[dict]:
    width = vision.count("hidden_size", "ViT width")
    patch = vision.count("patch_size", "pixels per patch side")
    side = vision.count("image_size", "image side in pixels") // patch
    act = vision.text("hidden_act", "gelu")
    if act not in _GELU_ACTS:
        raise vision.unsupported("hidden_act", f"the reader maps CLIP/SigLIP MLPs with {', '.join(sorted(_GELU_ACTS))}")
    common = {"block": "encoder", "hidden": width, "merge_factor": 1}
    return [
        {"name": "patch_embed", **common, "kind": "patch_embed", "patch_size": patch,
         "in_channels": vision.count("num_channels", "image channels", 3), "bias": patch_bias,
         "positions": side * side + int(cls_token)},
        {"name": "vit", **common, "kind": "vit_block", "repeat": num_blocks,
         "heads": vision.count("num_attention_heads", "ViT attention heads"),
         "ffn": vision.count("intermediate_size", "ViT MLP width"), "activation": "gelu"},
    ]


_LLAVA_TOWERS: dict[str, dict[str, bool]] = {
    "clip_vision_model": {"cls_token": True, "patch_bias": False},
    "siglip_vision_model": {"cls_token": False, "patch_bias": True},
}


def _feature_layers(config: _Section, num_layers: int) -> tuple[int, int]:
    """(ViT blocks that run, feature maps concatenated) for LLaVA's ``vision_feature_layer``: hidden state
    ``i`` is the output of block ``i`` (0 the patch embedding), negative counts from the end."""
    value = config.data.get("vision_feature_layer", -2)
    picks = value if isinstance(value, list) else [value]
    if not picks or not all(isinstance(i, int) and not isinstance(i, bool) for i in picks):
        raise config.unsupported("vision_feature_layer", "give a layer index or a list of them")
    blocks = [i if i >= 0 else num_layers + 1 + i for i in picks]
    if not all(1 <= b <= num_layers for b in blocks):
        raise config.unsupported("vision_feature_layer", f"the vision tower has {num_layers} layers")
    return max(blocks), len(picks)


# --- the backbones ----------------------------------------------------------------------------------

def _decoder_base(text: _Section) -> tuple[int, int, int, int]:
    return (text.count("hidden_size", "backbone width"), text.count("vocab_size", "vocabulary size"),
            text.count("num_hidden_layers", "decoder layer count"),
            text.count("num_attention_heads", "attention heads"))


def _framed(hidden: int, vocab: int, blocks: list[dict]) -> list[dict]:
    return [{"name": "embed", "block": "llm", "kind": "embedding", "vocab": vocab, "hidden": hidden},
            *[b for b in blocks if b["repeat"] > 0],
            {"name": "head", "block": "llm", "kind": "lm_head", "hidden": hidden, "vocab": vocab}]


def _gqa_backbone(text: _Section, *, qkv_bias: bool | None) -> list[dict]:
    """Llama-style decoder (GQA, SwiGLU); ``qkv_bias`` None reads Llama's ``attention_bias``."""
    hidden, vocab, num_layers, heads = _decoder_base(text)
    block = {"name": "decoder", "block": "llm", "kind": "dense_block", "repeat": num_layers, "hidden": hidden,
             "heads": heads, "ffn": text.count("intermediate_size", "MLP width")}
    if text.has("num_key_value_heads"):
        block["kv_heads"] = text.count("num_key_value_heads", "key/value heads")
    head_dim = text.count("head_dim", "attention head width", None)
    if head_dim is not None and head_dim * heads != hidden:
        block["head_dim"] = head_dim
    if text.flag("attention_bias", False) if qkv_bias is None else qkv_bias:
        block["qkv_bias"] = True
    return _framed(hidden, vocab, [block])


def _deepseek_backbone(text: _Section) -> list[dict]:
    """DeepSeek-V2/V3: MLA attention; dense SwiGLU blocks first, then MoE blocks with shared experts."""
    hidden, vocab, num_layers, heads = _decoder_base(text)
    mla = {"attention": "mla", **{f: text.count(f, "MLA dimension") for f in
                                  ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}}
    if text.has("q_lora_rank"):
        mla["q_lora_rank"] = text.count("q_lora_rank", "MLA query latent width")
    common = {"block": "llm", "hidden": hidden, "heads": heads, **mla}
    num_dense = num_layers  # no routed experts: every layer is dense
    if text.has("n_routed_experts"):
        num_dense = text.count("first_k_dense_replace", "dense layers before the MoE ones", 0, lowest=0)
        if num_dense > num_layers:
            raise text.unsupported("first_k_dense_replace", f"it must be <= num_hidden_layers {num_layers}")
        if num_dense < num_layers and text.count("moe_layer_freq", "MoE layer spacing", 1) != 1:
            raise text.unsupported("moe_layer_freq", "the reader maps 1 only, where every layer from "
                                                     "first_k_dense_replace on is a MoE layer")
    dense = {"name": "dense", **common, "kind": "dense_block", "repeat": num_dense,
             "ffn": text.count("intermediate_size", "dense MLP width")}
    moe = {"name": "moe", **common, "kind": "moe_block", "repeat": num_layers - num_dense}
    if num_layers > num_dense:
        moe.update(experts=text.count("n_routed_experts", "routed experts"),
                   top_k=text.count("num_experts_per_tok", "experts per token"),
                   moe_ffn=text.count("moe_intermediate_size", "expert MLP width"),
                   shared_experts=text.count("n_shared_experts", "shared experts", 0, lowest=0))
    return _framed(hidden, vocab, [dense, moe])


_BACKBONES: dict[str, Callable[[_Section], list[dict]]] = {
    "llama": lambda text: _gqa_backbone(text, qkv_bias=None),
    "mistral": lambda text: _gqa_backbone(text, qkv_bias=None),
    "qwen2": lambda text: _gqa_backbone(text, qkv_bias=True),
    "deepseek_v2": _deepseek_backbone,
    "deepseek_v3": _deepseek_backbone,
}
"""Text ``model_type`` -> its backbone's layers (a model of its own, or the ``text_config`` of an MLLM)."""


# --- the multimodal families ------------------------------------------------------------------------

def _qwen_vl(encoder: Callable[[_Section], list[dict]]) -> Callable[[_Section], list[dict]]:
    def layers(config: _Section) -> list[dict]:
        vision = config.section("vision_config", "the ViT's dimensions")
        text = config.section("text_config", "the backbone") if config.has("text_config") else config
        return [*encoder(vision), *_gqa_backbone(text, qkv_bias=True)]

    return layers


def _llava(config: _Section) -> list[dict]:
    """LLaVA: a CLIP/SigLIP tower, ``multi_modal_projector`` (two linears), the ``text_config`` backbone."""
    vision = config.section("vision_config", "the vision tower", default_type="clip_vision_model")
    tower_type = vision.text("model_type", "clip_vision_model")
    if tower_type not in _LLAVA_TOWERS:
        raise vision.unsupported("model_type", f"the reader maps vision towers {', '.join(_LLAVA_TOWERS)}")
    num_blocks, num_maps = _feature_layers(config, vision.count("num_hidden_layers", "vision tower layers"))
    text = config.section("text_config", "the backbone", default_type="llama")
    text_type = text.text("model_type", "llama")
    if text_type not in _BACKBONES:
        raise text.unsupported("model_type", f"the reader maps backbones {', '.join(_BACKBONES)}")
    backbone = _BACKBONES[text_type](text)
    projector = {"name": "projector", "block": "projector", "kind": "projector",
                 "in_hidden": num_maps * vision.count("hidden_size", "ViT width"), "hidden": backbone[0]["hidden"]}
    return [*_clip_like_encoder(vision, num_blocks, **_LLAVA_TOWERS[tower_type]), projector, *backbone]


_FAMILIES: dict[str, Callable[[_Section], list[dict]]] = {
    "qwen2_vl": _qwen_vl(_qwen2_vl_encoder),
    "qwen2_5_vl": _qwen_vl(_qwen2_5_vl_encoder),
    "llava": _llava,
    "llava_next": _llava,
    **_BACKBONES,
}
"""Top-level ``model_type`` -> the model's layers in order."""


# --- files ------------------------------------------------------------------------------------------

def is_hf_config(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file or a folder holding a ``config.json``."""
    return (path.suffix == ".json" and path.is_file()) or (path / CONFIG_FILE).is_file()


def from_hf_config(path: str | Path) -> dict[str, Any]:
    """The model spec mapping (what :func:`~mpipe_tune.algebra.model.parse_model` reads) of the Hugging Face
    configuration at ``path``: a config.json, or a folder holding one. The name is ``_name_or_path``, else the
    folder's name (a file not named config.json: its stem)."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise MpipeError(f"cannot read model file {file}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise MpipeError(f"model file {file} is not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise MpipeError(f"model file {file} is not a text file; give a Hugging Face config.json") from None
    if not isinstance(data, Mapping):
        raise MpipeError(f"{file}: a Hugging Face configuration is a JSON object, got {type(data).__name__}")
    config = _Section(data, str(file))
    model_type = data.get("model_type")
    if model_type is None:
        raise config.missing("model_type", f"the architecture; one of {', '.join(_FAMILIES)}")
    if model_type not in _FAMILIES:
        raise config.unsupported("model_type", f"the reader maps {', '.join(_FAMILIES)}")
    name = data.get("_name_or_path")
    if not isinstance(name, str) or not name:
        name = file.parent.resolve().name if file.name == CONFIG_FILE else file.stem
    return {"name": name, "source": f"Hugging Face configuration {file} (model_type {model_type})",
            "layers": _FAMILIES[model_type](config)}
