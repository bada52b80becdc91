"""The decoder backbones of Hugging Face configurations, by text ``model_type`` (:data:`BACKBONES`): each decoder
layer's attention and MLP as one layer entry, consecutive equal ones merged into runs (:func:`runs`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mpipe_tune.inputs._hf_section import GELU_ACTS, Section


def decoder_base(text: Section) -> tuple[int, int, int, int]:
    return (text.count("hidden_size", "backbone width"), text.count("vocab_size", "vocabulary size"),
            text.count("num_hidden_layers", "decoder layer count"),
            text.count("num_attention_heads", "attention heads"))


def framed(hidden: int, vocab: int, blocks: list[dict], *, tied: bool = False) -> list[dict]:
    head = {"name": "head", "block": "llm", "kind": "lm_head", "hidden": hidden, "vocab": vocab}
    return [{"name": "embed", "block": "llm", "kind": "embedding", "vocab": vocab, "hidden": hidden},
            *[b for b in blocks if b["repeat"] > 0], {**head, "tied": True} if tied else head]


def runs(layers: list[dict]) -> list[dict]:
    """Consecutive equal layer entries as one entry with their count as its ``repeat``."""
    out: list[dict] = []
    for layer in layers:
        if out and {k: v for k, v in out[-1].items() if k != "repeat"} == layer:
            out[-1]["repeat"] += 1
        else:
            out.append({**layer, "repeat": 1})
    return out


def _rope_dim(text: Section, head_dim: int) -> int | None:
    """RoPE's rotated dimensions of a head when the configuration rotates part of it (``partial_rotary_factor``,
    at the top or in ``rope_parameters``), else None (all of it)."""
    rope = text.data.get("rope_parameters") if isinstance(text.data.get("rope_parameters"), Mapping) else {}
    factor = text.data.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    if factor is None or factor == 1:
        return None
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 <= factor < 1:
        raise text.unsupported("partial_rotary_factor", "it must be a number from 0 to 1")
    return int(head_dim * factor)


def _gqa_fields(text: Section, hidden: int, heads: int, *, qkv_bias: bool, qk_norm: bool = False) -> dict:
    """A grouped-query attention's fields: key/value heads, the head width where it is not hidden/heads, biases,
    q/k norms and partial RoPE."""
    fields: dict[str, Any] = {"heads": heads}
    if text.has("num_key_value_heads"):
        fields["kv_heads"] = text.count("num_key_value_heads", "key/value heads")
    head_dim = text.count("head_dim", "attention head width", None)
    if head_dim is not None and head_dim * heads != hidden:
        fields["head_dim"] = head_dim
    rope_dim = _rope_dim(text, head_dim or hidden // heads)
    if rope_dim is not None:
        fields["rope_dim"] = rope_dim
    if qkv_bias:
        fields["qkv_bias"] = True
    if qk_norm:
        fields["qk_norm"] = True
    return fields


def _mlp_fields(text: Section, layer_index: int) -> dict:
    """The MLP of decoder layer ``layer_index``: routed experts where the configuration has them on that layer
    (``num_experts`` or Mixtral's ``num_local_experts``; ``mlp_only_layers`` and ``decoder_sparse_step`` leave some
    dense), else a dense MLP of ``intermediate_size``."""
    experts_field = "num_local_experts" if text.has("num_local_experts") else "num_experts"
    dense_only = text.data.get("mlp_only_layers") or []
    step = text.count("decoder_sparse_step", "MoE layer spacing", 1)
    if not text.has(experts_field) or layer_index in dense_only or (layer_index + 1) % step:
        return {"kind": "dense_block", "ffn": text.count("intermediate_size", "MLP width")}
    moe = {"kind": "moe_block", "experts": text.count(experts_field, "routed experts"),
           "top_k": text.count("num_experts_per_tok", "experts per token")}
    moe["moe_ffn"] = text.count("moe_intermediate_size", "expert MLP width") if text.has("moe_intermediate_size") \
        else text.count("intermediate_size", "expert MLP width")
    shared = text.count("shared_expert_intermediate_size", "shared expert MLP width", 0, lowest=0)
    if shared:
        if shared % moe["moe_ffn"]:
            raise text.unsupported("shared_expert_intermediate_size", f"it must be a multiple of the expert MLP "
                                                                      f"width {moe['moe_ffn']}")
        moe["shared_experts"] = shared // moe["moe_ffn"]
    return moe


def _layer_types(text: Section, num_layers: int, default: Callable[[int], str]) -> list[str]:
    """Each decoder layer's attention type: ``layer_types`` where given, else ``default(layer index)``."""
    types = text.data.get("layer_types")
    if types is None:
        return [default(i) for i in range(num_layers)]
    known = ("full_attention", "linear_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != num_layers or not all(t in known for t in types):
        raise text.unsupported("layer_types", f"give one of {', '.join(known)} for each of the {num_layers} layers")
    return types


def decoder_backbone(text: Section, *, qkv_bias: bool | None = None, qk_norm: bool = False,
                     post_norms: bool = False, deepstack_layers: int = 0) -> list[dict]:
    """A decoder backbone of one layer entry per decoder layer, merged into runs: each layer's attention
    (grouped-query, sliding-window, Gated DeltaNet or gated full attention by its type) and its MLP (dense or
    routed experts); ``qkv_bias`` None reads ``attention_bias``; the first ``deepstack_layers`` layers take one
    DeepStack feature each (Qwen3-VL)."""
    hidden, vocab, num_layers, heads = decoder_base(text)
    act = text.text("hidden_activation", text.text("hidden_act", "silu"))
    if act not in ("silu", *GELU_ACTS):
        raise text.unsupported("hidden_act", "the reader maps gated SiLU (SwiGLU) and gated GELU (GeGLU) MLPs")
    bias = text.flag("attention_bias", False) if qkv_bias is None else qkv_bias
    full = _gqa_fields(text, hidden, heads, qkv_bias=bias, qk_norm=qk_norm)
    if text.has("linear_num_value_heads"):  # Qwen3.5, Qwen3-Next: gated attention on the full layers
        full["attention_gate"] = text.flag("attn_output_gate", True)
        interval = text.count("full_attention_interval", "layers per full-attention layer", 4)
        types = _layer_types(text, num_layers, lambda i: "full_attention" if (i + 1) % interval == 0
                             else "linear_attention")
    elif text.has("sliding_window_pattern") or text.data.get("layer_types") is not None:  # Gemma 3
        pattern = text.count("sliding_window_pattern", "layers per global layer", 6)
        types = _layer_types(text, num_layers, lambda i: "full_attention" if (i + 1) % pattern == 0
                             else "sliding_attention")
    else:
        types = ["full_attention"] * num_layers
    layers = []
    for index, kind in enumerate(types):
        if kind == "linear_attention":
            name, attention = "deltanet", _deltanet_fields(text)
        elif kind == "sliding_attention":
            name, attention = "local", {**full, "sliding_window": text.count("sliding_window", "local window")}
        else:
            name, attention = "decoder" if len(set(types)) == 1 else "attention", full
        layer = {"name": name, "block": "llm", "hidden": hidden, **attention, **_mlp_fields(text, index)}
        if act != "silu":
            layer["activation"] = "geglu"
        if post_norms:
            layer["post_norms"] = True
        if index < deepstack_layers:
            layer.update(name="deepstack", deepstack_in=True)
        layers.append(layer)
    return framed(hidden, vocab, runs(layers), tied=text.flag("tie_word_embeddings", False))


def _deltanet_fields(text: Section) -> dict:
    return {"attention": "gated_deltanet", "heads": text.count("linear_num_value_heads", "DeltaNet value heads"),
            "kv_heads": text.count("linear_num_key_heads", "DeltaNet key heads"),
            "head_dim": text.count("linear_key_head_dim", "DeltaNet key head width"),
            "value_head_dim": text.count("linear_value_head_dim", "DeltaNet value head width"),
            "conv_kernel": text.count("linear_conv_kernel_dim", "DeltaNet convolution width", 4)}


def gqa_backbone(text: Section, *, qkv_bias: bool | None) -> list[dict]:
    """Llama-style decoder (GQA, SwiGLU); ``qkv_bias`` None reads Llama's ``attention_bias``."""
    hidden, vocab, num_layers, heads = decoder_base(text)
    block = {"name": "decoder", "block": "llm", "kind": "dense_block", "repeat": num_layers, "hidden": hidden,
             "heads": heads, "ffn": text.count("intermediate_size", "MLP width")}
    if text.has("num_key_value_heads"):
        block["kv_heads"] = text.count("num_key_value_heads", "key/value heads")
    head_dim = text.count("head_dim", "attention head width", None)
    if head_dim is not None and head_dim * heads != hidden:
        block["head_dim"] = head_dim
    if text.flag("attention_bias", False) if qkv_bias is None else qkv_bias:
        block["qkv_bias"] = True
    return framed(hidden, vocab, [block])


def _deepseek_backbone(text: Section) -> list[dict]:
    """DeepSeek-V2/V3: MLA attention; dense SwiGLU blocks first, then MoE blocks with shared experts."""
    hidden, vocab, num_layers, heads = decoder_base(text)
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
    return framed(hidden, vocab, [dense, moe])


BACKBONES: dict[str, Callable[[Section], list[dict]]] = {
    "llama": lambda text: gqa_backbone(text, qkv_bias=None),
    "mistral": lambda text: gqa_backbone(text, qkv_bias=None),
    "qwen2": lambda text: gqa_backbone(text, qkv_bias=True),
    "deepseek_v2": _deepseek_backbone,
    "deepseek_v3": _deepseek_backbone,
    "qwen3": lambda text: decoder_backbone(text, qk_norm=True),
    "qwen3_moe": lambda text: decoder_backbone(text, qk_norm=True),
    "mixtral": decoder_backbone,
    "gemma3_text": lambda text: decoder_backbone(text, qk_norm=True, post_norms=True),
    "qwen3_vl_text": lambda text: decoder_backbone(text, qk_norm=True),
    "qwen3_vl_moe_text": lambda text: decoder_backbone(text, qk_norm=True),
    "qwen3_5_text": lambda text: decoder_backbone(text, qk_norm=True),
    "qwen3_5_moe_text": lambda text: decoder_backbone(text, qk_norm=True),
    "glm4": lambda text: decoder_backbone(text, qkv_bias=True, post_norms=True),
    "glm4v_text": lambda text: decoder_backbone(text, qkv_bias=True, post_norms=True),
}
"""Text ``model_type`` -> its backbone's layers (a model of its own, or the ``text_config`` of an MLLM)."""
