"""What a dataset workload is read from, and its records: the rules that turn pixels and characters into
tokens (:class:`ImageRule`, :class:`TextRule`), the :class:`DatasetSpec` that names a dataset and how to
read it, and the :class:`Records` a reader returns.

Below both :mod:`mpipe_tune.inputs._dataset` (the draw of a step) and
:mod:`mpipe_tune.inputs._dataset_readers` (the file formats), which import it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs._workload import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PATCH_MERGE_PX

DEFAULT_CHARS_PER_TOKEN = 4.0
"""Characters per text token when no tokenizer is given: the usual figure for English BPE vocabularies."""
MAX_SEQ_LEN = 1 << 22


# ------------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class ImageRule:
    """How an image of ``height x width`` pixels becomes backbone tokens, as the model's processor resizes it.

    ``dynamic`` is Qwen2-VL's rule (:func:`~mpipe_tune.inputs._workload.image_tokens_for`), and Qwen2.5-VL's,
    Qwen3-VL's and GLM-4.1V's with their own sizes: sides rounded to multiples of ``factor_px`` (patch side x
    merge side: 28 for 14 px patches merged 2x2, 32 for Qwen3-VL's 16 px), the area kept within
    ``[min_pixels, max_pixels]``. ``fixed`` is CLIP's and SigLIP's: every image is resized to one square tile
    of ``tile_tokens`` tokens. ``tiles`` is InternVL's dynamic tiling: the image is resized to the grid of
    ``tile_px`` tiles (at most ``max_tiles``) whose aspect ratio is closest to its own, and a grid of more
    than one tile adds a thumbnail tile; every tile is ``tile_tokens`` tokens.

    >>> ImageRule.dynamic().tokens(np.array([448, 28]), np.array([448, 28])).tolist()
    [256, 4]
    >>> ImageRule.fixed(576).tokens(np.array([1080]), np.array([1920])).tolist()
    [576]
    >>> ImageRule.tiled(256, 448, 12).tokens(np.array([448, 1080, 100]), np.array([448, 1920, 1000])).tolist()
    [256, 2304, 2816]
    """

    kind: str
    factor_px: int = PATCH_MERGE_PX
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    tile_tokens: int = 0
    tile_px: int = 0
    max_tiles: int = 0

    @classmethod
    def dynamic(cls, factor_px: int = PATCH_MERGE_PX, min_pixels: int = DEFAULT_MIN_PIXELS,
                max_pixels: int = DEFAULT_MAX_PIXELS) -> "ImageRule":
        if not (factor_px >= 1 and 0 < min_pixels <= max_pixels):
            raise MpipeError(f"image resize rule: factor {factor_px} px, min_pixels {min_pixels}, max_pixels "
                             f"{max_pixels}: 1 <= factor and 0 < min_pixels <= max_pixels must hold; fix the "
                             f"model's preprocessor_config.json")
        return cls("dynamic", factor_px, min_pixels, max_pixels)

    @classmethod
    def fixed(cls, tile_tokens: int) -> "ImageRule":
        assert tile_tokens >= 1, tile_tokens
        return cls("fixed", tile_tokens=tile_tokens)

    @classmethod
    def tiled(cls, tile_tokens: int, tile_px: int, max_tiles: int) -> "ImageRule":
        if not (tile_tokens >= 1 and tile_px >= 1 and max_tiles >= 1):
            raise MpipeError(f"image tiling rule: {max_tiles} tiles of {tile_px} px, {tile_tokens} tokens each: all "
                             f"must be positive; fix the model's preprocessor_config.json (max_patches)")
        return cls("tiles", tile_tokens=tile_tokens, tile_px=tile_px, max_tiles=max_tiles)

    def describe(self) -> str:
        if self.kind == "tiles":
            return (f"up to {self.max_tiles} tiles of {self.tile_px} px by aspect ratio, and a thumbnail tile, "
                    f"{self.tile_tokens} tokens a tile")
        if self.kind == "fixed":
            return f"one fixed tile of {self.tile_tokens} tokens per image"
        return (f"resized to multiples of {self.factor_px} px within {self.min_pixels}..{self.max_pixels} pixels, "
                f"one token per {self.factor_px}x{self.factor_px} px")

    def tokens(self, heights_px: np.ndarray, widths_px: np.ndarray) -> np.ndarray:
        """Tokens of each image (int64), vectorised; one line naming the first image that is no real size."""
        h0 = np.asarray(heights_px, dtype=np.float64)
        w0 = np.asarray(widths_px, dtype=np.float64)
        small, large = np.minimum(h0, w0), np.maximum(h0, w0)
        bad = ~(small >= 1) | (large > 200 * small)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise MpipeError(f"image {i} is {h0[i]:g}x{w0[i]:g} px: sides must be >= 1 px with aspect ratio <= 200; "
                             f"give real image sizes")
        if self.kind == "fixed":
            return np.full(h0.shape, self.tile_tokens, dtype=np.int64)
        if self.kind == "tiles":
            return self._tiles(h0, w0) * self.tile_tokens
        f = float(self.factor_px)
        h = np.maximum(f, np.round(h0 / f) * f)
        w = np.maximum(f, np.round(w0 / f) * f)
        area = h * w
        too_large, too_small = area > self.max_pixels, area < self.min_pixels
        down = np.sqrt(h0 * w0 / self.max_pixels)
        up = np.sqrt(self.min_pixels / (h0 * w0))
        h = np.where(too_large, np.maximum(f, np.floor(h0 / down / f) * f),
                     np.where(too_small, np.ceil(h0 * up / f) * f, h))
        w = np.where(too_large, np.maximum(f, np.floor(w0 / down / f) * f),
                     np.where(too_small, np.ceil(w0 * up / f) * f, w))
        return ((h // f) * (w // f)).astype(np.int64)

    def _tiles(self, h0: np.ndarray, w0: np.ndarray) -> np.ndarray:
        """Tiles of each image, its thumbnail included: InternVL's ``dynamic_preprocess`` picks, among the grids
        of ``i x j <= max_tiles`` tiles in order of size, the one whose ``i / j`` is closest to the image's width
        over height, a later grid of equal distance winning while the image's area exceeds half the grid's."""
        grids = sorted({(i, j) for n in range(1, self.max_tiles + 1) for i in range(1, n + 1)
                        for j in range(1, n + 1) if i * j <= self.max_tiles}, key=lambda g: g[0] * g[1])
        aspect, area = w0 / h0, w0 * h0
        best_diff = np.full(h0.shape, np.inf)
        best = np.ones(h0.shape, dtype=np.int64)
        for i, j in grids:
            diff = np.abs(aspect - i / j)
            take = (diff < best_diff) | ((diff == best_diff) & (area > 0.5 * self.tile_px ** 2 * i * j))
            best = np.where(take, i * j, best)
            best_diff = np.where(diff < best_diff, diff, best_diff)
        return best + (best > 1)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "factor_px": self.factor_px, "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels, "tile_tokens": self.tile_tokens, "tile_px": self.tile_px,
                "max_tiles": self.max_tiles}


def image_rule_from_dims(patch_embed: Mapping[str, Any] | None, preprocessor: Mapping[str, Any] | None) -> ImageRule:
    """The model's rule from its patch embedding's dimensions (``patch_size``, ``merge_factor``,
    ``positions``, and the processor's ``min_pixels``, ``max_pixels`` or ``max_tiles`` the Hugging Face reader
    gives it) and its folder's ``preprocessor_config.json``, which overrides them. ``max_tiles`` means InternVL's
    tiles of the position table's square; a position table without min/max pixels (CLIP, SigLIP, Gemma 3) one
    fixed tile; min/max pixels or no position table a dynamic resolution (Qwen2-VL's sizes where none are given).
    No patch embedding (a model of explicit costs) gets Qwen2-VL's rule, as the named mixes do.

    >>> image_rule_from_dims({"patch_size": 14, "merge_factor": 1, "positions": 577}, None).tile_tokens
    576
    >>> image_rule_from_dims({"patch_size": 14, "merge_factor": 4, "positions": 0}, {"max_pixels": 50176}).max_pixels
    50176
    >>> image_rule_from_dims({"patch_size": 16, "merge_factor": 4, "positions": 2304, "min_pixels": 65536,
    ...                       "max_pixels": 16777216}, None).factor_px
    32
    """
    dims = dict(patch_embed or {})
    pre = dict(preprocessor or {})
    if dims.get("max_tiles"):
        side = math.isqrt(int(dims["positions"]))  # InternViT's class token adds one position beyond the square
        tiles = pre.get("max_patches", dims["max_tiles"])
        if not isinstance(tiles, int) or isinstance(tiles, bool):
            raise MpipeError(f"preprocessor_config.json: max_patches {tiles!r} must be an integer; fix the file")
        return ImageRule.tiled(max(1, side * side // int(dims.get("merge_factor", 1))),
                               side * int(dims["patch_size"]), tiles)
    if dims.get("positions", 0) and dims.get("min_pixels") is None:
        side = math.isqrt(int(dims["positions"]))  # a class token adds one position beyond the square
        return ImageRule.fixed(max(1, side * side // int(dims.get("merge_factor", 1))))
    factor = PATCH_MERGE_PX
    if patch_embed is not None:
        factor = int(patch_embed["patch_size"]) * math.isqrt(int(patch_embed.get("merge_factor", 1)))
    size = pre.get("size") if isinstance(pre.get("size"), Mapping) else {}
    low = pre.get("min_pixels", size.get("shortest_edge", dims.get("min_pixels") or DEFAULT_MIN_PIXELS))
    high = pre.get("max_pixels", size.get("longest_edge", dims.get("max_pixels") or DEFAULT_MAX_PIXELS))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        raise MpipeError(f"preprocessor_config.json: min_pixels {low!r} and max_pixels {high!r} must be integers; "
                         f"fix the file")
    return ImageRule.dynamic(factor, low, high)


@dataclass(frozen=True)
class TextRule:
    """How text becomes tokens: a ``tokenizer.json`` (the ``tokenizers`` library, offline) or a stated
    number of characters per token."""

    tokenizer_path: str | None = None
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN

    def __post_init__(self) -> None:
        if not (math.isfinite(self.chars_per_token) and 0.5 <= self.chars_per_token <= 100):
            raise MpipeError(f"characters per token {self.chars_per_token!r}: must be a number from 0.5 to 100; "
                             f"give the tokenizer's average (about 4 for English BPE vocabularies)",
                             quantities=("characters per token",))

    def describe(self) -> str:
        if self.tokenizer_path:
            return f"tokenizer {self.tokenizer_path}"
        return f"{self.chars_per_token:g} characters per token (no tokenizer.json)"

    def count(self, texts: list[str]) -> np.ndarray:
        """Tokens of each text (int64)."""
        if not self.tokenizer_path:
            return np.ceil(np.array([len(t) for t in texts], dtype=np.float64) / self.chars_per_token).astype(np.int64)
        tokenizer = _tokenizer(self.tokenizer_path)
        counts = np.empty(len(texts), dtype=np.int64)
        for start in range(0, len(texts), 4096):
            batch = tokenizer.encode_batch(texts[start:start + 4096], add_special_tokens=False)
            counts[start:start + len(batch)] = [len(e.ids) for e in batch]
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer_path, "chars_per_token": self.chars_per_token}


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises a bare Exception for a file it cannot read
        raise MpipeError(f"tokenizer {path} cannot be read ({str(exc).splitlines()[0][:120]}); give a "
                         f"Hugging Face tokenizer.json, or leave it out and state the characters per token",
                         quantities=("tokenizer", "characters per token")) from None


# ---------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Records:
    """Every record's text tokens and the tokens of its images (CSR: record ``r``'s images are
    ``image_tokens[image_offsets[r]:image_offsets[r + 1]]``)."""

    text_tokens: np.ndarray
    image_offsets: np.ndarray
    image_tokens: np.ndarray

    def __post_init__(self) -> None:
        assert len(self.image_offsets) == len(self.text_tokens) + 1 and self.image_offsets[-1] == len(self.image_tokens)

    def __len__(self) -> int:
        return len(self.text_tokens)

    @classmethod
    def from_counts(cls, text_tokens: np.ndarray, images_per_record: np.ndarray,
                    image_tokens: np.ndarray) -> "Records":
        """From per-record image counts and the flat per-image tokens, in record order."""
        offsets = np.zeros(len(text_tokens) + 1, dtype=np.int64)
        np.cumsum(images_per_record, out=offsets[1:])
        return cls(np.asarray(text_tokens, dtype=np.int64), offsets, np.asarray(image_tokens, dtype=np.int64))

    @property
    def images_per_record(self) -> np.ndarray:
        return np.diff(self.image_offsets)

    @property
    def image_tokens_per_record(self) -> np.ndarray:
        sums = np.concatenate(([0], np.cumsum(self.image_tokens)))
        return sums[self.image_offsets[1:]] - sums[self.image_offsets[:-1]]


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset workload is read from and how: enough to read it again (a plan's later steps)."""

    path: str
    """The dataset file, absolute."""
    image_rule: ImageRule
    text_rule: TextRule
    seq_len: int | None = None
    """Packing length in tokens (None: one record per sequence)."""
    image_folder: str | None = None
    """Where a conversation file's relative image paths start (None: the file's own folder)."""

    def __post_init__(self) -> None:
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not 1 <= self.seq_len <= MAX_SEQ_LEN):
            raise MpipeError(f"packing length {self.seq_len!r}: must be an integer from 1 to {MAX_SEQ_LEN} tokens; "
                             f"give the trainer's sequence length", quantities=("packing length",))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "image_rule": self.image_rule.to_dict(), "text_rule": self.text_rule.to_dict(),
                "seq_len": self.seq_len, "image_folder": self.image_folder}

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> "DatasetSpec":
        try:
            rule, text = data["image_rule"], data["text_rule"]
            assert set(data) == {"path", "image_rule", "text_rule", "seq_len", "image_folder"}
            assert isinstance(data["path"], str) and rule["kind"] in ("dynamic", "fixed", "tiles")
            image_rule = ImageRule(rule["kind"], int(rule["factor_px"]), int(rule["min_pixels"]),
                                   int(rule["max_pixels"]), int(rule["tile_tokens"]), int(rule.get("tile_px", 0)),
                                   int(rule.get("max_tiles", 0)))
            return cls(data["path"], image_rule, TextRule(text["tokenizer"], float(text["chars_per_token"])),
                       data["seq_len"], data["image_folder"])
        except (KeyError, TypeError, ValueError, AssertionError):
            raise MpipeError(f"{where}: the workload's dataset draw {str(data)[:80]!r} is malformed; the file is "
                             f"damaged or was edited: re-create it") from None
