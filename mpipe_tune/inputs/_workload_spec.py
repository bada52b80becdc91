"""Resolving a workload SPEC that names a dataset, for the model it will train.

A dataset's images and text become tokens as the model sees them: the image rule comes from the
model's patch embedding (and, for a Hugging Face model folder, its ``preprocessor_config.json``), the
text rule from the folder's ``tokenizer.json`` (or a given one), else from a stated number of
characters per token. Mix names and workload files are read by
:func:`mpipe_tune.inputs._workload.load_workload`; this module adds the datasets, which need the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mpipe_tune.algebra import ArchCost, Model
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import path_problem, shown_path
from mpipe_tune.inputs._dataset import Dataset, read_dataset
from mpipe_tune.inputs._dataset_spec import DEFAULT_CHARS_PER_TOKEN, DatasetSpec, TextRule, image_rule_from_dims
from mpipe_tune.inputs._dataset_readers import CONVERSATION_SUFFIXES, MANIFEST_SUFFIXES, is_manifest
from mpipe_tune.inputs._workload import Workload


@dataclass(frozen=True)
class DatasetOptions:
    """How the trainer reads a dataset, beyond what the model says."""

    seq_len: int | None = None
    """Packing length in tokens (None: one sample per sequence)."""
    chars_per_token: float | None = None
    """Characters per text token where there is no tokenizer (None: the default, stated in a note)."""
    tokenizer: str | None = None
    """A tokenizer.json (None: the model folder's, if it has one)."""
    image_folder: str | None = None
    """Where a conversation file's image paths start (None: the file's folder)."""

    def given(self) -> tuple[str, ...]:
        """The quantities set, as errors name them."""
        return tuple(name for name, value in (("packing length", self.seq_len), ("tokenizer", self.tokenizer),
                                              ("characters per token", self.chars_per_token),
                                              ("image folder", self.image_folder)) if value is not None)


def validate_dataset_options(workload: str, options: DatasetOptions) -> None:
    """Raises where ``options`` are set but ``workload`` is a mix or a workload file: only a dataset reads them,
    so they would change nothing."""
    given = options.given()
    if given and not is_dataset(workload):
        raise MpipeError(f"{' and '.join(given)} given, but workload '{workload}' is not a dataset, so "
                         f"{'they' if len(given) > 1 else 'it'} would change nothing; give a dataset (a LLaVA/ShareGPT "
                         f".json/.jsonl, a .csv/.parquet/.jsonl manifest) or leave {'them' if len(given) > 1 else 'it'} "
                         f"out", quantities=given)


def is_dataset(spec: str) -> bool:
    """Whether ``spec`` names a dataset rather than a mix or a workload file: a manifest table, a
    ``.jsonl`` file, or a ``.json`` file whose top level is a list (a workload file is a mapping)."""
    path = Path(spec)
    suffix = path.suffix.lower()
    if suffix in MANIFEST_SUFFIXES or suffix == ".jsonl":
        return True
    if suffix not in CONVERSATION_SUFFIXES or not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head[:1] == b"["


def _model_folder(model_spec: str) -> Path | None:
    path = Path(model_spec)
    if path.is_dir():
        return path
    return path.parent if path.is_file() else None


def dataset_spec(path: str, model_spec: str, model: Model, options: DatasetOptions) -> tuple[DatasetSpec, list[str]]:
    """The dataset's spec for ``model`` (``model_spec`` the name or path it was loaded from), and notes
    on the rules chosen where the model did not say (printed by the caller)."""
    notes = []
    unread = tuple(q for q in options.given() if q != "packing length")
    if unread and is_manifest(Path(path)):
        raise MpipeError(f"{' and '.join(unread)} given, but dataset {path} is a manifest, whose rows give their "
                         f"text_tokens and image sizes, so {'they' if len(unread) > 1 else 'it'} would change nothing; "
                         f"leave {'them' if len(unread) > 1 else 'it'} out", quantities=unread)
    folder = _model_folder(model_spec)
    patch = next((dict(layer.cost.dims) for layer in model.layers
                  if isinstance(layer.cost, ArchCost) and layer.cost.kind == "patch_embed"), None)
    preprocessor = None
    if folder is not None and (folder / "preprocessor_config.json").is_file():
        try:
            preprocessor = json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
        except RecursionError:
            raise MpipeError(f"{folder / 'preprocessor_config.json'} nests too deeply to be read; fix or remove it") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MpipeError(f"{folder / 'preprocessor_config.json'} cannot be read ({exc}); fix or remove it") from None
    image_rule = image_rule_from_dims(patch, preprocessor if isinstance(preprocessor, dict) else None)
    if patch is None:
        notes.append(f"model {model.name} has no patch embedding to size images with: images are {image_rule.describe()} "
                     f"(Qwen2-VL's rule, as the named mixes)")
    tokenizer = options.tokenizer
    if tokenizer is None and folder is not None and (folder / "tokenizer.json").is_file():
        tokenizer = str(folder / "tokenizer.json")
    if tokenizer is not None:
        problem = path_problem(tokenizer)
        if problem is not None:
            raise MpipeError(f"tokenizer {shown_path(tokenizer)} is {problem}, not a file; give a Hugging Face "
                             f"tokenizer.json", quantities=("tokenizer",))
        text_rule = TextRule(str(Path(tokenizer).resolve()))
    else:
        text_rule = TextRule(None, DEFAULT_CHARS_PER_TOKEN if options.chars_per_token is None
                             else options.chars_per_token)
        if options.chars_per_token is None and not is_manifest(Path(path)):  # a manifest's rows count their text
            notes.append(f"no tokenizer.json beside model {model.name}: text is counted at {DEFAULT_CHARS_PER_TOKEN:g} "
                         f"characters per token (give a tokenizer or the characters per token to change it)")
    image_folder = None
    if options.image_folder:
        problem = path_problem(options.image_folder, folder=True)
        if problem is not None:
            raise MpipeError(f"image folder {shown_path(options.image_folder)} is {problem}, not a folder; give the "
                             f"folder a conversation file's image paths start from", quantities=("image folder",))
        image_folder = str(Path(options.image_folder).resolve())
    problem = path_problem(path)
    if problem is not None:
        raise MpipeError(f"dataset {shown_path(path)} is {problem}, not a file; give a LLaVA/ShareGPT .json/.jsonl or "
                         f"a .csv/.parquet/.jsonl manifest", quantities=("workload",))
    return DatasetSpec(str(Path(path).resolve()), image_rule, text_rule, options.seq_len, image_folder), notes


def load_dataset(path: str, model_spec: str, model: Model, options: DatasetOptions) -> tuple[Dataset, list[str]]:
    """The dataset read for ``model`` (see :func:`dataset_spec`), and the notes."""
    spec, notes = dataset_spec(path, model_spec, model, options)
    return read_dataset(spec), notes


def load_dataset_workload(path: str, model_spec: str, model: Model, options: DatasetOptions, *,
                          num_microbatches: int, seed: int) -> tuple[Workload, list[str]]:
    """One step of ``num_microbatches`` sequences drawn from the dataset with ``seed`` (``predict``)."""
    dataset, notes = load_dataset(path, model_spec, model, options)
    return dataset.workload(num_microbatches, seed), notes
