"""Reading a Hugging Face ``config.json`` one checked field at a time (:class:`Section`), and the class defaults
transformers leaves out of the nested configurations it writes (:data:`NESTED_DEFAULTS`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpipe_tune.errors import MpipeError

YAML_FIX = "or describe the model in a YAML model spec (docs/inputs.md, Model)"
GELU_ACTS = frozenset({"gelu", "quick_gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"})

NESTED_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32},
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                          "hidden_act": "quick_gelu"},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "hidden_act": "gelu_pytorch_tanh"},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "sliding_window": 4096,
                    "sliding_window_pattern": 6},
}
"""Nested ``model_type`` -> the class defaults of transformers' ``LlamaConfig``, ``CLIPVisionConfig``,
``SiglipVisionConfig`` and ``Gemma3TextConfig`` for the fields this reader uses (what a nested configuration
leaves out)."""

_MISSING = object()


@dataclass(frozen=True)
class Section:
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
        return MpipeError(f"{self.file}: missing field '{self.prefix}{name}' ({what}); add it, {YAML_FIX}")

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

    def section(self, name: str, what: str, *, default_type: str | None = None) -> Section:
        """The nested object ``name``, with the class defaults of its ``model_type`` (or ``default_type``)."""
        value = self.data.get(name)
        if value is None:
            raise self.missing(name, what)
        if not isinstance(value, Mapping):
            raise MpipeError(f"{self.file}: field '{self.prefix}{name}' must be an object ({what}), got {value!r}")
        model_type = value.get("model_type", default_type)
        return Section(value, self.file, f"{self.prefix}{name}.", NESTED_DEFAULTS.get(model_type, {}))
