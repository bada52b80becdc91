"""Reading the files the tool takes (models, workloads, profiles, plans), with one-line errors.

Every loader reads its file through :func:`load_data_file`, so that a path that is not there, a
folder, bytes that are not UTF-8 text, and text that is not JSON or YAML all end the same way: one
:class:`~mpipe_tune.errors.MpipeError` line that names the file, what is wrong and what to give
instead. :func:`check_finite` is the number check the parsers share for fields that must be finite
and within a sane range.

The input types that both the cost model and the runtime read live beside it, below both:
:mod:`mpipe_tune.inputs._workload` (microbatches and workloads) and :mod:`mpipe_tune.inputs._arch_dims`
(architecture kinds and their dimensions).

Its public API is :data:`__all__`: these helpers, and the names of its modules that other packages and users
import (loaded from their modules when first asked for: :data:`_LAZY`). Loading models
(:mod:`._specs`) and dataset workloads (:mod:`._workload_spec`) reads the algebra's model, which reads the
helpers here, so those modules are never imported with the package. Hardware profiles are the cost
model's (``mpipe_tune.cost.load_profile``).

>>> check_finite(2.0e-6, where="model m layer 'vit'", field="fwd_s_per_token", upper=1.0)
2e-06
"""

from __future__ import annotations

import errno
import json
import math
import os
import reprlib
import stat
from pathlib import Path
from typing import Any

from mpipe_tune import lazy_exports
from mpipe_tune.errors import MpipeError

_LAZY = {
    "mpipe_tune.inputs._arch_dims": (
        "ARCH_KINDS", "IMAGE_STREAM_KINDS", "OPTIONAL_DIMS", "resolve_dims", "tensor_parallel_problem",
        "validate_arch",
    ),
    "mpipe_tune.inputs._dataset": ("Dataset", "DatasetDraw", "draw_from_dict", "read_dataset"),
    "mpipe_tune.inputs._dataset_spec": ("DatasetSpec", "ImageRule", "TextRule"),
    "mpipe_tune.inputs._mindspeed": (
        "DECODER_OUTSIDE_KINDS", "VISION_OUTSIDE_KINDS", "MindSpeedLayout", "is_model_json", "read_mindspeed_layout",
    ),
    "mpipe_tune.inputs._specs": ("builtin_models", "load_model", "resolve_spec"),
    "mpipe_tune.inputs._workload": (
        "DEFAULT_NUM_MICROBATCHES", "MAX_MICROBATCHES", "MIXES", "Microbatch", "Mix", "MixDraw", "Workload",
        "load_workload", "pack", "parse_workload", "sample_workload", "workload_hash", "workload_to_dict",
    ),
    "mpipe_tune.inputs._workload_spec": (
        "DatasetOptions", "is_dataset", "load_dataset", "load_dataset_workload", "validate_dataset_options",
    ),
}
__all__ = ["check_finite", "load_data_file", "shown", *(n for names in _LAZY.values() for n in names)]
__getattr__ = lazy_exports(__name__, _LAZY)

JSON_SUFFIXES = (".json",)
YAML_SUFFIXES = (".yaml", ".yml")
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 3, 40, 40, 4, 4


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` bounded in depth, items and length, for an error line: a value read from a file may
    nest a thousand levels deep or hold a million items.

    >>> shown(list(range(100000)))
    '[0, 1, 2, 3, ...] (100000 items)'
    """
    text = repr(value[:limit]) if isinstance(value, str) else _SHOWN.repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    if isinstance(value, (list, tuple, dict)) and len(value) > _SHOWN.maxlist:
        text += f" ({len(value)} items)"
    return text


def shown_path(path: str | Path, limit: int = 120) -> str:
    """A path for an error line: as it is when printable and short, else its repr, cut at ``limit``."""
    text = str(path)
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def path_problem(path: str | Path, *, folder: bool = False) -> str | None:
    """None when ``path`` names a regular file (a folder with ``folder``), symlinks followed; else what it is
    instead, as an error says it (``"missing"``, ``"a folder"``, ``"a FIFO"``...). Nothing is opened: a FIFO
    would block the reader until a writer came."""
    try:
        mode = os.stat(path).st_mode
    except ValueError:  # os.stat's refusal of a NUL byte
        return "a path with a NUL byte"
    except OSError as exc:
        return {errno.ENOENT: "missing", errno.ELOOP: "a symlink loop", errno.ENOTDIR: "missing",
                errno.ENAMETOOLONG: "a name too long"}.get(exc.errno, f"unreadable ({exc.strerror or exc})")
    if stat.S_ISDIR(mode):
        return None if folder else "a folder"
    if stat.S_ISREG(mode):
        return "a file" if folder else None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path``; ``what`` names the kind of file (``"model"``, ``"plan"``...)."""
    path = Path(path)
    problem = path_problem(path)
    if problem == "a folder":
        raise MpipeError(f"{what} file {path} is a folder; give the path of a {what} file")
    if problem is not None and problem != "missing":
        raise MpipeError(f"{what} file {shown_path(path)} is {problem}; give the path of a regular {what} file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise MpipeError(f"cannot read {what} file {path}: {exc.strerror or exc}; check the path") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MpipeError(
            f"{what} file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); give a "
            f"{what} file in JSON or YAML"
        ) from None


def parse_text(text: str, path: str | Path, what: str, *, as_json: bool) -> Any:
    """``text`` parsed as JSON (``as_json``) or YAML, with the line of a syntax error."""
    if as_json:
        return parse_json(text, f"{what} file {path}", what)
    import yaml  # here, so that the algebra can use check_finite without loading yaml

    # libyaml's parser where PyYAML has it (about 5x faster on a large file, the same safe types), unless the text
    # could nest deeper than its composer's C recursion is safe for: a libyaml without a depth limit overflows the
    # C stack there (a segfault), where the Python parser stops at the recursion limit.
    fast = getattr(yaml, "CSafeLoader", None)
    loader = fast if fast is not None and nesting_bound(text) <= C_YAML_SAFE_DEPTH else yaml.SafeLoader
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1} column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise MpipeError(f"{what} file {path}: not valid YAML{at}: {problem}; fix the syntax") from None
    except RecursionError:
        raise MpipeError(f"{what} file {path} nests too deeply to be a {what}; fix the file") from None


C_YAML_SAFE_DEPTH = 500  # nesting that libyaml's recursive composer handles on any stack


def nesting_bound(text: str) -> int:
    """An upper bound on how deep ``text`` can nest as YAML: its deepest run of open brackets (flow collections)
    plus its longest line (a block collection needs a column of indent or a ``- `` / ``? `` on its line)."""
    longest = max(map(len, text.splitlines()), default=0)
    opens = text.count("[") + text.count("{")
    if opens + longest <= C_YAML_SAFE_DEPTH:
        return opens + longest
    import numpy as np

    step = np.zeros(256, dtype=np.int64)  # per byte: +1 opens a flow collection, -1 closes one
    step[[0x5B, 0x7B]], step[[0x5D, 0x7D]] = 1, -1
    depth = np.cumsum(step[np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)])
    floor = np.minimum.accumulate(np.minimum(depth, 0))  # a close before its open (in a string) lowers no later depth
    return int((depth - floor).max(initial=0)) + longest


def parse_json(text: str | bytes, where: str, what: str) -> Any:
    """``text`` parsed as JSON; a syntax error or a nesting beyond the parser's depth limit (about 1,000
    levels) is one line naming ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MpipeError(f"{where}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); fix the "
                         f"syntax") from None
    except RecursionError:
        raise MpipeError(f"{where} nests deeper than the JSON parser allows (about 1,000 levels), too deep to be a "
                         f"{what}; fix the file") from None


def load_data_file(path: str | Path, what: str, *, as_json: bool | None = None) -> Any:
    """Read and parse a JSON or YAML file; by default JSON for a ``.json`` suffix, else YAML."""
    path = Path(path)
    text = read_text(path, what)
    return parse_text(text, path, what, as_json=path.suffix in JSON_SUFFIXES if as_json is None else as_json)


def check_finite(value: Any, *, where: str, field: str, lower: float = 0.0, upper: float | None = None) -> float:
    """``value`` as a float: a number (not a bool), finite, ``>= lower`` and, with ``upper``, ``<= upper``.

    A YAML ``1e-6`` (no dot) reads as a string: the message says to write ``1.0e-6``."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            pass
        else:
            raise MpipeError(f"{where}: field {field!r} = {value!r} is text, not a number (YAML reads an exponent "
                             f"without a dot as a string); write it as {_yaml_float(value)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MpipeError(f"{where}: field {field!r} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise MpipeError(f"{where}: field {field!r} = {value!r} must be a finite number")
    if number < lower or (upper is not None and number > upper):
        bounds = f">= {lower:g}" + (f" and <= {upper:g}" if upper is not None else "")
        raise MpipeError(f"{where}: field {field!r} = {value!r} must be {bounds} (SI units: seconds, bytes)")
    return number


def _yaml_float(text: str) -> str:
    """``'1e-6'`` -> ``'1.0e-6'``."""
    mantissa, _, exponent = text.lower().partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return f"{mantissa}e{exponent}" if exponent else mantissa
