"""The vision variants of today's families, as kernels of the image-stream kinds.

- ``window`` on a ``vit_block`` (Qwen2.5-VL): attention inside windows of ``window`` patches (Qwen2.5-VL's
  ``window_size`` of 112 pixels is 8 x 8 patches of 14), its full-attention blocks (``fullatt_block_indexes``) left
  without one. The windows tile each image's patches; without the image's shape, an image of ``n`` patches is
  charged ``n // window`` full windows and one of the remainder (the edge windows of a real grid are smaller, so
  this is an upper bound on the scores).
- ``layer_scale`` on a ``vit_block`` (InternViT): a per-channel scale on each residual branch.
- ``deepstack_out`` on a ``vit_block`` (Qwen3-VL's DeepStack): the block's output also goes through a DeepStack
  merger (LayerNorm over ``merge_factor`` concatenated patches, a two-layer GELU MLP to ``deepstack_out``), whose
  ``[image_tokens, deepstack_out]`` feature is added into a decoder layer (``deepstack_in``).
- ``side_width`` on the kinds of :data:`~mpipe_tune.inputs._arch_dims.SIDE_FEATURE_KINDS`: DeepStack features
  taken before a layer and injected after it travel beside its output, so a pipeline stage boundary there carries
  ``image_tokens * side_width`` more elements (sent, received and held as any boundary tensor is).
- ``pixel_shuffle`` (InternVL): ``merge_factor`` neighbouring patches concatenated into one token of
  ``hidden * merge_factor`` (a weightless copy); ``norm`` on a ``projector`` is the LayerNorm InternVL's
  projector starts with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from mpipe_tune.cost._arch_attention_variants import Norm, scale_core
from mpipe_tune.cost._arch_pieces import Layer, Piece, all_reduce, matmul, pointwise

_GELU_FLOPS_PER_ELEM = 8.0
LAYER_SCALE_KERNELS = (1.0, 2.0, 0.0)
"""A layer scale's product, and its backward's product and the scale's gradient reduction."""


def windowed_pairs(patches, window: int):
    """Scores of full attention inside windows of ``window`` patches over an image of ``patches`` patches.

    >>> windowed_pairs(256, 64), windowed_pairs(100, 64)
    (16384, 5392)
    """
    n = np.asarray(patches)
    pairs = (n // window) * window * window + (n % window) ** 2
    return pairs.item() if pairs.ndim == 0 else pairs


def vit_variants(dims: Mapping[str, Any], pieces: list[Piece], mb, seq_lens: list, tp_degree: int, *,
                 norm: Norm) -> list[Piece]:
    """A ViT block's ``pieces`` with its windows, layer scale and DeepStack merger."""
    hidden, patches = dims["hidden"], mb.image_tokens * dims["merge_factor"]
    if dims["window"] is not None:
        pieces = scale_core(pieces, seq_lens, [windowed_pairs(s, dims["window"]) for s in seq_lens])
    if dims["layer_scale"]:
        elems = patches * hidden
        pieces = [*pieces, *(pointwise(elems, elems, elems, params=hidden, kernels=LAYER_SCALE_KERNELS, param_tensors=1)
                             for _ in range(2))]
    if dims["deepstack_out"] is not None:
        pieces = [*pieces, *deepstack_merger(mb.image_tokens, hidden * dims["merge_factor"], dims["deepstack_out"],
                                             tp_degree, norm=norm)]
    return pieces


def deepstack_merger(tokens, merged: int, out: int, tp_degree: int, *, norm: Norm) -> list[Piece]:
    """Qwen3-VL's DeepStack merger on ``tokens`` image tokens of ``merged`` concatenated patch features: LayerNorm,
    ``merged -> merged`` GELU ``-> out`` (column, then row split over the ranks; its all-reduce counted)."""
    inner = tokens * merged / tp_degree
    return [
        norm("deepstack", tokens, merged, layernorm=True),
        matmul("deepstack_norm", tokens, merged, merged, split="column", tp_degree=tp_degree, bias=True),
        pointwise(inner, inner, _GELU_FLOPS_PER_ELEM * inner, saved=(("deepstack_up", inner),)),
        matmul("deepstack_act", tokens, merged, out, split="row", tp_degree=tp_degree, bias=True),
        all_reduce(tokens * out, tp_degree=tp_degree),
    ]


def pixel_shuffle(dims: Mapping[str, Any], mb, degrees) -> Layer:
    """InternVL's pixel shuffle: a copy of the patches into ``merge_factor`` times wider, fewer tokens."""
    elems = mb.image_tokens * dims["merge_factor"] * dims["hidden"]
    return Layer((pointwise(elems, elems, 0.0),), boundary_elems=elems)


def projector_norm(dims: Mapping[str, Any], mb, *, norm: Norm) -> list[Piece]:
    """The LayerNorm before a projector with ``norm`` (none without)."""
    return [norm("x_pre_norm", mb.image_tokens, dims["in_hidden"], layernorm=True)] if dims["norm"] else []


def with_side_features(layer: Layer, dims: Mapping[str, Any], mb) -> Layer:
    """``layer`` with the DeepStack features it carries (``side_width``) added to its stage-boundary tensor."""
    width = dims.get("side_width", 0)
    if not width:
        return layer
    return replace(layer, boundary_elems=layer.boundary_elems + mb.image_tokens * width)
