"""The vision encoders and multimodal families of Hugging Face configurations, by top-level ``model_type``
(:data:`MULTIMODAL_FAMILIES`): the encoder's layers (block ``encoder``), the projector's and the backbone's."""

from __future__ import annotations

from collections.abc import Callable

from mpipe_tune.inputs._hf_backbones import BACKBONES, decoder_backbone, gqa_backbone, runs
from mpipe_tune.inputs._hf_section import GELU_ACTS, Section

PROCESSOR_PIXELS: dict[str, tuple[int, int]] = {
    "qwen2_5_vl": (56 * 56, 28 * 28 * 16384),
    "qwen3_vl": (256 * 256, 4096 * 4096),
    "glm4v": (112 * 112, 28 * 28 * 15000),
}
"""Family -> (min, max) pixels its image processor resizes an image to, when the model's folder has no
preprocessor_config.json to say: Qwen2.5-VL's released ``min_pixels``/``max_pixels`` (3,136 and 12,845,056),
Qwen3-VL's and Qwen3.5's ``size`` (``shortest_edge`` 65,536, ``longest_edge`` 16,777,216) and transformers'
``Glm4vImageProcessor`` default ``size``. Datasets read them (:func:`~mpipe_tune.inputs._dataset_spec.image_rule_from_dims`)."""
INTERNVL_MAX_TILES = 12
"""InternVL's ``max_dynamic_patch`` (and its Hugging Face processor's ``max_patches``): tiles an image may take."""


def _qwen_vit(vision: Section, *, width: int, ffn: int, activation: str, out_hidden: int) -> list[dict]:
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


def _qwen2_vl_encoder(vision: Section) -> list[dict]:
    """Qwen2-VL: ``embed_dim`` is the ViT's width and ``hidden_size`` the merger's output width."""
    width = vision.count("embed_dim", "ViT width")
    ffn = width * vision.number("mlp_ratio", "ViT MLP width over its width")
    if ffn != int(ffn):
        raise vision.unsupported("mlp_ratio", f"embed_dim {width} x mlp_ratio must be a whole MLP width")
    act = vision.text("hidden_act", "quick_gelu")
    if act not in GELU_ACTS:
        raise vision.unsupported("hidden_act", "Qwen2-VL's ViT MLP is a GELU MLP")
    return _qwen_vit(vision, width=width, ffn=int(ffn), activation="gelu",
                     out_hidden=vision.count("hidden_size", "merger output width, the backbone's"))


def _qwen2_5_vl_encoder(vision: Section) -> list[dict]:
    """Qwen2.5-VL: ``hidden_size`` is the ViT's width, ``out_hidden_size`` the merger's; gated (SwiGLU) MLP.

    Its window attention is charged as full attention inside each image (an upper bound)."""
    return _qwen_vit(vision, width=vision.count("hidden_size", "ViT width"),
                     ffn=vision.count("intermediate_size", "ViT MLP width"), activation="swiglu",
                     out_hidden=vision.count("out_hidden_size", "merger output width, the backbone's"))


def _clip_like_encoder(vision: Section, num_blocks: int, *, cls_token: bool, patch_bias: bool) -> list[dict]:
    width = vision.count("hidden_size", "ViT width")
    patch = vision.count("patch_size", "pixels per patch side")
    side = vision.count("image_size", "image side in pixels") // patch
    act = vision.text("hidden_act", "gelu")
    if act not in GELU_ACTS:
        raise vision.unsupported("hidden_act", f"the reader maps CLIP/SigLIP MLPs with {', '.join(sorted(GELU_ACTS))}")
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


def _feature_layers(config: Section, num_layers: int) -> tuple[int, int]:
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


# --- the multimodal families ------------------------------------------------------------------------

def _qwen_vl(encoder: Callable[[Section], list[dict]]) -> Callable[[Section], list[dict]]:
    def layers(config: Section) -> list[dict]:
        vision = config.section("vision_config", "the ViT's dimensions")
        text = config.section("text_config", "the backbone") if config.has("text_config") else config
        return [*encoder(vision), *gqa_backbone(text, qkv_bias=True)]

    return layers


def _llava(config: Section) -> list[dict]:
    """LLaVA: a CLIP/SigLIP tower, ``multi_modal_projector`` (two linears), the ``text_config`` backbone."""
    vision = config.section("vision_config", "the vision tower", default_type="clip_vision_model")
    tower_type = vision.text("model_type", "clip_vision_model")
    if tower_type not in _LLAVA_TOWERS:
        raise vision.unsupported("model_type", f"the reader maps vision towers {', '.join(_LLAVA_TOWERS)}")
    num_blocks, num_maps = _feature_layers(config, vision.count("num_hidden_layers", "vision tower layers"))
    text = config.section("text_config", "the backbone", default_type="llama")
    text_type = text.text("model_type", "llama")
    if text_type not in BACKBONES:
        raise text.unsupported("model_type", f"the reader maps backbones {', '.join(BACKBONES)}")
    backbone = BACKBONES[text_type](text)
    projector = {"name": "projector", "block": "projector", "kind": "projector",
                 "in_hidden": num_maps * vision.count("hidden_size", "ViT width"), "hidden": backbone[0]["hidden"]}
    return [*_clip_like_encoder(vision, num_blocks, **_LLAVA_TOWERS[tower_type]), projector, *backbone]


def _text_of(config: Section, default_type: str | None = None) -> tuple[Section, list[dict]]:
    """The ``text_config`` (else the top level) and its backbone's layers, by its ``model_type``."""
    text = config.section("text_config", "the backbone", default_type=default_type) if config.has("text_config") \
        else config
    text_type = text.text("model_type", default_type or "")
    if text_type not in BACKBONES:
        raise text.unsupported("model_type", f"the reader maps backbones {', '.join(BACKBONES)}")
    return text, BACKBONES[text_type](text)


def _qwen2_5_vl(config: Section) -> list[dict]:
    """Qwen2.5-VL: windowed attention in every block but ``fullatt_block_indexes``; windows of ``window_size``
    pixels a side, in patches."""
    vision = config.section("vision_config", "the ViT's dimensions")
    patch, merge = vision.count("patch_size", "pixels per patch side"), vision.count("spatial_merge_size", "merge")
    window_side = vision.count("window_size", "window side in pixels") // patch
    if window_side % merge:
        raise vision.unsupported("window_size", f"a window must hold whole merged tokens of {merge} x {merge} patches")
    full = vision.data.get("fullatt_block_indexes") or []
    patch_embed, vit, merger = _qwen2_5_vl_encoder(vision)
    patch_embed = {**patch_embed, **_pixels("qwen2_5_vl")}
    blocks = runs([{**{k: v for k, v in vit.items() if k != "repeat"}, "name": "vit_full"} if i in full
                   else {**{k: v for k, v in vit.items() if k != "repeat"}, "name": "vit_window",
                         "window": window_side * window_side} for i in range(vit["repeat"])])
    text = config.section("text_config", "the backbone") if config.has("text_config") else config
    return [patch_embed, *blocks, merger, *gqa_backbone(text, qkv_bias=True)]


def _qwen3_vit(vision: Section, taps: list[int]) -> list[dict]:
    """Qwen3-VL's (and Qwen3.5's) ViT: a biased 3D patch embedding with a learned position table, GELU blocks,
    the merger; the blocks in ``taps`` also feed a DeepStack merger."""
    width, merge = vision.count("hidden_size", "ViT width"), vision.count("spatial_merge_size", "merge") ** 2
    out = vision.count("out_hidden_size", "merger output width, the backbone's")
    common = {"block": "encoder", "hidden": width, "merge_factor": merge}
    depth = vision.count("depth", "ViT block count")
    if not all(isinstance(t, int) and 0 <= t < depth for t in taps):
        raise vision.unsupported("deepstack_visual_indexes", f"give block indexes below depth {depth}")
    block = {"name": "vit", **common, "kind": "vit_block", "heads": vision.count("num_heads", "ViT attention heads"),
             "ffn": vision.count("intermediate_size", "ViT MLP width"), "activation": "gelu"}
    blocks = []
    for index in range(depth):
        carried = sum(t < index for t in taps) * out
        layer = {**block, "name": "vit_tap", "deepstack_out": out} if index in taps else dict(block)
        carried += out if index in taps else 0
        blocks.append({**layer, "side_width": carried} if carried else layer)
    patch_embed = {"name": "patch_embed", **common, "kind": "patch_embed", "bias": True,
                   "patch_size": vision.count("patch_size", "pixels per patch side"),
                   "temporal_patch": vision.count("temporal_patch_size", "frames per patch"),
                   "in_channels": vision.count("in_channels", "image channels", 3),
                   "positions": vision.count("num_position_embeddings", "learned positions", 0, lowest=0),
                   **_pixels("qwen3_vl")}
    merger = {"name": "merger", **common, "kind": "merger", "out_hidden": out}
    if taps:
        merger["side_width"] = len(taps) * out
    return [patch_embed, *runs(blocks), merger]


def _qwen3_vl(config: Section) -> list[dict]:
    """Qwen3-VL (dense and MoE) and Qwen3.5: the ViT, its DeepStack features carried to and added into the first
    ``len(deepstack_visual_indexes)`` decoder layers, the backbone."""
    vision = config.section("vision_config", "the ViT's dimensions")
    taps = vision.data.get("deepstack_visual_indexes") or []
    if not isinstance(taps, list):
        raise vision.unsupported("deepstack_visual_indexes", "give a list of block indexes")
    encoder = _qwen3_vit(vision, taps)
    text, backbone = _text_of(config)
    if not taps:
        return [*encoder, *backbone]
    out = encoder[-1]["out_hidden"]
    backbone = [dict(layer) for layer in backbone]
    backbone[0]["side_width"] = len(taps) * out
    decoders = [layer for layer in backbone if layer["kind"] in ("dense_block", "moe_block")]
    expanded = [{**layer, "repeat": 1} for layer in decoders for _ in range(layer["repeat"])]
    if len(expanded) < len(taps):
        raise vision.unsupported("deepstack_visual_indexes", f"the backbone has {len(expanded)} decoder layers")
    for index, layer in enumerate(expanded[:len(taps)]):
        layer.update(name="deepstack", deepstack_in=True)
        if len(taps) - index - 1:
            layer["side_width"] = (len(taps) - index - 1) * out
    return [*encoder, backbone[0], *runs([{k: v for k, v in e.items() if k != "repeat"} for e in expanded]),
            backbone[-1]]


def _internvl(config: Section) -> list[dict]:
    """InternVL 2.5/3 in transformers' ``internvl`` format: the ``vision_config`` tower, ``vision_feature_layer``,
    the ``text_config`` backbone; tiles as its processor's default ``max_patches``."""
    vision = config.section("vision_config", "the vision tower")
    if vision.flag("use_qk_norm", False):
        raise vision.unsupported("use_qk_norm", "the reader maps InternViT towers without q/k norms (300M)")
    num_blocks, _ = _feature_layers(config, vision.count("num_hidden_layers", "vision tower layers"))
    return _intern_vl(config, vision, num_blocks, bias=vision.flag("attention_bias", True),
                      layer_scale=bool(vision.data.get("layer_scale_init_value", 0.1)),
                      max_tiles=INTERNVL_MAX_TILES, backbone=_text_of(config)[1])


def _internvl_chat(config: Section) -> list[dict]:
    """InternVL 2.5/3 as OpenGVLab publishes it (``internvl_chat``): the ``intern_vit_6b`` tower (layer scale on
    every block), ``select_layer``, ``max_dynamic_patch`` tiles and the ``llm_config`` backbone."""
    vision = config.section("vision_config", "the vision tower")
    if vision.flag("qk_normalization", False) or vision.text("norm_type", "layer_norm") != "layer_norm":
        raise vision.unsupported("qk_normalization" if vision.flag("qk_normalization", False) else "norm_type",
                                 "the reader maps the LayerNorm InternViT-300M towers, without q/k norms")
    layers = vision.count("num_hidden_layers", "vision tower layers")
    select = config.data.get("select_layer", -1)
    if not isinstance(select, int) or isinstance(select, bool) or not 1 <= (select if select > 0 else layers + 1 + select) <= layers:
        raise config.unsupported("select_layer", f"give a block index of the {layers}-block tower")
    text = config.section("llm_config", "the backbone")
    text_type = text.text("model_type", "")
    if text_type not in BACKBONES:
        raise text.unsupported("model_type", f"the reader maps backbones {', '.join(BACKBONES)}")
    return _intern_vl(config, vision, select if select > 0 else layers + 1 + select, bias=vision.flag("qkv_bias", True),
                      layer_scale=True, max_tiles=config.count("max_dynamic_patch", "tiles an image may take",
                                                               INTERNVL_MAX_TILES),
                      backbone=BACKBONES[text_type](text))


def _intern_vl(config: Section, vision: Section, num_blocks: int, *, bias: bool, layer_scale: bool, max_tiles: int,
               backbone: list[dict]) -> list[dict]:
    """InternViT (class token, learned positions), pixel shuffle by ``downsample_ratio``, LayerNorm + two-layer GELU
    projector, the backbone."""
    width = vision.count("hidden_size", "ViT width")
    size, patch = (_side(vision, name) for name in ("image_size", "patch_size"))
    ratio = config.number("downsample_ratio", "pixel shuffle scale")
    merge = round(1 / ratio) ** 2
    if merge * ratio * ratio != 1:
        raise config.unsupported("downsample_ratio", "it must be 1/n for a whole n")
    common = {"block": "encoder", "hidden": width, "merge_factor": merge}
    return [
        {"name": "patch_embed", **common, "kind": "patch_embed", "patch_size": patch, "bias": True,
         "in_channels": vision.count("num_channels", "image channels", 3), "positions": (size // patch) ** 2 + 1,
         "max_tiles": max_tiles},
        {"name": "vit", **common, "kind": "vit_block", "repeat": num_blocks, "activation": "gelu",
         "heads": vision.count("num_attention_heads", "ViT attention heads"),
         "ffn": vision.count("intermediate_size", "ViT MLP width"), "bias": bias, "layer_scale": layer_scale},
        {"name": "pixel_shuffle", **common, "kind": "pixel_shuffle"},
        {"name": "projector", "block": "projector", "kind": "projector", "in_hidden": width * merge,
         "hidden": backbone[0]["hidden"], "norm": True},
        *backbone,
    ]


def _pixels(family: str) -> dict[str, int]:
    low, high = PROCESSOR_PIXELS[family]
    return {"min_pixels": low, "max_pixels": high}


def _side(section: Section, name: str) -> int:
    """An image or patch side given as one integer or a square pair."""
    value = section.data.get(name)
    if isinstance(value, list) and len(value) == 2 and value[0] == value[1] and isinstance(value[0], int) \
            and value[0] > 0:
        return value[0]
    return section.count(name, "pixels a side (one integer, or two equal ones)")


def _gemma3(config: Section) -> list[dict]:
    """Gemma 3: the SigLIP tower (every layer), its patches average-pooled to ``mm_tokens_per_image`` tokens, an
    RMSNorm and one linear into the Gemma 3 backbone."""
    vision = config.section("vision_config", "the vision tower", default_type="siglip_vision_model")
    side = vision.count("image_size", "image side in pixels") // vision.count("patch_size", "pixels per patch side")
    tokens = config.count("mm_tokens_per_image", "image tokens per image", 256)
    if (side * side) % tokens:
        raise config.unsupported("mm_tokens_per_image", f"it must divide the tower's {side * side} patches")
    encoder = _clip_like_encoder(vision, vision.count("num_hidden_layers", "vision tower layers"), cls_token=False,
                                 patch_bias=True)
    for layer in encoder:
        layer["merge_factor"] = side * side // tokens
    text, backbone = _text_of(config, "gemma3_text")
    projector = {"name": "projector", "block": "projector", "kind": "projector", "depth": 1, "norm": True,
                 "in_hidden": vision.count("hidden_size", "ViT width"), "hidden": backbone[0]["hidden"]}
    return [*encoder, projector, *backbone]


def _glm4v(config: Section) -> list[dict]:
    """GLM-4.1V: a ViT of RMSNorm blocks with SwiGLU MLPs ``out_hidden_size`` wide and a learned position table,
    the patches merged by a strided convolution (the merger) and projected by a SwiGLU MLP of ``intermediate_size``
    (the projector), the GLM-4 backbone."""
    vision = config.section("vision_config", "the ViT's dimensions")
    width, merge = vision.count("hidden_size", "ViT width"), vision.count("spatial_merge_size", "merge") ** 2
    out, patch = vision.count("out_hidden_size", "merger output width"), vision.count("patch_size", "patch side")
    common = {"block": "encoder", "hidden": width, "merge_factor": merge}
    text, backbone = _text_of(config)
    return [
        {"name": "patch_embed", **common, "kind": "patch_embed", "patch_size": patch, "bias": True,
         "temporal_patch": vision.count("temporal_patch_size", "frames per patch"),
         "in_channels": vision.count("in_channels", "image channels", 3),
         "positions": (_side(vision, "image_size") // patch) ** 2, **_pixels("glm4v")},
        {"name": "vit", **common, "kind": "vit_block", "repeat": vision.count("depth", "ViT block count"),
         "heads": vision.count("num_heads", "ViT attention heads"), "ffn": out, "activation": "swiglu",
         "bias": vision.flag("attention_bias", False)},
        {"name": "merger", **common, "kind": "merger", "out_hidden": out},
        {"name": "projector", "block": "projector", "kind": "projector", "in_hidden": out, "hidden": out,
         "ffn": vision.count("intermediate_size", "projector MLP width"), "activation": "swiglu", "norm": True},
        *backbone,
    ]


MULTIMODAL_FAMILIES: dict[str, Callable[[Section], list[dict]]] = {
    "qwen2_vl": _qwen_vl(_qwen2_vl_encoder),
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _qwen3_vl,
    "qwen3_5": _qwen3_vl,
    "qwen3_5_moe": _qwen3_vl,
    "llava": _llava,
    "llava_next": _llava,
    "internvl": _internvl,
    "internvl_chat": _internvl_chat,
    "gemma3": _gemma3,
    "glm4v": _glm4v,
}
"""Top-level ``model_type`` of a multimodal configuration -> the model's layers in order."""
