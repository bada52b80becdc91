"""Workloads drawn from a dataset: its records' images and text, sized as the model sees them.

A dataset is a list of *records* (training samples), each a number of text tokens and the backbone
tokens of each of its images. :mod:`mpipe_tune.inputs._dataset_readers` reads them from a
LLaVA/ShareGPT conversation file or a manifest table; the rules that turn pixels and characters into
tokens, the spec and the records are :mod:`mpipe_tune.inputs._dataset_spec`'s; this module holds the
dataset and the draw of a step from it.

**A step from a dataset.** Records are drawn with replacement, ``numpy.random.default_rng(seed)``
picking indices in blocks of :data:`DRAW_BLOCK`, and laid into *sequences* as the trainer packs
them: without a packing length each record is one sequence of ``text + image`` tokens (image tokens
are spliced into the backbone's sequence); with ``seq_len`` records are packed back to back into
sequences of ``seq_len`` tokens (padded: a record that does not fit the open sequence starts the
next one; one longer than ``seq_len`` keeps the images that fit and is truncated). So, as for a named
mix, the first ``k`` sequences of a draw do not depend on how many are drawn, and step ``k`` of a plan
is the draw with seed ``seed + k``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs._dataset_readers import read_records
from mpipe_tune.inputs._dataset_spec import DatasetSpec, Records
from mpipe_tune.inputs._workload import Microbatch, MixDraw, Workload, pack, validate_num_microbatches

DRAW_BLOCK = 256
"""Record indices drawn per call of the generator (a fixed block, so that a draw's prefix is stable)."""
@dataclass(frozen=True)
class Dataset:
    """A dataset's records, read with its spec."""

    spec: DatasetSpec
    records: Records
    kind: str
    """``conversations`` (LLaVA/ShareGPT) or ``manifest``."""

    @property
    def name(self) -> str:
        return Path(self.spec.path).name

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 of the spec and the records: what a search's study is keyed on."""
        digest = hashlib.sha256(json.dumps(self.spec.to_dict(), sort_keys=True).encode())
        for array in (self.records.text_tokens, self.records.image_offsets, self.records.image_tokens):
            digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        return digest.hexdigest()

    def sequences(self, count: int, seed: int) -> tuple[Microbatch, ...]:
        """The first ``count`` sequences of the draw with ``seed`` (see the module docstring)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise MpipeError(f"workload seed {seed!r} must be an integer from 0 to 2**63 - 1; give a non-negative seed")
        rng = np.random.default_rng(seed)
        r = self.records
        n, seq_len = len(r), self.spec.seq_len
        out: list[Microbatch] = []
        images: list[int] = []
        used = 0
        while len(out) < count:
            for index in rng.integers(0, n, size=DRAW_BLOCK).tolist():
                own = r.image_tokens[r.image_offsets[index]:r.image_offsets[index + 1]].tolist()
                text = int(r.text_tokens[index])
                if seq_len is None:
                    out.append(Microbatch(sum(own), max(1, text + sum(own)), tuple(own)))
                else:
                    kept = _fitting(own, seq_len)
                    length = min(seq_len, text + sum(kept))
                    if used and used + length > seq_len:
                        out.append(Microbatch(sum(images), seq_len, tuple(images)))
                        images, used = [], 0
                    images += kept
                    used += max(1, length)
                if len(out) == count:
                    break
        return tuple(out)

    def workload(self, num_microbatches: int, seed: int) -> Workload:
        """``num_microbatches`` sequences of the draw with ``seed``, one per microbatch."""
        return DatasetDraw(self.spec, seed).step(0, num_microbatches, dataset=self)


def _fitting(images: list[int], seq_len: int) -> list[int]:
    """The images of a record that fit ``seq_len`` in order (a larger one is left out, as mixes do)."""
    kept, total = [], 0
    for tokens in images:
        if total + tokens <= seq_len:
            kept.append(tokens)
            total += tokens
    return kept


@dataclass(frozen=True)
class DatasetDraw:
    """How a workload was drawn from a dataset, so that later steps are drawn alike (as
    :class:`~mpipe_tune.inputs._workload.MixDraw` for a named mix): step ``k`` is
    ``num_microbatches * sequences_per_microbatch`` sequences drawn with seed ``seed + k``, packed
    ``sequences_per_microbatch`` to a microbatch."""

    spec: DatasetSpec
    seed: int
    sequences_per_microbatch: int = 1

    @property
    def mix(self) -> str:
        """The source's name, as a mix draw's ``mix`` (messages name it)."""
        return f"dataset {Path(self.spec.path).name}"

    def step(self, step: int, num_microbatches: int, *, dataset: Dataset | None = None) -> Workload:
        """Step ``step``'s microbatches; the dataset is read again from its spec unless given."""
        validate_num_microbatches(num_microbatches)
        dataset = dataset or read_dataset(self.spec)
        s = self.sequences_per_microbatch
        sequences = dataset.sequences(num_microbatches * s, self.seed + step)
        packed = tuple(pack(sequences[i * s:(i + 1) * s]) for i in range(num_microbatches))
        name = f"{dataset.name}@seed{self.seed + step}" + (f"/{s}-per-microbatch" if s > 1 else "")
        return Workload(packed, name, replace(self, seed=self.seed + step))

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.spec.to_dict(), "seed": self.seed, "sequences_per_microbatch": self.sequences_per_microbatch}

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> "DatasetDraw":
        ok = (isinstance(data, Mapping) and set(data) == {"dataset", "seed", "sequences_per_microbatch"}
              and all(isinstance(data[k], int) and not isinstance(data[k], bool) for k in ("seed", "sequences_per_microbatch"))
              and 0 <= data["seed"] < 2**63 and data["sequences_per_microbatch"] >= 1)
        if not ok:
            raise MpipeError(f"{where}: the workload's draw {str(data)[:80]!r} must be {{'dataset': ..., 'seed': an "
                             f"integer >= 0, 'sequences_per_microbatch': an integer >= 1}}; the file is damaged or was "
                             f"edited: re-create it")
        return cls(DatasetSpec.from_dict(data["dataset"], where=where), data["seed"], data["sequences_per_microbatch"])


def read_dataset(spec: DatasetSpec, *, progress: bool = True) -> Dataset:
    """Read the dataset ``spec`` names (cached per spec: a run's steps read it once)."""
    return _read_cached(spec, progress)


@functools.lru_cache(maxsize=2)
def _read_cached(spec: DatasetSpec, progress: bool) -> Dataset:
    kind, records = read_records(spec, progress=progress)
    if not len(records):
        raise MpipeError(f"dataset {spec.path} holds no records; give a dataset with at least one sample")
    return Dataset(spec, records, kind)


def draw_from_dict(data: Any, *, where: str) -> MixDraw | DatasetDraw:
    """A stored draw back: from a dataset (it has ``dataset``) or from a named mix."""
    if isinstance(data, Mapping) and "dataset" in data:
        return DatasetDraw.from_dict(data, where=where)
    return MixDraw.from_dict(data, where=where)
