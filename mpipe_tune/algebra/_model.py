"""The model: an ordered list of layers ``u1..uL``.

Each layer has a name, a block (``encoder``, ``projector``, ``llm``, ...), a trainable bit and a cost
descriptor. A layer's *stream* is ``image`` for encoder blocks and ``text`` for the others; its work in
a microbatch scales with that stream's tokens. The algebra reads only the layer count and the
trainable bits; the cost descriptor is carried for the cost model.

A model file is YAML::

    name: example
    layers:
      - {name: vit, block: encoder, repeat: 4, fwd_s_per_token: 1.0e-6, bwd_s_per_token: 2.0e-6}
      - {name: decoder, block: llm, repeat: 8, fwd_s_per_token: 2.0e-6, bwd_s_per_token: 4.0e-6}

``repeat`` expands one entry into that many layers (named ``decoder.0``, ``decoder.1``, ...). A layer
gives either explicit costs (``fwd_s_per_token``, ``bwd_s_per_token``, optional
``boundary_bytes_per_token``) or an architecture ``kind`` with its dimensions. A pairing file gives
``compose`` instead of ``layers``: a list of model names or files, or inline ``{layers: [...]}``.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Union

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import check_finite, shown

ENCODER_BLOCK = "encoder"
BACKBONE_BLOCK = "llm"
_STRUCTURAL_KEYS = ("name", "block", "trainable", "repeat", "kind")
_EXPLICIT_KEYS = ("fwd_s_per_token", "bwd_s_per_token", "boundary_bytes_per_token")
_EXPLICIT_UPPER = {"fwd_s_per_token": 1.0, "bwd_s_per_token": 1.0, "boundary_bytes_per_token": 2.0**30}
"""Bounds no real layer reaches (a second per token, a GiB per token): past them a value is a typo."""


@dataclass(frozen=True)
class ExplicitCost:
    """Seconds per token of the layer's stream, given directly (tests and quick studies)."""

    fwd_s_per_token: float
    bwd_s_per_token: float
    """The full backward (input and weight gradient); a frozen layer that only passes the gradient
    through pays half of it."""
    boundary_bytes_per_token: float = 0.0
    """Bytes per token of the layer's output, what a stage boundary after it sends."""


@dataclass(frozen=True)
class ArchCost:
    """An architecture kind and its dimensions; :mod:`mpipe_tune.cost._arch` interprets them."""

    kind: str
    dims: tuple[tuple[str, Any], ...]

    def dims_dict(self) -> dict[str, Any]:
        return dict(self.dims)


CostDescriptor = Union[ExplicitCost, ArchCost]


@dataclass(frozen=True)
class Layer:
    name: str
    block: str
    trainable: bool
    cost: CostDescriptor


@dataclass(frozen=True)
class Model:
    """A model as the algebra sees it: an ordered tuple of layers, each in a block (``encoder``,
    ``projector``, ``llm``, ...) with its trainable bit and its cost description (explicit seconds per
    token, or architecture dimensions the cost model reads)."""

    name: str
    layers: tuple[Layer, ...]
    source: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def encoder_end(self) -> int:
        """Index of the first layer that is not an encoder layer (0 when the model does not start with one).

        >>> m = Model("m", tuple(Layer(f"u{i}", b, True, ExplicitCost(1.0, 1.0))
        ...                      for i, b in enumerate(("encoder", "encoder", "projector", "llm"))))
        >>> m.encoder_end, m.backbone_start
        (2, 3)
        """
        return next((i for i, u in enumerate(self.layers) if u.block != ENCODER_BLOCK), 0)

    @property
    def backbone_start(self) -> int:
        """Index of the first backbone (``llm``) layer: the encoder and projector come before it. A model
        without an ``llm`` block starts its backbone after its encoder (:attr:`encoder_end`)."""
        return next((i for i, u in enumerate(self.layers) if u.block == BACKBONE_BLOCK), self.encoder_end)

    @property
    def head_start(self) -> int:
        """Index of the first layer of the model's head: the trailing layers after its last backbone
        (``llm``) layer, such as a generator head (:attr:`num_layers` when there are none, or no backbone).

        >>> m = Model("m", tuple(Layer(f"u{i}", b, True, ExplicitCost(1.0, 1.0))
        ...                      for i, b in enumerate(("encoder", "llm", "llm", "generator"))))
        >>> m.head_start, m.num_layers
        (3, 4)
        """
        last = next((i for i in reversed(range(self.num_layers)) if self.layers[i].block == BACKBONE_BLOCK), None)
        return self.num_layers if last is None else last + 1

    def trainable_bits(self) -> tuple[bool, ...]:
        return self._trainable_bits

    @cached_property
    def _trainable_bits(self) -> tuple[bool, ...]:  # read per region, slab and reduce of every new candidate
        return tuple(layer.trainable for layer in self.layers)

    def blocks(self) -> tuple[str, ...]:
        """Block names in first-appearance order."""
        return tuple(dict.fromkeys(layer.block for layer in self.layers))

    def with_frozen(self, blocks: tuple[str, ...]) -> Model:
        """A copy with every layer of the given blocks frozen (``trainable = False``)."""
        unknown = [b for b in blocks if b not in self.blocks()]
        if unknown:
            raise MpipeError(
                f"frozen block(s) {','.join(unknown)}: model '{self.name}' has no such block; "
                f"its blocks are {', '.join(self.blocks())}"
            )
        layers = tuple(
            Layer(u.name, u.block, u.trainable and u.block not in blocks, u.cost) for u in self.layers
        )
        return Model(self.name, layers, self.source)

    def content_hash(self) -> str:
        """sha256 over the layers (names, blocks, trainable bits, costs): what a plan was made for."""
        payload = [
            [u.name, u.block, u.trainable, type(u.cost).__name__, _cost_fields(u.cost)]
            for u in self.layers
        ]
        text = json.dumps({"name": self.name, "layers": payload}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


def _cost_fields(cost: CostDescriptor) -> list:
    if isinstance(cost, ExplicitCost):
        return [cost.fwd_s_per_token, cost.bwd_s_per_token, cost.boundary_bytes_per_token]
    return [cost.kind, [list(kv) for kv in cost.dims]]


def parse_model(
    data: Any,
    *,
    where: str,
    resolve: Callable[[str], Any] | None = None,
) -> Model:
    """Build a :class:`Model` from the parsed YAML ``data`` of a model file.

    ``where`` names the file in messages. ``resolve(name)`` returns the parsed data of another model
    for ``compose`` entries. Architecture dimensions are checked by the cost model, not here.
    """
    if data is None:  # YAML reads an empty file as null
        raise MpipeError(f"{where}: the file is empty; a model file is a mapping with 'name' and 'layers' "
                         f"(docs/inputs.md, Model)")
    if not isinstance(data, Mapping):
        raise MpipeError(f"{where}: a model file must be a mapping with 'name' and 'layers', got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise MpipeError(f"{where}: field 'name' must be a non-empty string; add e.g. 'name: my-model'")
    if ("layers" in data) == ("compose" in data):
        raise MpipeError(f"{where}: give exactly one of 'layers' (a list of layers) or 'compose' (a list of models)")
    if "layers" in data:
        layers = _parse_layer_list(data["layers"], where=where)
    else:
        layers = _parse_compose(data["compose"], where=where, resolve=resolve)
    if not layers:
        raise MpipeError(f"{where}: the model has no layers; list at least one under 'layers'")
    return Model(name=name, layers=tuple(layers), source=str(data.get("source", "")))


MAX_LAYERS = 4096
"""The most layers a model may have after ``repeat`` and ``compose`` are expanded: dozens of times any model's."""


def _check_layer_count(count: int, where: str) -> None:
    if count > MAX_LAYERS:
        raise MpipeError(f"{where}: the model has more than {MAX_LAYERS} layers ({count} so far, repeats expanded); "
                         f"a model has at most {MAX_LAYERS}: fix the layer counts or 'repeat'")


_COMPOSING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("composing", default=())
"""The model names being composed, outermost first: a name seen twice is a cycle."""


def _parse_compose(entries: Any, *, where: str, resolve: Callable[[str], Any] | None) -> list[Layer]:
    if not isinstance(entries, list) or not entries:
        raise MpipeError(f"{where}: 'compose' must be a non-empty list of model names or {{layers: [...]}} entries")
    layers: list[Layer] = []
    for index, entry in enumerate(entries):
        if isinstance(entry, str):
            if resolve is None:
                raise MpipeError(f"{where}: compose[{index}] names model '{entry}', but no model library is available")
            chain = _COMPOSING.get()
            if entry in chain:
                raise MpipeError(f"{where}: compose[{index}] names model '{entry}', which composes itself "
                                 f"({' -> '.join((*chain, entry))}); remove the cycle")
            token = _COMPOSING.set((*chain, entry))
            try:
                layers.extend(parse_model(resolve(entry), where=entry, resolve=resolve).layers)
                _check_layer_count(len(layers), where)
            finally:
                _COMPOSING.reset(token)
        elif isinstance(entry, Mapping) and "layers" in entry:
            layers.extend(_parse_layer_list(entry["layers"], where=f"{where} compose[{index}]"))
            _check_layer_count(len(layers), where)
        else:
            raise MpipeError(f"{where}: compose[{index}] must be a model name or a mapping with 'layers', got {shown(entry)}")
    return layers


def _parse_layer_list(entries: Any, *, where: str) -> list[Layer]:
    if not isinstance(entries, list):
        raise MpipeError(f"{where}: 'layers' must be a list of layer entries, got {type(entries).__name__}")
    layers: list[Layer] = []
    for index, entry in enumerate(entries):
        layers.extend(_parse_layer(entry, where=f"{where} layers[{index}]"))
        _check_layer_count(len(layers), where)
    return layers


def _parse_layer(entry: Any, *, where: str) -> list[Layer]:
    if not isinstance(entry, Mapping):
        raise MpipeError(f"{where}: a layer must be a mapping with name, block and costs, got {shown(entry)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise MpipeError(f"{where}: field 'name' must be a non-empty string")
    where = f"{where} ('{name}')"
    block = entry.get("block")
    if not isinstance(block, str) or not block:
        raise MpipeError(f"{where}: field 'block' must be a block name such as 'encoder', 'projector' or 'llm'")
    trainable = entry.get("trainable", True)
    if not isinstance(trainable, bool):
        raise MpipeError(f"{where}: field 'trainable' must be true or false, got {shown(trainable)}")
    repeat = entry.get("repeat", 1)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or not 1 <= repeat <= MAX_LAYERS:
        raise MpipeError(f"{where}: field 'repeat' must be an integer from 1 to {MAX_LAYERS}, got {shown(repeat)}")
    cost = _parse_cost(entry, where=where)
    if repeat == 1:
        return [Layer(name, block, trainable, cost)]
    return [Layer(f"{name}.{i}", block, trainable, cost) for i in range(repeat)]


def _parse_cost(entry: Mapping, *, where: str) -> CostDescriptor:
    explicit = [key for key in _EXPLICIT_KEYS if key in entry]
    if "kind" in entry:
        if explicit:
            raise MpipeError(f"{where}: give either 'kind' with dimensions or explicit costs ({', '.join(explicit)}), not both")
        kind = entry["kind"]
        if not isinstance(kind, str):
            raise MpipeError(f"{where}: field 'kind' must be an architecture kind name, got {shown(kind)}")
        dims = tuple(sorted((k, v) for k, v in entry.items() if k not in _STRUCTURAL_KEYS))
        return ArchCost(kind=kind, dims=dims)
    if "fwd_s_per_token" not in entry or "bwd_s_per_token" not in entry:
        raise MpipeError(
            f"{where}: a layer needs costs: either 'fwd_s_per_token' and 'bwd_s_per_token' (seconds per token) "
            f"or an architecture 'kind' with its dimensions"
        )
    unknown = [k for k in entry if k not in _STRUCTURAL_KEYS + _EXPLICIT_KEYS]
    if unknown:
        raise MpipeError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} for an explicit-cost layer; "
                         f"allowed: {', '.join(_STRUCTURAL_KEYS[:-1] + _EXPLICIT_KEYS)}")
    values = {key: check_finite(entry[key], where=where, field=key, upper=_EXPLICIT_UPPER[key]) for key in explicit}
    return ExplicitCost(**values)
