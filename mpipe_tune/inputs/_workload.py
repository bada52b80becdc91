"""Workloads: the per-microbatch token counts that a step's event durations scale with.

A microbatch carries ``image_tokens`` (the tokens its images become after the encoder's merge, the
image stream) and ``text_tokens`` (the backbone's sequence length, the text stream; image tokens that
are spliced into the sequence count here too). ``images`` optionally lists the tokens of each image,
so that encoder attention can be charged per image.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import yaml

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_data_file, shown

_MISSING = object()
MAX_IMAGES_PER_RECORD = 1 << 14
"""The most images one microbatch or one dataset record may hold (16,384: a long video's frames)."""
MAX_TOKENS = 1 << 24
"""The most text tokens, and the most image tokens, one microbatch or one dataset record may hold (16,777,216):
far above any trained context, small enough that a step's prediction stays in range."""


@dataclass(frozen=True)
class Microbatch:
    """Token counts of one microbatch."""

    image_tokens: int
    """Image-stream tokens (after the encoder's spatial merge); encoder layers scale with these."""
    text_tokens: int
    """Backbone sequence length; every non-encoder layer scales with these."""
    images: tuple[int, ...] = field(default=())
    """Tokens of each image; empty means one image of ``image_tokens`` (or none when that is 0)."""
    texts: tuple[int, ...] = field(default=())
    """Tokens of each text sequence a trainer's micro batch of several sequences holds side by side (each attends
    only to itself, summing to ``text_tokens``); empty means one sequence of ``text_tokens``."""

    def text_sizes(self) -> tuple[int, ...]:
        """Tokens per text sequence (one of ``text_tokens`` unless :attr:`texts` lists them)."""
        return self.texts or (self.text_tokens,)

    def image_sizes(self) -> tuple[int, ...]:
        """Tokens per image, never empty when ``image_tokens > 0``."""
        if self.images:
            return self.images
        return (self.image_tokens,) if self.image_tokens > 0 else ()


@dataclass(frozen=True)
class MixDraw:
    """How a sampled workload was drawn from a named mix, so that later steps can be drawn alike.

    Step ``k`` of the draw is ``num_microbatches * sequences_per_microbatch`` sequences of ``mix``
    drawn with seed ``seed + k`` (:func:`sample_workload`), packed ``sequences_per_microbatch`` to a
    microbatch (:func:`pack`): step 0 is the workload itself, and step ``k`` is the planner's sampled
    step ``k`` of the same problem when the workload is its sample 0. A data loader knows these
    token counts before the step runs, so every rank draws the same ones.

    >>> draw = MixDraw("smoke", seed=3)
    >>> draw.step(0, 4) == sample_workload("smoke", 4, 3)
    True
    >>> draw.step(1, 4).name
    'smoke@seed4'
    """

    mix: str
    seed: int
    sequences_per_microbatch: int = 1

    def step(self, step: int, num_microbatches: int) -> Workload:
        """Step ``step``'s microbatches (see the class docstring)."""
        s = self.sequences_per_microbatch
        drawn = sample_workload(self.mix, num_microbatches * s, self.seed + step)
        if s == 1:
            return drawn
        sequences = drawn.microbatches
        packed = tuple(pack(sequences[i * s:(i + 1) * s]) for i in range(num_microbatches))
        return Workload(packed, f"{drawn.name}/{s}-per-microbatch", replace(self, seed=self.seed + step))

    def to_dict(self) -> dict[str, Any]:
        return {"mix": self.mix, "seed": self.seed, "sequences_per_microbatch": self.sequences_per_microbatch}

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> "MixDraw":
        """The stored form back, or one line naming what is wrong."""
        ok = (isinstance(data, Mapping) and set(data) == {"mix", "seed", "sequences_per_microbatch"}
              and data["mix"] in MIXES
              and all(isinstance(data[k], int) and not isinstance(data[k], bool) for k in ("seed", "sequences_per_microbatch"))
              and 0 <= data["seed"] < 2**63 and data["sequences_per_microbatch"] >= 1)
        if not ok:
            raise MpipeError(f"{where}: the workload's draw {data!r} must be {{'mix': one of {', '.join(MIXES)}, "
                             f"'seed': an integer >= 0, 'sequences_per_microbatch': an integer >= 1}}; the file is "
                             f"damaged or was edited: re-create it")
        return cls(data["mix"], data["seed"], data["sequences_per_microbatch"])


@dataclass(frozen=True)
class Workload:
    """An ordered list of microbatches; microbatch ``m`` of a plan reads ``microbatches[m]``."""

    microbatches: tuple[Microbatch, ...]
    name: str = "workload"
    draw: MixDraw | None = field(default=None, compare=False)
    """How it was sampled from a named mix (what draws later steps alike); None for a workload file.
    Not part of the workload's identity: equality and :func:`workload_hash` read the microbatches and
    the name only."""

    def __len__(self) -> int:
        return len(self.microbatches)


def pack(sequences: tuple[Microbatch, ...]) -> Microbatch:
    """One microbatch holding the given sequences back to back (their images and their tokens)."""
    if len(sequences) == 1:
        return sequences[0]
    images = tuple(size for mb in sequences for size in mb.image_sizes())
    return Microbatch(sum(mb.image_tokens for mb in sequences), sum(mb.text_tokens for mb in sequences), images)


# ------------------------------------------------------------------------------- parsing, files

DEFAULT_NUM_MICROBATCHES = 8
_ENTRY_KEYS = ("image_tokens", "text_tokens", "images")


def parse_workload(data: Mapping, *, where: str) -> Workload:
    """Validate the file form and build the workload; ``where`` names it in messages.

    The form is ``{"name": optional str, "microbatches": [{"image_tokens": int >= 0, "text_tokens":
    int >= 1, "images": optional [int >= 1, ...] summing to image_tokens}, ...]}``.
    """

    def fail(path: str, value: Any, must: str, fix: str) -> NoReturn:
        got = "is missing and" if value is _MISSING else f"= {shown(value)}:"
        raise MpipeError(f"{where}: {path} {got} {must}; {fix}")

    def count(path: str, value: Any, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_TOKENS:
            fail(path, value, f"must be an integer from {low} to {MAX_TOKENS}", "write a whole number of tokens")
        return value

    if data is None:  # YAML reads an empty file as null
        raise MpipeError(f"{where}: the file is empty; write `microbatches: [{{image_tokens: ..., text_tokens: ...}}, "
                         f"...]`")
    if not isinstance(data, Mapping):
        fail("<top level>", data, "must be a mapping with a 'microbatches' list",
             "write `microbatches: [{image_tokens: ..., text_tokens: ...}, ...]`")
    for key in data:
        if key not in ("name", "microbatches"):
            fail(str(key), data[key], "is not a workload field", "use only 'name' and 'microbatches'")
    entries = data.get("microbatches", _MISSING)
    if not isinstance(entries, list) or not entries:
        fail("microbatches", entries, "must be a non-empty list", "list one entry per microbatch")
    if len(entries) > MAX_MICROBATCHES:
        raise MpipeError(f"{where}: microbatches lists {len(entries)} entries, more than the {MAX_MICROBATCHES} a "
                         f"workload may have; give at most {MAX_MICROBATCHES}")
    name = data.get("name", Path(where).stem or "workload")
    if not isinstance(name, str) or not name:
        fail("name", name, "must be a non-empty string", "quote it")

    microbatches = []
    for index, entry in enumerate(entries):
        at = f"microbatches[{index}]"
        if not isinstance(entry, Mapping):
            fail(at, entry, "must be a mapping", "write {image_tokens: ..., text_tokens: ...}")
        for key in entry:
            if key not in _ENTRY_KEYS:
                fail(f"{at}.{key}", entry[key], "is not a microbatch field", f"use {', '.join(_ENTRY_KEYS)}")
        for key in _ENTRY_KEYS[:2]:
            if key not in entry:
                fail(f"{at}.{key}", _MISSING, "is required", "add the token count")
        image_tokens = count(f"{at}.image_tokens", entry["image_tokens"], 0)
        text_tokens = count(f"{at}.text_tokens", entry["text_tokens"], 1)
        images = entry.get("images", [])
        if not isinstance(images, list):
            fail(f"{at}.images", images, "must be a list of per-image token counts", "write [256, 1024]")
        images = tuple(count(f"{at}.images[{i}]", x, 1) for i, x in enumerate(images))
        if len(images) > MAX_IMAGES_PER_RECORD:
            fail(f"{at}.images", images, f"must list at most {MAX_IMAGES_PER_RECORD} images", "split the microbatch")
        if images and sum(images) != image_tokens:
            fail(f"{at}.images", list(images), f"must sum to image_tokens = {image_tokens}",
                 "fix the per-image counts or image_tokens")
        microbatches.append(Microbatch(image_tokens, text_tokens, images))
    return Workload(tuple(microbatches), name)


def workload_to_dict(workload: Workload) -> dict[str, Any]:
    """The file form of ``workload`` (``images`` only where given)."""
    entries = []
    for mb in workload.microbatches:
        entry: dict[str, Any] = {"image_tokens": mb.image_tokens, "text_tokens": mb.text_tokens}
        if mb.images:
            entry["images"] = list(mb.images)
        entries.append(entry)
    return {"name": workload.name, "microbatches": entries}


def workload_hash(workload: Workload) -> str:
    """sha256 hex digest of the canonical JSON of the workload (for plan files)."""
    canonical = json.dumps(workload_to_dict(workload), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def dump_workload(workload: Workload, path: str | os.PathLike) -> None:
    """Write ``workload`` as JSON (``.json``) or YAML (``.yaml``/``.yml``), chosen by the suffix."""
    target = Path(path)
    data = workload_to_dict(workload)
    if target.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    elif target.suffix in (".yaml", ".yml"):
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
    else:
        raise MpipeError(f"{target}: unknown workload file suffix {target.suffix!r}; use .json, .yaml or .yml")
    target.write_text(text, encoding="utf-8")


def _read_workload_file(path: Path) -> Workload:
    return parse_workload(load_data_file(path, "workload"), where=str(path))


def load_workload(
    spec: str | os.PathLike, *, num_microbatches: int | None = None, seed: int = 0
) -> Workload:
    """A workload file (YAML or JSON) or a built-in mix name (see :data:`MIXES`), sampled with ``seed``.

    A file fixes the microbatch count: ``num_microbatches``, when given, must equal its length. A mix
    draws ``num_microbatches`` (default :data:`DEFAULT_NUM_MICROBATCHES`) microbatches.
    """
    if num_microbatches is not None:
        validate_num_microbatches(num_microbatches)
    if isinstance(spec, str) and spec in MIXES:
        return sample_workload(spec, num_microbatches or DEFAULT_NUM_MICROBATCHES, seed)
    path = Path(spec)
    looks_like_name = isinstance(spec, str) and not path.suffix and os.sep not in spec and "/" not in spec
    if looks_like_name and not path.exists():
        raise MpipeError(
            f"unknown workload {spec!r}: not a file and not a built-in mix; mixes: {', '.join(MIXES)}; "
            "or give the path of a YAML/JSON workload file"
        )
    workload = _read_workload_file(path)
    if num_microbatches is not None and num_microbatches != len(workload):
        raise MpipeError(
            f"workload {path} has {len(workload)} microbatches but the microbatch count M is {num_microbatches}: "
            f"leave M out to use the file's count, or give a file with {num_microbatches} entries"
        )
    return workload


MAX_MICROBATCHES = 1 << 16
"""The most microbatches a workload may have: far beyond any step, small enough to derive quickly."""


def validate_num_microbatches(num_microbatches: int) -> None:
    """Raises unless ``num_microbatches`` is an integer from 1 to :data:`MAX_MICROBATCHES`: every source of a
    workload (a mix, a file, a dataset) draws at most that many."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise MpipeError(f"microbatch count {num_microbatches!r}: must be an integer >= 1; give a positive count")
    if num_microbatches > MAX_MICROBATCHES:
        raise MpipeError(f"microbatch count {num_microbatches} is above {MAX_MICROBATCHES}, more than any training step "
                         f"pipelines; give a count of at most {MAX_MICROBATCHES}")


# ---------------------------------------------------------------------------------- named mixes

PATCH_MERGE_PX = 28
"""Side of the pixel square that becomes one backbone token in Qwen2-VL (14 px patches, 2x2 merge)."""
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def image_tokens_for(
    height_px: int, width_px: int, *, min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS
) -> int:
    """Backbone tokens of one image after Qwen2-VL's resize (28 px per token side).

    Each side is rounded to a multiple of 28; if the area then falls outside ``[min_pixels,
    max_pixels]``, both sides are scaled by one factor (keeping the aspect ratio) and rounded down
    (too large) or up (too small) to multiples of 28. Tokens are ``(h / 28) * (w / 28)``.

    >>> image_tokens_for(448, 448), image_tokens_for(28, 28), image_tokens_for(896, 1120)
    (256, 4, 1280)
    """
    f = PATCH_MERGE_PX
    if min(height_px, width_px) < 1 or max(height_px, width_px) / min(height_px, width_px) > 200:
        raise MpipeError(
            f"image {height_px}x{width_px} px: sides must be >= 1 px with aspect ratio <= 200; "
            "give a real image size"
        )
    h = max(f, round(height_px / f) * f)
    w = max(f, round(width_px / f) * f)
    if h * w > max_pixels:
        scale = math.sqrt(height_px * width_px / max_pixels)
        h = max(f, math.floor(height_px / scale / f) * f)
        w = max(f, math.floor(width_px / scale / f) * f)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height_px * width_px))
        h = math.ceil(height_px * scale / f) * f
        w = math.ceil(width_px * scale / f) * f
    return (h // f) * (w // f)


@dataclass(frozen=True)
class Mix:
    """A named distribution of image-text samples, packed ``samples_per_microbatch`` to a microbatch.

    Each sample is text-only with probability ``text_only_share``; otherwise it draws an image count
    from ``images_per_sample`` and, per image, a resolution from ``resolutions``, each side scaled by
    an independent factor uniform in ``[1 - jitter, 1 + jitter]``, then resized as Qwen2-VL does
    (:func:`image_tokens_for` with ``min_pixels``/``max_pixels``).
    """

    name: str
    description: str
    text_only_share: float
    """Probability that a sample carries no image, in [0, 1]."""
    images_per_sample: tuple[tuple[int, float], ...]
    """(image count >= 1, probability) choices for a sample that has images; probabilities sum to 1."""
    resolutions: tuple[tuple[int, int, float], ...]
    """(height_px, width_px, probability) choices per image; probabilities sum to 1."""
    samples_per_microbatch: int
    seq_len: int
    """Packed backbone sequence length, tokens: every microbatch's ``text_tokens``. Image tokens are
    spliced into it, so an image that would overflow it is left out (a packer defers that sample)."""
    jitter: float = 0.0
    """Relative spread of each image side around its drawn resolution, in [0, 1)."""
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise MpipeError(f"mix {self.name!r}: {what} must hold; fix the Mix definition")

        check(0.0 <= self.text_only_share <= 1.0, f"0 <= text_only_share <= 1 (got {self.text_only_share})")
        check(0.0 <= self.jitter < 1.0, f"0 <= jitter < 1 (got {self.jitter})")
        check(self.samples_per_microbatch >= 1 and self.seq_len >= 1, "samples_per_microbatch, seq_len >= 1")
        check(0 < self.min_pixels <= self.max_pixels, "0 < min_pixels <= max_pixels")
        check(all(k >= 1 and p >= 0 for k, p in self.images_per_sample), "image counts >= 1, probabilities >= 0")
        check(all(h >= 1 and w >= 1 and p >= 0 for h, w, p in self.resolutions), "sides >= 1, probabilities >= 0")
        for field_name, probs in (
            ("images_per_sample", [p for _, p in self.images_per_sample]),
            ("resolutions", [p for *_, p in self.resolutions]),
        ):
            check(bool(probs) and abs(sum(probs) - 1.0) < 1e-9, f"{field_name} probabilities sum to 1")


_WEB = ((336, 336, 0.3), (448, 448, 0.3), (480, 640, 0.2), (768, 1024, 0.2))
MIXES: dict[str, Mix] = {
    mix.name: mix
    for mix in (
        Mix("text-heavy", "80% text-only samples; the rest one or two small web images",
            text_only_share=0.8, images_per_sample=((1, 0.9), (2, 0.1)), resolutions=_WEB,
            samples_per_microbatch=8, seq_len=4096, jitter=0.2),
        Mix("balanced", "40% text-only; one to three images from web size to full HD",
            text_only_share=0.4, images_per_sample=((1, 0.7), (2, 0.2), (3, 0.1)),
            resolutions=((448, 448, 0.25), (480, 640, 0.25), (768, 1024, 0.25), (1080, 1920, 0.25)),
            samples_per_microbatch=8, seq_len=8192, jitter=0.2),
        Mix("image-heavy", "almost every sample has two to four high-resolution images",
            text_only_share=0.05, images_per_sample=((2, 0.3), (3, 0.3), (4, 0.4)),
            resolutions=((1024, 1024, 0.3), (1080, 1920, 0.3), (1536, 2048, 0.2), (2048, 2048, 0.2)),
            samples_per_microbatch=4, seq_len=16384, jitter=0.1),
        Mix("doc-ocr", "a few large scanned pages (letter/A4 at 150-300 dpi), up to 4096 tokens each",
            text_only_share=0.1, images_per_sample=((1, 1.0),),
            resolutions=((2200, 1700, 0.5), (3508, 2480, 0.3), (1754, 1240, 0.2)),
            samples_per_microbatch=3, seq_len=16384, jitter=0.05, max_pixels=28 * 28 * 4096),
        Mix("uniform-small", "every sample one 448x448 image (256 tokens): identical microbatches",
            text_only_share=0.0, images_per_sample=((1, 1.0),), resolutions=((448, 448, 1.0),),
            samples_per_microbatch=8, seq_len=4096),
        Mix("smoke", "short sequences with zero to two thumbnails (16-64 tokens each), for real runs on a CPU",
            text_only_share=0.3, images_per_sample=((1, 0.7), (2, 0.3)),
            resolutions=((112, 112, 0.4), (168, 224, 0.3), (224, 224, 0.3)),
            samples_per_microbatch=1, seq_len=256, jitter=0.1),
    )
}
"""Built-in mixes by name, ordered from text-heavy to image-heavy by mean image tokens per microbatch
(``doc-ocr``, ``uniform-small`` and ``smoke`` are special shapes rather than points on that scale)."""


def _cdf(probs: Sequence[float]) -> np.ndarray:
    """Normalised cumulative probabilities, as ``numpy.random.Generator.choice`` computes them."""
    cdf = np.asarray(probs, dtype=float).cumsum()
    cdf /= cdf[-1]
    return cdf


def sample_workload(mix: str | Mix, num_microbatches: int, seed: int) -> Workload:
    """Draw ``num_microbatches`` microbatches from ``mix`` with ``numpy.random.default_rng(seed)``.

    Deterministic in (mix, num_microbatches, seed); the first ``k`` microbatches do not depend on
    ``num_microbatches``. Every microbatch has ``text_tokens = mix.seq_len``.
    """
    if isinstance(mix, str):
        if mix not in MIXES:
            raise MpipeError(f"unknown workload mix {mix!r}; mixes: {', '.join(MIXES)}")
        mix = MIXES[mix]
    assert num_microbatches >= 1, num_microbatches
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise MpipeError(f"workload seed {seed!r} must be an integer from 0 to 2**63 - 1; give a non-negative seed")
    rng = np.random.default_rng(seed)
    counts = [k for k, _ in mix.images_per_sample]
    # rng.choice(n, p=probs) draws one rng.random() and looks it up in the normalised cumulative
    # probabilities; doing that here draws the same values at a third of the cost.
    count_cdf = _cdf([p for _, p in mix.images_per_sample])
    res_cdf = _cdf([p for *_, p in mix.resolutions])
    microbatches = []
    for _ in range(num_microbatches):
        images: list[int] = []
        for _ in range(mix.samples_per_microbatch):
            if rng.random() < mix.text_only_share:
                continue
            for _ in range(counts[int(count_cdf.searchsorted(rng.random(), side="right"))]):
                height, width, _p = mix.resolutions[int(res_cdf.searchsorted(rng.random(), side="right"))]
                if mix.jitter:
                    fh, fw = rng.uniform(1 - mix.jitter, 1 + mix.jitter, size=2)
                    height, width = max(1, round(height * fh)), max(1, round(width * fw))
                tokens = image_tokens_for(height, width, min_pixels=mix.min_pixels, max_pixels=mix.max_pixels)
                if sum(images) + tokens <= mix.seq_len:
                    images.append(tokens)
        microbatches.append(Microbatch(sum(images), mix.seq_len, tuple(images)))
    draw = MixDraw(mix.name, seed) if MIXES.get(mix.name) == mix else None
    return Workload(tuple(microbatches), f"{mix.name}@seed{seed}", draw)
