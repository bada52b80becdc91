"""Reading stored JSON into the plan file's typed records, checked as strictly as the flags that made them.

:func:`read_value` reads a JSON value into a type of :mod:`~mpipe_tune.plan_file._schema` by walking
its annotations (frozen dataclasses, ``int``, ``float``, ``str``, ``bool``, optional and tuple types),
so a field's check is its type plus its range in the field's metadata (:func:`spec`), and a damaged
file ends in one line naming the field instead of a ``KeyError`` or a division by zero further on.
:func:`read_candidate` reads a stored candidate: each field's type and range (the limits the CLI
applies), the lengths that must agree, then :meth:`Candidate.validate` for what holds of a candidate
on its own.

>>> read_value(int, 0, where="plan file p.json", path="search.samples", meta={"lower": 1})
Traceback (most recent call last):
...
mpipe_tune.errors.PlanFileError: plan file p.json: field 'search.samples' = 0 must be int >= 1; the file is damaged or was edited: re-create it with 'mpipe-tune plan'
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

from mpipe_tune.algebra import (
    DTYPE_BYTES, MAX_DEVICES, RECOMPUTE_GRANULARITIES, ZERO_STAGES, Candidate, COOLDOWN, PLACEMENTS,
    parse_schedule,
)
from mpipe_tune.errors import MpipeError, PlanFileError
from mpipe_tune.inputs import check_finite, MAX_MICROBATCHES

FIX = "the file is damaged or was edited: re-create it with 'mpipe-tune plan'"
_LAYERS = 1 << 20
"""A bound on layer indices and counts far above any model's."""


def damaged(where: str, message: str) -> PlanFileError:
    """The one-line error for a damaged or edited plan file: where, what is wrong, how to fix it."""
    return PlanFileError(f"{where}: {message}; {FIX}")


def spec(*, key: str | None = None, lower: float | None = None, upper: float | None = None,
         choices: tuple[str, ...] | None = None, omit_none: bool = False, default: Any = dataclasses.MISSING):
    """A schema field's stored form: its JSON ``key`` (default: the field's name), the range of a
    number, the ``choices`` of a text, and whether ``None`` is left out of the file (``omit_none``)."""
    meta = {k: v for k, v in (("key", key), ("lower", lower), ("upper", upper), ("choices", choices)) if v is not None}
    meta["omit_none"] = omit_none
    return dataclasses.field(default=default, metadata=meta)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_value(kind: Any, value: Any, *, where: str, path: str, meta: Mapping[str, Any] | None = None) -> Any:
    """``value`` read as ``kind``; one-line :class:`PlanFileError` naming ``path`` when it is not one."""
    meta = meta or {}
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        *others, last = [a for a in args if a is not type(None)]
        for inner in others:  # ``bool | str``: the first type the value is
            try:
                return read_value(inner, value, where=where, path=path, meta=meta)
            except PlanFileError:
                pass
        return read_value(last, value, where=where, path=path, meta=meta)
    if hasattr(kind, "read_stored"):
        return kind.read_stored(value, where=where, path=path)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and hasattr(args[0], "STORED_KEY"):
        return _read_keyed(args[0], value, where=where, path=path)
    if origin is tuple:
        if not isinstance(value, list):
            raise damaged(where, f"field {path!r} = {_short(value)} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(read_value(args[0], v, where=where, path=f"{path}[{i}]", meta=meta) for i, v in enumerate(value))
        if len(value) != len(args):
            raise damaged(where, f"field {path!r} = {_short(value)} must list {len(args)} entries")
        return tuple(read_value(a, v, where=where, path=f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if kind is Candidate:
        return read_candidate(value, where=where)
    if dataclasses.is_dataclass(kind):
        return read_record(kind, value, where=where, path=path)
    if kind is float:
        try:
            return check_finite(value, where=where, field=path, lower=meta.get("lower", -math.inf),
                                upper=meta.get("upper"))
        except MpipeError as exc:
            raise PlanFileError(f"{exc}; {FIX}") from None
    if kind is int:
        lower, upper = meta.get("lower"), meta.get("upper")
        if not _is_int(value) or (lower is not None and value < lower) or (upper is not None and value > upper):
            bounds = (f" >= {lower}" if lower is not None else "") + (f" <= {upper}" if upper is not None else "")
            raise damaged(where, f"field {path!r} = {_short(value)} must be int{bounds}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise damaged(where, f"field {path!r} must be true or false, got {_short(value)}")
        return value
    assert kind is str, f"no reader for {kind}"
    if not isinstance(value, str) or ("choices" in meta and value not in meta["choices"]):
        must = f"one of {', '.join(meta['choices'])}" if "choices" in meta else "text"
        raise damaged(where, f"field {path!r} must be {must}, got {_short(value)}")
    return value


def read_record(cls: type, data: Any, *, where: str, path: str) -> Any:
    """A frozen dataclass from its stored object: every field read by its type (:func:`read_value`);
    a field with a default may be absent (a file from before it), keys this version does not know
    are left aside."""
    if not isinstance(data, Mapping):
        raise damaged(where, f"field {path!r} must be an object")
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f.metadata.get("key", f.name)
        at = f"{path}.{key}" if path else key
        if key not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise damaged(where, f"field {at!r} is missing")
            continue
        values[f.name] = read_value(_hints(cls)[f.name], data[key], where=where, path=at, meta=f.metadata)
    return cls(**values)


def _read_keyed(cls: type, data: Any, *, where: str, path: str) -> tuple:
    """Records stored as one object keyed by their ``STORED_KEY`` field (``{"megatron": {...}, ...}``);
    with ``STORED_VALUE``, each key maps to that one field's value (``{"megatron": 1.2, ...}``)."""
    if not isinstance(data, Mapping):
        raise damaged(where, f"field {path!r} must be an object")
    value_field = getattr(cls, "STORED_VALUE", None)
    out = []
    for name, entry in data.items():
        entry = {value_field: entry} if value_field else entry
        if not isinstance(entry, Mapping):
            raise damaged(where, f"field '{path}.{name}' must be an object")
        out.append(read_record(cls, {**entry, cls.STORED_KEY: name}, where=where, path=f"{path}.{name}"))
    return tuple(out)


def write_value(value: Any) -> Any:
    """The stored (JSON) form of a schema value: the inverse of :func:`read_value`."""
    if isinstance(value, Candidate):
        return value.to_dict()
    if hasattr(value, "to_stored"):
        return value.to_stored()
    if isinstance(value, tuple) and value and hasattr(value[0], "STORED_KEY"):
        key, single = value[0].STORED_KEY, getattr(value[0], "STORED_VALUE", None)
        return {getattr(v, key): getattr(v, single) if single else
                {k: e for k, e in write_value(v).items() if k != key} for v in value}
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.init and not (v is None and f.metadata.get("omit_none")):
                out[f.metadata.get("key", f.name)] = write_value(v)
        return out
    if isinstance(value, tuple):
        return [write_value(v) for v in value]
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------ candidate


def _count(c: Mapping[str, Any], key: str, *, where: str, lower: int = 1, upper: int) -> int:
    value = c.get(key)
    if not _is_int(value) or not lower <= value <= upper:
        raise damaged(where, f"candidate field {key!r} = {_short(value)} must be an integer from {lower} to {upper}")
    return value


def _counts(value: Any, *, where: str, key: str, lower: int, upper: int, length: int | None = None) -> None:
    if not isinstance(value, list) or not all(_is_int(v) and lower <= v <= upper for v in value):
        raise damaged(where, f"candidate field {key!r} = {_short(value)} must be a list of integers from {lower} to {upper}")
    if length is not None and len(value) != length:
        raise damaged(where, f"candidate field {key!r} lists {len(value)} entries, but the candidate needs {length}")


def read_candidate(c: Any, *, where: str) -> Candidate:
    """A stored candidate (:meth:`Candidate.to_dict`'s form), every field checked: types, ranges,
    lengths that agree with each other, then :meth:`Candidate.validate`."""
    if not isinstance(c, Mapping):
        raise damaged(where, "field 'candidate' must be an object")
    if not isinstance(c.get("schedule"), str) or not c["schedule"].strip():
        raise damaged(where, f"candidate field 'schedule' = {_short(c.get('schedule'))} must be a schedule text such "
                             f"as 'transpose,1f1b'")
    pp, tp, dp = (_count(c, k, where=where, upper=MAX_DEVICES) for k in ("pp", "tp", "dp"))
    if pp * tp * dp > MAX_DEVICES:
        raise damaged(where, f"candidate pp*tp*dp = {pp}*{tp}*{dp} is above {MAX_DEVICES} devices")
    m = _count(c, "microbatches", where=where, upper=MAX_MICROBATCHES)
    for key in ("ep", "cp", "encoder_tp"):  # optional degrees (1 when absent)
        if key in c:
            _count(c, key, where=where, upper=MAX_DEVICES)
    if "zero_stage" in c and (isinstance(c["zero_stage"], bool) or c["zero_stage"] not in ZERO_STAGES):
        raise damaged(where, f"candidate field 'zero_stage' = {_short(c['zero_stage'])} must be one of "
                             f"{', '.join(map(str, ZERO_STAGES))}")
    if c.get("reshard_after_forward") is not None and not isinstance(c["reshard_after_forward"], bool):
        raise damaged(where, f"candidate field 'reshard_after_forward' = {_short(c['reshard_after_forward'])} must be "
                             f"true, false or null (the default for the pipeline degree)")
    for key in ("owner_policy", "label"):
        if c.get(key) is not None and not isinstance(c[key], str):
            raise damaged(where, f"candidate field {key!r} = {_short(c[key])} must be text or null")
    if not isinstance(c.get("frozen", []), list) or not all(isinstance(b, str) for b in c.get("frozen", [])):
        raise damaged(where, f"candidate field 'frozen' = {_short(c.get('frozen'))} must be a list of block names")
    if not isinstance(c.get("sequence_parallel", False), bool):
        raise damaged(where, f"candidate field 'sequence_parallel' = {_short(c['sequence_parallel'])} must be true "
                             f"or false")
    _counts(c.get("cut"), where=where, key="cut", lower=1, upper=_LAYERS)
    if not isinstance(c.get("dtype"), str) or c["dtype"] not in DTYPE_BYTES:
        raise damaged(where, f"candidate field 'dtype' = {_short(c.get('dtype'))} must be one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(c.get("recompute", False), bool) and c.get("recompute") not in RECOMPUTE_GRANULARITIES:
        raise damaged(where, f"candidate field 'recompute' = {_short(c.get('recompute'))} must be true, false or one "
                             f"of {', '.join(RECOMPUTE_GRANULARITIES)}")
    slabs = c.get("slabs")  # null: balanced by layer cost (a searched candidate; a stored plan's are explicit)
    if slabs is not None and not isinstance(slabs, list):
        raise damaged(where, f"candidate field 'slabs' = {_short(slabs)} must be a list of per-rank layer counts per "
                             f"region")
    for counts in slabs or ():
        _counts(counts, where=where, key="slabs", lower=0, upper=_LAYERS, length=pp)
    if "owners" not in c:
        raise damaged(where, "candidate field 'owners' is missing (null for a plan without a transpose region)")
    if c["owners"] is not None:
        _counts(c["owners"], where=where, key="owners", lower=0, upper=pp - 1, length=m)
    if c.get("encoder_backward", COOLDOWN) not in PLACEMENTS:
        raise damaged(where, f"candidate field 'encoder_backward' = {_short(c['encoder_backward'])} must be one of "
                             f"{', '.join(PLACEMENTS)}")
    for key, upper in (("encoder_backward_slots", 1 << 30), ("encoder_backward_ranks", pp - 1)):
        if c.get(key) is not None:
            _counts(c[key], where=where, key=key, lower=0, upper=upper, length=m)
    if c.get("encoder_backward_ranks") is not None and c.get("encoder_backward_slots") is None:
        raise damaged(where, "candidate field 'encoder_backward_ranks' is set but 'encoder_backward_slots' is null; "
                             "moved encoder backwards need their slots")
    try:
        parse_schedule(c["schedule"])
    except MpipeError as exc:
        raise damaged(where, f"candidate field 'schedule': {exc}") from None
    candidate = Candidate.from_dict(c)
    try:
        candidate.validate()
    except MpipeError as exc:
        raise damaged(where, f"its stored candidate is not valid ({exc})") from None
    return candidate
