"""Architecture kinds, their dimension fields, and the check a model spec's dimensions must pass.

Each layer of a model spec that names an architecture ``kind`` carries its dimensions as plain keys.
:data:`ARCH_KINDS` lists the fields each kind needs, :data:`OPTIONAL_DIMS` the fields it may have and
their defaults (``None`` where the default is derived from other fields, or where the field belongs
to a variant, such as the MLA fields, that is off by default). :func:`validate_arch` is the boundary
check the model loader calls; the cost formulas in :mod:`mpipe_tune.cost._arch_layers` assume it passed.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from mpipe_tune.errors import MpipeError

ARCH_KINDS: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "hidden"),
    "dense_block": ("hidden", "heads", "ffn"),
    "moe_block": ("hidden", "heads", "experts", "top_k", "moe_ffn"),
    "lm_head": ("hidden", "vocab"),
    "vit_block": ("hidden", "heads", "ffn", "merge_factor"),
    "patch_embed": ("hidden", "patch_size", "merge_factor"),
    "merger": ("hidden", "out_hidden", "merge_factor"),
    "projector": ("in_hidden", "hidden"),
    "pixel_shuffle": ("hidden", "merge_factor"),
}
"""Kind name -> the dimension fields a layer of that kind must give."""

IMAGE_STREAM_KINDS: frozenset[str] = frozenset({"vit_block", "patch_embed", "merger", "projector", "pixel_shuffle"})
"""Kinds that work on a microbatch's image tokens; every other kind works on its text tokens."""

_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MLA_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_GQA_FIELDS = ("kv_heads", "head_dim")
_DELTANET_FIELDS = ("value_head_dim", "conv_kernel")

_DECODER_ATTENTION: dict[str, object] = {
    "attention": "gqa",  # gqa (multi-head and grouped-query), mla (DeepSeek's multi-head latent attention) or
    # gated_deltanet (Gated DeltaNet linear attention, Qwen3.5's and Qwen3-Next's)
    "kv_heads": None,  # gqa: key/value heads; None means heads (plain multi-head attention)
    "head_dim": None,  # gqa: None means hidden // heads
    "qkv_bias": False,  # biases on the q, k and v projections (Qwen2)
    "rope_dim": None,  # gqa: dimensions of each q/k head RoPE rotates; None means head_dim, 0 no RoPE (GPT-3)
    "q_lora_rank": None,  # mla: None means q is projected straight from the hidden state
    "kv_lora_rank": None,
    "qk_nope_head_dim": None,
    "qk_rope_head_dim": None,
    "v_head_dim": None,
    "qk_norm": False,  # RMSNorm of each q and k head before attention (Qwen3, Qwen3.5, Gemma 3)
    "attention_gate": False,  # gqa: a sigmoid gate from the input on the attention output (Qwen3.5's gated attention)
    "sliding_window": None,  # gqa: each token attends to the last sliding_window tokens only (Gemma 3's local layers)
    "post_norms": False,  # a norm after the attention and after the MLP besides the two before (Gemma 3, GLM-4)
    # gated_deltanet reads heads as its value heads (one recurrent state each), kv_heads as its query/key heads
    # and head_dim as their width:
    "value_head_dim": None,  # gated_deltanet: None means head_dim
    "conv_kernel": None,  # gated_deltanet: the causal depthwise convolution's width over q, k and v; None means 4
    "deepstack_in": False,  # adds one DeepStack feature (ViT features of the image tokens) to its output (Qwen3-VL)
}

OPTIONAL_DIMS: dict[str, dict[str, object]] = {
    "embedding": {},
    "dense_block": {**_DECODER_ATTENTION, "activation": "swiglu"},
    "moe_block": {**_DECODER_ATTENTION, "activation": "swiglu", "shared_experts": 0},
    "lm_head": {"tied": False},  # tied: its weights are the embedding's (Gemma 3), held again on its stage
    "vit_block": {"head_dim": None, "activation": "gelu", "bias": True,
                  "window": None,  # attention inside windows of this many patches (Qwen2.5-VL); None: the whole image
                  "layer_scale": False,  # a learned per-channel scale on each residual branch (InternViT)
                  "deepstack_out": None},  # its output also feeds a DeepStack merger to this width (Qwen3-VL)
    "patch_embed": {"in_channels": 3, "temporal_patch": 1, "bias": False, "positions": 0,
                    # the processor's image rule (dataset workloads): a dynamic resolution's pixel bounds, or
                    # InternVL's tiles of the position table's square (docs/workloads.md)
                    "min_pixels": None, "max_pixels": None, "max_tiles": None},
    "merger": {},
    "projector": {"depth": 2, "ffn": None, "norm": False,  # norm: a LayerNorm before it (InternVL's)
                  "activation": "gelu"},
    "pixel_shuffle": {},
}
"""Kind -> optional dimension field -> its default."""

SIDE_FEATURE_KINDS = ("vit_block", "merger", "projector", "pixel_shuffle", "embedding", "dense_block", "moe_block")
"""Kinds that may carry DeepStack features past them: ``side_width`` (default 0) is the width, per image token,
of the ViT features a layer hands on beside its output, taken before it and injected after it (Qwen3-VL)."""
for _kind in SIDE_FEATURE_KINDS:
    OPTIONAL_DIMS[_kind]["side_width"] = 0

DEFAULT_CONV_KERNEL = 4
"""Gated DeltaNet's short convolution width when a layer gives none (Qwen3-Next's and Qwen3.5's)."""

_COUNT_FIELDS = frozenset({"shared_experts", "positions", "rope_dim", "side_width"})  # integers >= 0; others > 0
_FLAG_FIELDS = frozenset({"qkv_bias", "bias", "qk_norm", "attention_gate", "post_norms", "deepstack_in",
                          "layer_scale", "norm", "tied"})
_CHOICE_FIELDS: dict[str, tuple[str, ...]] = {
    "attention": ("gqa", "mla", "gated_deltanet"),
    "activation": ("swiglu", "geglu", "gelu"),
}
_DEPTHS = (1, 2)


def validate_arch(kind: str, dims: Mapping[str, object], *, where: str) -> None:
    """Raise :class:`MpipeError` unless ``dims`` are valid dimensions for an architecture ``kind``.

    The message is one line that starts with ``where`` and names the field, the value, what must hold
    and how to fix it.
    """
    if kind not in ARCH_KINDS:
        raise MpipeError(f"{where}: unknown kind {kind!r}; use one of {', '.join(sorted(ARCH_KINDS))}")
    required = ARCH_KINDS[kind]
    optional = OPTIONAL_DIMS[kind]
    for field in required:
        if field not in dims:
            raise MpipeError(
                f"{where}: missing field {field!r}; kind {kind!r} needs {', '.join(required)}; add {field}: <int>"
            )
    known = (*required, *optional)
    for field in dims:
        if field not in known:
            close = difflib.get_close_matches(str(field), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise MpipeError(
                f"{where}: unknown field {field!r} for kind {kind!r}; {hint}known fields: {', '.join(known)}"
            )
    for field, value in dims.items():
        if value is None and field in optional and optional[field] is None:
            continue
        _check_value(field, value, where=where)
    _check_relations(kind, resolve_dims(kind, dims, derive=False), where=where)


def resolve_dims(kind: str, dims: Mapping[str, object], *, derive: bool = True) -> dict[str, object]:
    """Return ``dims`` with the defaults of ``kind`` filled in (and, with ``derive``, ``head_dim``)."""
    full = {**OPTIONAL_DIMS[kind], **dims}
    if not derive or full.get("attention") == "mla":
        return full
    if "head_dim" in full and full["head_dim"] is None:
        full["head_dim"] = full["hidden"] // full["heads"]
    if "kv_heads" in full and full["kv_heads"] is None:
        full["kv_heads"] = full["heads"]
    if full.get("attention") == "gated_deltanet":
        full["value_head_dim"] = full["value_head_dim"] or full["head_dim"]
        full["conv_kernel"] = full["conv_kernel"] or DEFAULT_CONV_KERNEL
    return full


def _check_value(field: str, value: object, *, where: str) -> None:
    if field in _CHOICE_FIELDS:
        choices = _CHOICE_FIELDS[field]
        if value not in choices:
            raise MpipeError(f"{where}: field {field!r} = {value!r} must be one of {', '.join(choices)}")
        return
    if field in _FLAG_FIELDS:
        if not isinstance(value, bool):
            raise MpipeError(f"{where}: field {field!r} = {value!r} must be true or false")
        return
    lowest = 0 if field in _COUNT_FIELDS else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        what = "an integer >= 0" if lowest == 0 else "a positive integer"
        raise MpipeError(f"{where}: field {field!r} = {value!r} must be {what}; correct it in the model file")


def _check_relations(kind: str, dims: Mapping[str, object], *, where: str) -> None:
    """Checks between fields, on dimensions whose single values already passed."""
    if kind in ("dense_block", "moe_block"):
        _check_decoder_attention(dims, where=where)
    elif kind == "vit_block" and dims["head_dim"] is None:
        _check_divides("heads", dims["heads"], "hidden", dims["hidden"], where=where, fix="or set head_dim")
    if kind == "moe_block" and dims["top_k"] > dims["experts"]:
        raise MpipeError(
            f"{where}: field 'top_k' = {dims['top_k']} must be <= 'experts' = {dims['experts']}; "
            f"a token cannot be routed to more experts than there are"
        )
    if kind == "projector" and dims["depth"] not in _DEPTHS:
        raise MpipeError(f"{where}: field 'depth' = {dims['depth']!r} must be 1 or 2 (linear layers in the projector)")


def _check_decoder_attention(dims: Mapping[str, object], *, where: str) -> None:
    if dims["attention"] != "gated_deltanet":
        for field in _DELTANET_FIELDS:
            if dims[field] is not None:
                raise MpipeError(f"{where}: field {field!r} applies to attention: gated_deltanet only; remove it or "
                                 f"set attention: gated_deltanet")
    for field in ("attention_gate", "sliding_window", "qk_norm"):
        if dims[field] and dims["attention"] != "gqa":
            raise MpipeError(f"{where}: field {field!r} applies to attention: gqa only; remove it")
    if dims["attention"] == "mla":
        for field in _GQA_FIELDS:
            if dims[field] is not None:
                raise MpipeError(
                    f"{where}: field {field!r} applies to attention: gqa only; remove it or set attention: gqa "
                    f"(MLA uses {', '.join(_MLA_FIELDS)})"
                )
        for field in _MLA_REQUIRED:
            if dims[field] is None:
                raise MpipeError(f"{where}: missing field {field!r}, which attention: mla needs; add {field}: <int>")
        return
    for field in _MLA_FIELDS:
        if dims[field] is not None:
            raise MpipeError(
                f"{where}: field {field!r} applies to attention: mla only; remove it or set attention: mla"
            )
    if dims["kv_heads"] is not None:
        _check_divides("kv_heads", dims["kv_heads"], "heads", dims["heads"], where=where, fix="")
    if dims["head_dim"] is None:
        _check_divides("heads", dims["heads"], "hidden", dims["hidden"], where=where, fix="or set head_dim")


def _check_divides(name: str, value: object, of_name: str, of_value: object, *, where: str, fix: str) -> None:
    if of_value % value != 0:
        raise MpipeError(
            f"{where}: field {name!r} = {value} must divide {of_name!r} = {of_value}; "
            f"choose a divisor of {of_value} {fix}".rstrip()
        )


def _tp_splits(kind: str, d: Mapping[str, object]) -> list[tuple[str, int]]:
    """(field, value) of every dimension the tensor-parallel split of a ``kind`` layer divides evenly."""
    if kind in ("embedding", "lm_head"):
        return [("vocab", d["vocab"])]
    if kind == "vit_block":
        return [("heads", d["heads"]), ("ffn", d["ffn"])]
    if kind == "merger":
        return [("hidden * merge_factor", d["hidden"] * d["merge_factor"])]
    if kind == "pixel_shuffle":
        return []
    if kind == "projector":
        if d["depth"] == 1:
            return []
        return [("ffn", d["ffn"])] if d["ffn"] else [("hidden (the projector's default ffn)", d["hidden"])]
    if kind == "dense_block":
        return [("heads", d["heads"]), ("ffn", d["ffn"])]
    if kind == "moe_block":
        return [("heads", d["heads"]), ("moe_ffn", d["moe_ffn"])]
    return []  # patch_embed: replicated


def tensor_parallel_problem(kind: str, dims: Mapping[str, object], tp_degree: int) -> tuple[str, str] | None:
    """What ``tp_degree`` breaks in a ``kind`` layer of resolved ``dims`` and why it must hold
    (``("must divide heads 4", "")``), or None when it fits.

    Tensor parallelism splits heads and matmul widths evenly over the ranks (Megatron-LM's column/row
    split, as :mod:`mpipe_tune.cost._arch_layers` charges it and the runtime executes it); a decoder's
    GQA ``kv_heads`` must be a multiple of the degree or, when fewer, divide it (each rank keeps one).

    >>> tensor_parallel_problem("dense_block", resolve_dims("dense_block", {"hidden": 64, "heads": 4, "ffn": 128}), 3)
    ('must divide heads 4', '')
    """
    for field, value in _tp_splits(kind, dims):
        if value % tp_degree != 0:
            return f"must divide {field} {value}", ""
    kv_heads = dims.get("kv_heads") if kind in ("dense_block", "moe_block") else None
    if kv_heads is not None:  # GQA (MLA splits by heads only)
        if kv_heads >= tp_degree and kv_heads % tp_degree != 0:
            return f"must divide kv_heads {kv_heads}", ", which are split over the ranks when there are at least tp"
        if kv_heads < tp_degree and tp_degree % kv_heads != 0:
            return (f"must be a multiple of kv_heads {kv_heads}",
                    ", since with fewer key/value heads than ranks each rank keeps one of them")
    return None
