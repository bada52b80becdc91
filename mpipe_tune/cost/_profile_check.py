"""A profile's fields checked one by one: the validator :func:`~mpipe_tune.cost._profile.parse_profile` and the
sections' own parsers (:mod:`~mpipe_tune.cost._kernel_model`'s ``host`` and ``kernel_efficiency``) fail through, each
failure one line naming the field, what it must be and how to fix it; the provenance every number carries
(``source`` one of :data:`SOURCES`, optional ``ref``, ``date``, ``fit_r2``), collected as it goes; and the JSON text a
profile is written as (:func:`to_json`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from mpipe_tune.cost._collectives import LinkCost
from mpipe_tune.errors import MpipeError

SOURCES = ("datasheet", "measured", "fitted", "assumed", "ideal")
"""Where a figure comes from: a datasheet, a measurement on the device (a profiler fit included), a fit to
published runs of the device (``ref`` names the runs and the held-out split), an assumption, or an ideal machine."""
"""``datasheet``: a vendor figure, a lead rather than a measurement; ``measured``: fitted to measurements (by the
profiler on the device, or by ``benchmarks/fit_published.py`` to published measured runs, cited in the entry);
``assumed``: a typical value chosen by hand; ``ideal``: a closed-form test value, not a device."""
MISSING = object()
"""The value :meth:`Validator.fail` is given for a field that is absent."""


class Validator:
    """Checks one profile's fields, collecting provenance; every failure is one MpipeError line."""

    missing = MISSING

    def __init__(self, where: str) -> None:
        self.where = where
        self.provenance: dict[str, Mapping[str, Any]] = {}

    def fail(self, path: str, value: Any, must: str, fix: str) -> None:
        shown = to_json(value) if isinstance(value, float) and math.isfinite(value) else repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        got = "is missing and" if value is MISSING else f"= {shown}:"
        raise MpipeError(f"{self.where}: {path or '<top level>'} {got} {must}; {fix}")

    def text(self, path: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(path, value, "must be a non-empty string", "quote it")
        return value

    def table(self, path: str, value: Any, allowed: tuple[str, ...] | None) -> Mapping[str, Any]:
        if not isinstance(value, Mapping) or not value:
            self.fail(path, value, "must be a non-empty JSON object", "see profiles/ideal.json")
        for key in value:
            if allowed is not None and key not in allowed:
                self.fail(f"{path}.{key}", value[key], f"is not a known key of {path}",
                          f"use one of {', '.join(allowed)}")
            if allowed is None and (not isinstance(key, str) or not key.strip()):
                self.fail(f"{path}.{key}", value[key], "needs a non-empty name", "name the entry")
        return value

    def scalar(self, path: str, value: Any, *, positive: bool) -> float:
        if isinstance(value, str):
            self.fail(path, value, "must be a plain JSON number",
                      "numbers are SI base units (bytes, seconds, bytes/s, FLOP/s) written as plain "
                      "numbers, e.g. 80e9 rather than \"80 GB\"")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(path, value, "must be a finite number", "write a plain JSON number")
        if positive and value <= 0:
            self.fail(path, value, "must be > 0", "give the positive figure in SI base units")
        if not positive and value < 0:
            self.fail(path, value, "must be >= 0", "give a non-negative figure in SI base units")
        return float(value)

    def tp_table(self, path: str, table: Any) -> dict[int, tuple[float, float]]:
        """A ``tp_overhead_s``, ``tp_slowdown``, ``ep_overhead_s`` or ``ep_slowdown`` table: tensor- or
        expert-parallel degree (a string key, >= 2) -> ``[forward, backward]``, each >= 0."""
        if not isinstance(table, Mapping) or not table:
            self.fail(path, table, "must be a non-empty object", 'give {"2": [forward, backward]}')
        out = {}
        for key, pair in table.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) >= 2):
                self.fail(f"{path}.{key}", pair, "is keyed by a parallel degree", 'use an integer >= 2, e.g. "2"')
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                self.fail(f"{path}.{key}", pair, "must be [forward, backward]", "give two non-negative numbers")
            out[int(key)] = tuple(self.scalar(f"{path}.{key}", x, positive=False) for x in pair)
        return out

    def origin(self, path: str, entry: Mapping[str, Any], numbers: tuple[str, ...]) -> None:
        """Check and record the provenance keys of ``entry`` (all keys but ``numbers``)."""
        if "source" not in entry:
            self.fail(f"{path}.source", MISSING, f"is required, one of {', '.join(SOURCES)}",
                      "say where the number comes from")
        for key in ("source", "alpha_source"):
            if key in entry and entry[key] not in SOURCES:
                self.fail(f"{path}.{key}", entry[key], f"must be one of {', '.join(SOURCES)}",
                          "pick the one that says how the number was obtained")
        for key in ("ref", "date", "alpha_ref"):
            if key in entry and not isinstance(entry[key], str):
                self.fail(f"{path}.{key}", entry[key], "must be a string", "quote it")
        if "fit_r2" in entry:
            r2 = entry["fit_r2"]
            if isinstance(r2, bool) or not isinstance(r2, (int, float)) or not r2 <= 1:
                self.fail(f"{path}.fit_r2", r2, "must be a number <= 1", "write the fit's R^2")
        self.provenance[path] = freeze({k: x for k, x in entry.items() if k not in numbers})

    def number(self, path: str, entry: Any, *, positive: bool, extras: tuple[str, ...] = ()) -> float:
        """The entry's ``value``; ``extras`` are further numbers of the entry (kept out of its provenance,
        checked by the caller)."""
        if not isinstance(entry, Mapping):
            if isinstance(entry, str):
                self.scalar(path, entry, positive=positive)
            self.fail(path, entry, 'must be an object {"value": ..., "source": ...}',
                      "wrap the number with its provenance")
        if "value" not in entry:
            self.fail(f"{path}.value", MISSING, "is required", "add the number")
        value = self.scalar(f"{path}.value", entry["value"], positive=positive)
        self.origin(path, entry, ("value", *extras))
        return value

    def efficiency(self, path: str, value: float) -> float:
        if value > 1:
            self.fail(path, value, "must lie in (0, 1]", "give the achieved fraction of peak, e.g. 0.45")
        return value

    def link(self, path: str, entry: Any) -> LinkCost:
        if not isinstance(entry, Mapping):
            self.fail(path, entry, 'must be an object {"alpha_s": ..., "beta_s_per_byte": ..., '
                      '"source": ...}', "write the link cost as an object")
        numbers = ("alpha_s", "beta_s_per_byte")
        for key in numbers:
            if key not in entry:
                self.fail(f"{path}.{key}", MISSING, "is required", f"add {key} in SI base units")
        cost = LinkCost(*(self.scalar(f"{path}.{k}", entry[k], positive=False) for k in numbers))
        if "mesh_links" in entry:
            links = entry["mesh_links"]
            if isinstance(links, bool) or not isinstance(links, int) or links < 1:
                self.fail(f"{path}.mesh_links", links, "must be an integer >= 1",
                          "give the direct links of a full mesh whose combined bandwidth beta_s_per_byte is")
            if path.endswith(".p2p"):
                self.fail(f"{path}.mesh_links", links, "applies to collectives, not to p2p",
                          "remove it: a point-to-point transfer uses one link whatever the mesh")
            cost = replace(cost, mesh_links=links)
        if "median_s" in entry and "group_size" in entry:
            cost = replace(cost, curve=self.sweep(path, entry))
        self.origin(path, entry, (*numbers, "mesh_links"))
        return cost

    def sweep(self, path: str, entry: Mapping[str, Any]) -> tuple[str, int, tuple[float, ...], tuple[float, ...]]:
        """A measured link's sweep (``LinkCost.curve``): the collective (the path's last key), ``group_size``,
        ``sizes_bytes`` (increasing) and ``median_s`` (one per size), as the profiler writes them beside its fit
        (an entry without ``group_size`` keeps them as provenance only)."""
        fix = "give the sweep as the profiler writes it, or drop median_s to use alpha_s and beta_s_per_byte alone"
        group = entry.get("group_size", MISSING)
        if isinstance(group, bool) or not isinstance(group, int) or group < 2:
            self.fail(f"{path}.group_size", group, "must be an integer >= 2", fix)
        columns = []
        for key in ("sizes_bytes", "median_s"):
            values = entry.get(key, MISSING)
            if not isinstance(values, (list, tuple)) or len(values) < 2:
                self.fail(f"{path}.{key}", values, "must be a list of at least 2 numbers", fix)
            columns.append(tuple(self.scalar(f"{path}.{key}", x, positive=True) for x in values))
        sizes, seconds = columns
        if len(sizes) != len(seconds):
            self.fail(f"{path}.median_s", list(seconds), f"must have one time per size ({len(sizes)})", fix)
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            self.fail(f"{path}.sizes_bytes", list(sizes), "must increase", fix)
        return path.rsplit(".", 1)[-1], group, sizes, seconds


def freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(x) for k, x in value.items()})
    if isinstance(value, list):
        return tuple(freeze(x) for x in value)
    return value


def thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: thaw(x) for k, x in value.items()}
    if isinstance(value, tuple):
        return [thaw(x) for x in value]
    return value


def to_json(value: Any, depth: int = 0) -> str:
    """Indented JSON whose large round numbers read as ``9.89e+14`` rather than ``989000000000000.0``."""
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, Mapping):
        items = [f"{inner}{json.dumps(str(k))}: {to_json(x, depth + 1)}" for k, x in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
    if isinstance(value, (list, tuple)):
        if all(not isinstance(x, (Mapping, list, tuple)) for x in value):
            return "[" + ", ".join(to_json(x) for x in value) + "]"
        return "[\n" + ",\n".join(inner + to_json(x, depth + 1) for x in value) + f"\n{pad}]"
    if isinstance(value, float) and math.isfinite(value) and abs(value) >= 1e6 and value.is_integer():
        return format(Decimal(repr(value)).normalize(), "e").replace("e+", "e")
    return json.dumps(value)
