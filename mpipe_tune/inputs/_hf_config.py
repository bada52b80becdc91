"""Hugging Face ``config.json`` -> the model spec the YAML reader produces, read offline.

:func:`from_hf_config` turns the configuration of a published model into the mapping
:func:`mpipe_tune.algebra._model.parse_model` takes (``name``, ``source``, ``layers`` with ``name``, ``block``,
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
  ``moe_block`` layers (the multi-token-prediction module is left out, as in ``models/deepseek-v3.yaml``);
- ``qwen3``, ``qwen3_moe``, ``mixtral``, ``gemma3_text`` (text only): Qwen3's q/k norms, its and Mixtral's routed
  experts, Gemma 3's GeGLU, four norms and sliding-window layers (one global layer in ``sliding_window_pattern``);
- ``qwen3_5``, ``qwen3_5_moe`` (and their ``_text`` backbones): ``layer_types`` of Gated DeltaNet linear
  attention and gated full attention, dense or MoE, after Qwen3-VL's ViT (:mod:`mpipe_tune.inputs._hf_vision`);
- ``qwen3_vl``, ``qwen3_vl_moe``: Qwen3-VL's ViT with its DeepStack taps feeding the first decoder layers;
- ``internvl_chat``, ``internvl``: InternViT, pixel shuffle, InternVL's projector and the backbone;
- ``gemma3``: SigLIP, the pooled projector and the Gemma 3 backbone; ``glm4v``: GLM-4.1V's ViT and GLM-4 backbone.

The multi-token-prediction layers some of these checkpoints carry (Qwen3.5's ``mtp_num_hidden_layers``) are
inference helpers, left out as DeepSeek-V3's are.

transformers writes a nested configuration (LLaVA's ``text_config``, ``vision_config``) without the fields
that equal its class's defaults; :data:`NESTED_DEFAULTS` restores them for the classes those files nest.
A field the reader needs and cannot find or use is one :class:`MpipeError` line that names the file and
the field. Plain ``json``: no transformers, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import path_problem, shown_path
from mpipe_tune.inputs._hf_backbones import BACKBONES
from mpipe_tune.inputs._hf_section import NESTED_DEFAULTS, Section
from mpipe_tune.inputs._hf_vision import MULTIMODAL_FAMILIES

__all__ = ["NESTED_DEFAULTS", "from_hf_config", "is_hf_config"]

CONFIG_FILE = "config.json"

_FAMILIES: dict[str, Callable[[Section], list[dict]]] = {**MULTIMODAL_FAMILIES, **BACKBONES}
"""Top-level ``model_type`` -> the model's layers in order."""


# --- files ------------------------------------------------------------------------------------------

def is_hf_config(path: Path) -> bool:
    """Whether ``path`` is a ``.json`` file or a folder holding a ``config.json``."""
    return (path.suffix == ".json" and path.is_file()) or (path / CONFIG_FILE).is_file()


def from_hf_config(path: str | Path) -> dict[str, Any]:
    """The model spec mapping (what :func:`~mpipe_tune.algebra._model.parse_model` reads) of the Hugging Face
    configuration at ``path``: a config.json, or a folder holding one. The name is ``_name_or_path``, else the
    folder's name (a file not named config.json: its stem)."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    problem = path_problem(file)
    if problem not in (None, "missing"):
        raise MpipeError(f"model file {shown_path(file)} is {problem}; give a Hugging Face config.json")
    try:
        data = json.loads(file.read_text())
    except RecursionError:
        raise MpipeError(f"model file {file} nests deeper than the JSON parser allows (about 1,000 levels); give a "
                         f"Hugging Face config.json") from None
    except OSError as exc:
        raise MpipeError(f"cannot read model file {file}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise MpipeError(f"model file {file} is not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise MpipeError(f"model file {file} is not a text file; give a Hugging Face config.json") from None
    if not isinstance(data, Mapping):
        raise MpipeError(f"{file}: a Hugging Face configuration is a JSON object, got {type(data).__name__}")
    config = Section(data, str(file))
    model_type = data.get("model_type")
    # the 27 types run past an error line's length: the first few, the count, where the rest are listed
    types = f"{', '.join(list(_FAMILIES)[:4])}, ... ({len(_FAMILIES)} types, docs/inputs.md)"
    if model_type is None:
        raise config.missing("model_type", f"the architecture; one of {types}")
    if model_type not in _FAMILIES:
        raise config.unsupported("model_type", f"the reader maps {types}")
    name = data.get("_name_or_path")
    if not isinstance(name, str) or not name:
        name = file.parent.resolve().name if file.name == CONFIG_FILE else file.stem
    return {"name": name, "source": f"Hugging Face configuration {file} (model_type {model_type})",
            "layers": _FAMILIES[model_type](config)}
