"""Reading a dataset's records: LLaVA/ShareGPT conversation files and manifest tables.

**Conversation files** (``.json``: a list of records; ``.jsonl``: one record a line), the format
LLaVA, LLaMA-Factory and MindSpeed-MM train from. A record's images are ``image`` (a path or a list)
or ``images`` (a list), relative to the image folder (default: the file's own folder); each image's
size is read from its file's header (Pillow opens lazily: no pixel is decoded). Its text is every
turn of ``conversations`` (``{"from", "value"}``) or ``messages`` (``{"role", "content"}``, the content
a string or a list of ``{"type": "text", "text"}`` parts), ``<image>`` placeholders removed.

**Manifests** (``.csv``, ``.parquet``, or ``.jsonl`` whose records have ``text_tokens``): one row a
record, columns ``text_tokens`` (required), ``num_images`` (optional: without it a row has one image
when its image columns are set), and the size of each of the row's images, either ``image_tokens``
(backbone tokens per image) or ``image_width`` and ``image_height`` (pixels, resized with the model's
rule). Read column-wise with pandas/pyarrow, a million rows in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import parse_json, path_problem, read_text, shown, shown_path
from mpipe_tune.inputs._dataset_spec import DatasetSpec, Records
from mpipe_tune.inputs._workload import MAX_IMAGES_PER_RECORD, MAX_TOKENS

MANIFEST_SUFFIXES = (".csv", ".parquet", ".pq")
CONVERSATION_SUFFIXES = (".json", ".jsonl")
_CHUNK_ROWS = 250_000
MAX_IMAGES = 1 << 26
"""The most images a dataset may hold in all (67,108,864): its per-image token array stays within 512 MiB."""
MAX_SIDE_PX = 2**31 - 1
"""The largest image side a header or a manifest may give: PNG's limit, beyond any camera."""
_BOUNDS = {"text_tokens": MAX_TOKENS, "image_tokens": MAX_TOKENS, "num_images": MAX_IMAGES_PER_RECORD,
           "image_width": MAX_SIDE_PX, "image_height": MAX_SIDE_PX}
"""Each manifest column's largest value."""


def read_records(spec: DatasetSpec, *, progress: bool) -> tuple[str, Records]:
    """(kind, records) of the dataset ``spec`` names: ``conversations`` or ``manifest``."""
    path = Path(spec.path)
    problem = path_problem(path)
    if problem is not None:
        raise MpipeError(f"dataset {shown_path(path)} is {problem}, not a file; give a LLaVA/ShareGPT .json/.jsonl "
                         f"or a .csv/.parquet/.jsonl manifest")
    suffix = path.suffix.lower()
    if is_manifest(path):
        return "manifest", _read_manifest(path, spec, progress)
    if suffix in CONVERSATION_SUFFIXES:
        return "conversations", _read_conversations(path, spec, progress)
    raise MpipeError(f"dataset {path}: unknown suffix {path.suffix!r}; give a .json/.jsonl conversation file or a "
                     f".csv/.parquet/.jsonl manifest")


def is_manifest(path: Path) -> bool:
    """Whether the dataset at ``path`` is a manifest (rows of token counts) rather than a conversation file: a CSV or
    Parquet table, or a ``.jsonl`` file whose first record has ``text_tokens``."""
    suffix = path.suffix.lower()
    return suffix in MANIFEST_SUFFIXES or (suffix == ".jsonl" and path.is_file() and _first_line_has(path, "text_tokens"))


def _first_line_has(path: Path, key: str) -> bool:
    first = _first_record(path)
    return isinstance(first, list) and key in dict(first)


def _first_record(path: Path) -> list[tuple[str, Any]] | None:
    """The key-value pairs of a ``.jsonl`` file's first record, duplicates kept (None: not a JSON object)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    pairs = json.loads(line, object_pairs_hook=list)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    return None
                return pairs if isinstance(pairs, list) and all(isinstance(p, tuple) for p in pairs) else None
    return None


def _bar(progress: bool, **kwargs):
    from tqdm import tqdm

    # disable=None: drawn on a terminal only, so that logs and pipes stay clean
    return tqdm(disable=None if progress else True, leave=False, **kwargs)


# ------------------------------------------------------------------------------------ manifests


def _read_manifest(path: Path, spec: DatasetSpec, progress: bool) -> Records:
    import pandas as pd

    suffix = path.suffix.lower()
    wanted = ("text_tokens", "num_images", "image_tokens", "image_width", "image_height")
    frames = []
    try:
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            file = pq.ParquetFile(path)
            _check_unique(path, file.schema_arrow.names)
            columns = [c for c in wanted if c in file.schema_arrow.names]
            _check_columns(path, columns, file.schema_arrow.names)
            with _bar(progress, total=file.metadata.num_rows, unit="rows", desc=path.name) as bar:
                for batch in file.iter_batches(batch_size=_CHUNK_ROWS, columns=columns):
                    frames.append(batch.to_pandas())
                    bar.update(batch.num_rows)
        else:
            if suffix == ".csv":
                header = _csv_header(path)
                _check_unique(path, header)
                _check_columns(path, [c for c in wanted if c in header], header)
                chunks = pd.read_csv(path, usecols=[c for c in wanted if c in header], chunksize=_CHUNK_ROWS)
            else:
                _check_unique(path, [key for key, _ in _first_record(path) or []])
                chunks = pd.read_json(path, lines=True, chunksize=_CHUNK_ROWS)
            with _bar(progress, unit="rows", desc=path.name) as bar:
                for chunk in chunks:
                    frames.append(chunk)
                    bar.update(len(chunk))
    except MpipeError:
        raise
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise MpipeError(f"manifest {path} cannot be read ({str(exc).splitlines()[0][:120]}); give a CSV, Parquet or "
                         f"JSONL table with columns text_tokens and image_tokens or image_width/image_height") from None
    except Exception as exc:  # pyarrow's and pandas' parser errors share no base class beyond Exception
        if type(exc).__module__.split(".")[0] not in ("pyarrow", "pandas"):
            raise
        raise MpipeError(f"manifest {path} cannot be read ({str(exc).splitlines()[0][:120]}); fix the file") from None
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["text_tokens"])
    _check_columns(path, [c for c in wanted if c in table.columns], list(table.columns))
    return _manifest_records(path, table, spec)


def _csv_header(path: Path) -> list[str]:
    """A CSV file's column names as written (pandas would rename a repeated one ``name.1``)."""
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        return next(csv.reader(f), [])


def _check_unique(path: Path, header: list[str]) -> None:
    repeated = sorted({str(c) for c in header if header.count(c) > 1})
    if repeated:
        raise MpipeError(f"manifest {path}: column {shown(repeated[0])} appears more than once; give each column "
                         f"once (which of them holds the counts is not for a reader to guess)")


def _check_columns(path: Path, present: list[str], header: list[str]) -> None:
    sides = [c for c in ("image_width", "image_height") if c in present]
    if "image_tokens" not in present and len(sides) == 1:
        other = "image_height" if sides == ["image_width"] else "image_width"
        raise MpipeError(f"manifest {path}: it has {sides[0]} but no {other}; give both sides in pixels, or each "
                         f"image's image_tokens")
    has_size = "image_tokens" in present or len(sides) == 2
    if "text_tokens" not in present or (("num_images" in present) and not has_size):
        names = ", ".join(shown_path(c, 30) for c in header[:8]) + (f", ... ({len(header)} columns)" if len(header) > 8 else "")
        raise MpipeError(f"manifest {path}: columns [{names}] lack "
                         f"{'text_tokens' if 'text_tokens' not in present else 'the image sizes'}; a manifest has "
                         f"text_tokens, optionally num_images, and image_tokens or image_width and image_height")


def _column(path: Path, table, name: str, *, allow_missing: bool) -> np.ndarray:
    """Column ``name`` as float64 (NaN where empty, when ``allow_missing``), checked to hold integers >= 0."""
    import pandas as pd

    values = pd.to_numeric(table[name], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    raw = table[name].to_numpy()
    bad = ~np.isfinite(values) & (~pd.isna(raw) | (not allow_missing))
    bad |= np.isfinite(values) & ((values < 0) | (values != np.floor(values)) | (values > _BOUNDS[name]))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        value = raw[row].item() if isinstance(raw[row], np.generic) else raw[row]  # -3, not np.int64(-3)
        raise MpipeError(f"manifest {path}: row {row} column {name} = {shown(value)}: must be an integer from 0 to "
                         f"{_BOUNDS[name]}; fix the row")
    return values


def _manifest_records(path: Path, table, spec: DatasetSpec) -> Records:
    text = _column(path, table, "text_tokens", allow_missing=False).astype(np.int64)
    if "image_tokens" in table.columns:
        per_image = _column(path, table, "image_tokens", allow_missing=True)
        has_size = np.isfinite(per_image) & (per_image > 0)
        sized = lambda rows: per_image[rows].astype(np.int64)  # noqa: E731
    elif "image_width" in table.columns:
        widths = _column(path, table, "image_width", allow_missing=True)
        heights = _column(path, table, "image_height", allow_missing=True)
        has_size = np.isfinite(widths) & np.isfinite(heights) & (widths > 0) & (heights > 0)
        sized = lambda rows: spec.image_rule.tokens(heights[rows], widths[rows])  # noqa: E731
    else:
        return Records.from_counts(text, np.zeros(len(text), dtype=np.int64), np.zeros(0, dtype=np.int64))
    if "num_images" in table.columns:
        counts = _column(path, table, "num_images", allow_missing=False).astype(np.int64)
        unsized = (counts > 0) & ~has_size
        if unsized.any():
            row = int(np.flatnonzero(unsized)[0])
            raise MpipeError(f"manifest {path}: row {row} has {counts[row]} images but no image size; give its "
                             f"image_tokens (or image_width and image_height), or num_images 0")
    else:
        counts = has_size.astype(np.int64)
    _check_image_total(path, int(counts.sum()))
    rows = np.flatnonzero(counts > 0)
    tokens = np.zeros(len(text), dtype=np.int64)
    tokens[rows] = sized(rows)
    return Records.from_counts(text, counts, np.repeat(tokens, counts))


# --------------------------------------------------------------------------- conversation files


def _check_image_total(path: Path, total: int) -> None:
    if total > MAX_IMAGES:
        raise MpipeError(f"dataset {path} holds {total} images, more than the {MAX_IMAGES} a dataset may have; plan "
                         f"with a sample of it (the draw of a step reads a few thousand records)")


def _read_conversations(path: Path, spec: DatasetSpec, progress: bool) -> Records:
    text = read_text(path, "dataset")
    where = f"dataset {path}"
    if path.suffix.lower() == ".jsonl":
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                entries.append(parse_json(line, f"{where}: line {number}", "record"))
    else:
        entries = parse_json(text, where, "dataset")
        if not isinstance(entries, list):
            raise MpipeError(f"{where}: the top level must be a list of records (LLaVA/ShareGPT format), got "
                             f"{type(entries).__name__}; give a list of {{'image': ..., 'conversations': [...]}}")
    folder = Path(spec.image_folder) if spec.image_folder else path.parent
    problem = path_problem(folder, folder=True)
    if problem is not None:
        raise MpipeError(f"{where}: image folder {shown_path(folder)} is {problem}, not a folder; give the folder "
                         f"the image paths start from", quantities=("image folder",))
    texts: list[str] = []
    image_paths: list[list[str]] = []
    for index, entry in enumerate(entries):
        at = f"{where}: record {index}"
        if not isinstance(entry, dict):
            raise MpipeError(f"{at} is {type(entry).__name__}, not a mapping; write {{'image': ..., "
                             f"'conversations': [...]}}")
        texts.append(_record_text(entry, at))
        image_paths.append(_record_images(entry, at))
    sizes = _image_sizes(folder, image_paths, where, progress)
    counts = np.array([len(p) for p in image_paths], dtype=np.int64)
    _check_image_total(path, int(counts.sum()))
    flat = [sizes[p] for paths in image_paths for p in paths]
    heights = np.array([h for h, _ in flat], dtype=np.int64)
    widths = np.array([w for _, w in flat], dtype=np.int64)
    image_tokens = spec.image_rule.tokens(heights, widths) if flat else np.zeros(0, dtype=np.int64)
    text_tokens = spec.text_rule.count(texts)
    for name, values in (("text", text_tokens), ("image", Records.from_counts(text_tokens, counts, image_tokens)
                                                  .image_tokens_per_record)):
        if len(values) and values.max() > MAX_TOKENS:
            index = int(values.argmax())
            raise MpipeError(f"{where}: record {index} holds {int(values[index])} {name} tokens, more than the "
                             f"{MAX_TOKENS} a record may have; split or drop the record")
    return Records.from_counts(text_tokens, counts, image_tokens)


def _record_text(entry: dict[str, Any], at: str) -> str:
    turns = entry.get("conversations", entry.get("messages"))
    if not isinstance(turns, list):
        raise MpipeError(f"{at} has no 'conversations' or 'messages' list; give each record its turns")
    parts = []
    for number, turn in enumerate(turns):
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image"}]
            content = "\n".join(_part_text(p, f"{at} turn {number}") for p in content
                                if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise MpipeError(f"{at} turn {number}: {shown(turn)} has no text 'value' or 'content'; write "
                             f"{{'from': 'human', 'value': '...'}}")
        parts.append(content.replace("<image>", "").strip())
    return "\n".join(parts)


def _part_text(part: dict[str, Any], at: str) -> str:
    text = part.get("text", "")
    if not isinstance(text, str):
        raise MpipeError(f"{at}: text part {shown(part)} has text that is {type(text).__name__}, not a string; write "
                         f"{{'type': 'text', 'text': '...'}}")
    return text


def _record_images(entry: dict[str, Any], at: str) -> list[str]:
    images = entry.get("image", entry.get("images", []))
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise MpipeError(f"{at}: images {shown(images)} must be a path or a list of paths; fix the record")
    if len(images) > MAX_IMAGES_PER_RECORD:
        raise MpipeError(f"{at}: it lists {len(images)} images, more than the {MAX_IMAGES_PER_RECORD} a record may "
                         f"have; split the record")
    return images


def _image_sizes(folder: Path, image_paths: list[list[str]], where: str, progress: bool) -> dict[str, tuple[int, int]]:
    """(height, width) of every image named, read from its header (each file opened once)."""
    unique = list(dict.fromkeys(p for paths in image_paths for p in paths))
    sizes = {}
    with _bar(progress, total=len(unique), unit="images", desc="image headers") as bar:
        for name in unique:
            file = folder / name
            problem = path_problem(file)
            if problem == "missing":
                raise MpipeError(f"{where}: image {shown_path(name)} is not in {shown_path(folder)}; give the image "
                                 f"folder the image paths start from", quantities=("image folder",))
            if problem is not None:
                raise MpipeError(f"{where}: image {shown_path(file)} is {problem}, not an image file; fix or drop "
                                 f"the record")
            sizes[name] = _header_size(file, where)
            bar.update(1)
    return sizes


def _header_size(file: Path, where: str) -> tuple[int, int]:
    """(height, width) from an image file's header. Pillow's decompression-bomb guard is off while it reads:
    no pixel is decoded, and the model's resize rule plans an image of any size."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    guard = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file) as image:  # lazy: reads the header, decodes no pixel
                width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:  # a damaged header: any of these
        raise MpipeError(f"{where}: image {shown_path(file)} cannot be read as an image "
                         f"({shown_path(exc, 100)}); fix or drop the record") from None
    finally:
        Image.MAX_IMAGE_PIXELS = guard
    return height, width
