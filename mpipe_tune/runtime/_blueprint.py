"""What the runtime builds from a model spec, checked without torch: layer kinds, the tensor that
flows between consecutive layers, each layer's output shape for a microbatch, and the tensor-parallel
degrees its layers can be split by.

The flow of a multimodal model, one torch module per model layer::

    (nothing) -patch_embed-> patches [image_tokens*merge, hidden] -vit_block*-> patches
              -merger-> image tokens [image_tokens, out_hidden] -projector?-> image tokens [.., hidden]
              -embedding-> sequence [text_tokens, hidden] (image tokens spliced in front of the text)
              -dense_block* / moe_block*-> sequence -lm_head-> loss (a scalar)

A text-only model starts at ``embedding``. Every layer's input is the previous layer's output, so a
slab ``[start, stop)`` is those modules applied in turn, and the tensor crossing a boundary after
layer ``l`` has shape :func:`output_shape` ``(l, mb)``, which both ends compute from the workload.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpipe_tune.algebra import ArchCost, Model
from mpipe_tune.inputs import resolve_dims, tensor_parallel_problem, Microbatch
from mpipe_tune.errors import MpipeError, NotSupportedError
from mpipe_tune.runtime._sequence_split import ContextSplit

# The kind of tensor each kind takes and gives: None (no input), "patches", "image", "sequence", "loss".
_FLOW: dict[str, tuple[tuple[str | None, ...], str]] = {
    "patch_embed": ((None,), "patches"),
    "vit_block": (("patches",), "patches"),
    "merger": (("patches",), "image"),
    "projector": (("image",), "image"),
    "pixel_shuffle": (("patches",), "image"),
    "embedding": ((None, "image"), "sequence"),
    "dense_block": (("sequence",), "sequence"),
    "moe_block": (("sequence",), "sequence"),
    "lm_head": (("sequence",), "loss"),
}
SUPPORTED_KINDS = tuple(_FLOW)
CONTEXT_PARALLEL_KINDS = ("embedding", "dense_block", "moe_block", "lm_head")
"""The kinds whose sequence context parallelism divides (the decoder's, as the cost model charges)."""


@dataclass(frozen=True)
class LayerSpec:
    index: int
    name: str
    kind: str
    dims: tuple[tuple[str, Any], ...]
    """Resolved dimensions (defaults filled in)."""
    trainable: bool
    side_in: int = 0
    """Width, per image token, of the DeepStack features the layer before hands on beside its output."""

    def dim(self, key: str) -> Any:
        return dict(self.dims)[key]


def blueprint(model: Model) -> tuple[LayerSpec, ...]:
    """The runtime's layer list for ``model``; a model it cannot build gets a one-line error."""
    specs = []
    flowing: str | None = None
    width: int | None = None
    merge: int | None = None
    side = 0
    for index, layer in enumerate(model.layers):
        where = f"model '{model.name}' layer {index} ('{layer.name}')"
        if not isinstance(layer.cost, ArchCost):
            raise MpipeError(
                f"{where} has explicit per-token costs, so the runtime cannot build it; use compute mode emulated, or "
                f"run a model whose layers give an architecture kind (docs/inputs.md lists them)",
                quantities=("compute mode",)
            )
        kind = layer.cost.kind
        if kind not in _FLOW:
            raise NotSupportedError(f"{where}: kind {kind!r} has no runtime module; supported: {', '.join(SUPPORTED_KINDS)}")
        dims = resolve_dims(kind, layer.cost.dims_dict())
        takes, gives = _FLOW[kind]
        if flowing not in takes:
            got = "nothing (it is the first layer)" if flowing is None else f"a {flowing} tensor"
            want = " or ".join("nothing" if t is None else f"a {t} tensor" for t in takes)
            raise MpipeError(f"{where}: kind {kind!r} takes {want} but the layer before it gives {got}; "
                             f"order the layers patch_embed, vit_block, merger, projector, embedding, blocks, lm_head")
        in_width = {"projector": dims.get("in_hidden"), "merger": dims["hidden"]}.get(kind, dims.get("hidden"))
        if flowing is not None and width != in_width:
            raise MpipeError(f"{where}: input width {in_width} differs from the previous layer's output width {width}; "
                             f"make the dimensions agree")
        if "merge_factor" in dims:
            if merge is not None and dims["merge_factor"] != merge:
                raise MpipeError(f"{where}: merge_factor {dims['merge_factor']} differs from the encoder's {merge}")
            merge = dims["merge_factor"]
        flowing, width = gives, {"merger": dims.get("out_hidden"),
                                 "pixel_shuffle": dims["hidden"] * dims.get("merge_factor", 1)}.get(kind, dims.get("hidden"))
        specs.append(LayerSpec(index, layer.name, kind, tuple(sorted(dims.items())), layer.trainable, side))
        side = _side_after(dims, side, where)
    if flowing != "loss":
        raise MpipeError(f"model '{model.name}': the runtime needs an lm_head as the last layer (it computes the loss); "
                         f"the last layer gives a {flowing} tensor")
    return tuple(specs)


def _side_after(dims: dict, side: int, where: str) -> int:
    """The DeepStack width a layer hands on: what it received, plus its tap, less its injection; it must be the
    layer's ``side_width``."""
    after = side + (dims.get("deepstack_out") or 0) - (dims["hidden"] if dims.get("deepstack_in") else 0)
    if after < 0 or after != dims.get("side_width", 0):
        raise MpipeError(f"{where}: side_width {dims.get('side_width', 0)} does not match the DeepStack features "
                         f"reaching it ({side} wide, plus its tap, less its injection: {after}); make them agree")
    return after


VARIANT_FIELDS = ("window", "layer_scale", "deepstack_out", "deepstack_in", "side_width", "qk_norm", "attention_gate",
                  "sliding_window", "post_norms")


def validate_variants(specs: Sequence[LayerSpec], *, tp_degree: int, cp_degree: int, ep_degree: int) -> None:
    """The runtime's modules of today's variants (:mod:`~mpipe_tune.runtime._variants`) run whole on a rank: a plan
    that splits them by tensor, context or expert parallelism is one line."""
    if tp_degree == cp_degree == ep_degree == 1:
        return
    for spec in specs:
        d = dict(spec.dims)
        used = [f for f in VARIANT_FIELDS if d.get(f)] + (["attention: gated_deltanet"]
                                                           if d.get("attention") == "gated_deltanet" else [])
        if used or spec.kind == "pixel_shuffle" or spec.side_in:
            what = ", ".join(used) or spec.kind
            raise MpipeError(f"layer {spec.index} ('{spec.name}', {spec.kind}) has {what}, which the runtime runs "
                             f"with tensor-, context- and expert-parallel degrees 1 only (got tp {tp_degree}, "
                             f"cp {cp_degree}, ep {ep_degree}); run such a plan with compute mode emulated")


def output_shape(spec: LayerSpec, mb: Microbatch, context: ContextSplit | None = None,
                 sequence_shards: int = 1) -> tuple[int, ...]:
    """Shape of layer ``spec``'s output on microbatch ``mb`` (what a stage boundary after it carries);
    with a ``context`` split, a decoder layer's output is that rank's share of the sequence, and with
    ``sequence_shards`` (sequence parallelism's tp degree) one tensor-parallel rank's rows of that share,
    padded to a multiple of it."""
    base = _base_shape(spec, mb, context, sequence_shards)
    side = spec.dim("side_width") if "side_width" in dict(spec.dims) else 0
    if not side:
        return base
    return (math.prod(base) + mb.image_tokens * side,)  # packed with the DeepStack features it hands on


def _base_shape(spec: LayerSpec, mb: Microbatch, context: ContextSplit | None, sequence_shards: int) -> tuple[int, ...]:
    kind = spec.kind
    if kind == "pixel_shuffle":
        return (mb.image_tokens, spec.dim("hidden") * spec.dim("merge_factor"))
    if kind in ("patch_embed", "vit_block"):
        return (-(-mb.image_tokens * spec.dim("merge_factor") // sequence_shards), spec.dim("hidden"))
    if kind == "merger":
        return (mb.image_tokens, spec.dim("out_hidden"))
    if kind == "lm_head":
        return ()
    if kind == "projector":
        return (mb.image_tokens, spec.dim("hidden"))
    rows = mb.text_tokens if context is None else context.rows(mb.text_tokens)
    return (-(-rows // sequence_shards), spec.dim("hidden"))


def validate_workload(specs: Sequence[LayerSpec], microbatches: Sequence[Microbatch]) -> None:
    """Image tokens are spliced into the sequence, so they must fit in it."""
    if not any(s.kind in ("merger", "pixel_shuffle", "projector") for s in specs):
        return
    for m, mb in enumerate(microbatches):
        if mb.image_tokens > mb.text_tokens:
            raise MpipeError(
                f"workload microbatch {m} has {mb.image_tokens} image tokens but a sequence of {mb.text_tokens}: "
                f"the runtime splices image tokens into the sequence, so image_tokens <= text_tokens must hold"
            )


_MAX_TP_LISTED = 64


def validate_tensor_parallel(specs: Sequence[LayerSpec], tp_degree: int) -> None:
    """Every split the runtime's tensor parallelism makes (:mod:`mpipe_tune.runtime._tensor_parallel`)
    must be even: ``tp_degree`` must divide each layer's heads and split widths (ffn, moe_ffn, vocab,
    the merger's ``hidden * merge_factor``, a two-layer projector's ffn), and a decoder's GQA
    ``kv_heads`` must be a multiple of it or, when fewer, divide it (each rank keeps one head). The
    error names the first layer that breaks a rule and the degrees that fit the whole model, e.g.
    ``tp 3 must divide heads 4 of layer 5 ('dec', dense_block); plan with a tp degree that fits every
    layer (for this model, up to 64: 1, 2, 4)``. ``tp_degree`` 1 always fits.
    """
    if tp_degree == 1:
        return
    for spec in specs:
        problem = tensor_parallel_problem(spec.kind, dict(spec.dims), tp_degree)
        if problem is not None:
            rule, why = problem
            fits = [t for t in range(1, _MAX_TP_LISTED + 1) if all(tensor_parallel_problem(s.kind, dict(s.dims), t) is None for s in specs)]
            raise MpipeError(
                f"tp {tp_degree} {rule} of layer {spec.index} ('{spec.name}', {spec.kind}){why}; plan with a tp "
                f"degree that fits every layer (for this model, up to {_MAX_TP_LISTED}: {', '.join(map(str, fits))})"
            )
