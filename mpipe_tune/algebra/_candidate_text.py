"""A candidate's one text form: what ``str(candidate)`` prints, the tables show and ``Candidate.parse``
reads back, and the words its settings take (dtypes, recomputation).

The form is pieces separated by two spaces; the first two are fixed, the rest keyword-led and left
out at their defaults (a parse gives a left-out piece the candidate's default):

====================================  ==========================================================
``<transpose,1f1b> cut 9``            schedule (normal form) and interior boundaries (``cut -``: none)
``pp4 tp2 dp8 ep4 cp2 etp1``          the degrees (:class:`~mpipe_tune.algebra._degrees.Degrees`)
``M=8``                               microbatches per replica
``owners greedy``                     owner policy of the transposed region
``owner map 0,1,2,3``                 explicit owner map
``slabs 4-4/2-2``                     slab counts per Sharded region (``slabs -``: no Sharded region)
``recompute`` / ``recompute selective``  full or selective recomputation (none: left out)
``zero0``, ``zero2``, ``sp``          ZeRO stage 0 or 2 (1: left out); sequence parallelism
``zero3``, ``zero3 reshard``          ZeRO stage 3 at its default reshard policy, or ``reshard`` / ``keep``
                                      (FSDP2's ``reshard_after_forward`` on / off) when given
``fp32``                              the dtype (bf16: left out)
``frozen encoder``                    frozen blocks
``encoder backward optimised``        the placement (cooldown: left out), with ``(K on other ranks)``
                                      after it when the ranks move some (read, not stored)
``backward slots 3,5``                explicit encoder backward slots
``backward ranks 0,1``                explicit encoder backward ranks
``label megatron``                    a baseline's name
====================================  ==========================================================

>>> fields = parse_candidate_fields("<1f1b> cut -  pp2 tp1 dp4 ep4  M=8  recompute selective")
>>> fields["degrees"], fields["num_microbatches"], fields["recompute"]
(Degrees(pp=2, tp=1, dp=4, ep=4, cp=1, encoder_tp=None), 8, 'selective')
"""

from __future__ import annotations

import re
from typing import Any

from mpipe_tune.algebra._degrees import Degrees
from mpipe_tune.algebra._encoder_backward import COOLDOWN, moved_count
from mpipe_tune.errors import MpipeError

DTYPES = {"fp64": (8, "float64"), "fp32": (4, "float32"), "tf32": (4, "float32"), "bf16": (2, "bfloat16"),
          "fp16": (2, "float16"), "fp8": (1, "float8_e4m3fn"), "int8": (1, "int8")}
"""The one table of compute dtypes a candidate, a profile or a run may name: bytes per element and the torch
dtype of its operands (``tf32`` is fp32 operands with TF32 matmul allowed)."""
DTYPE_BYTES = {name: size for name, (size, _) in DTYPES.items()}
"""Bytes per element of each compute dtype (:data:`DTYPES`)."""
TORCH_DTYPE_NAMES = {name: torch_name for name, (_, torch_name) in DTYPES.items()}
"""The torch dtype (its attribute name) of each compute dtype's operands (:data:`DTYPES`)."""
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
"""Activation recomputation settings, as Megatron-LM's ``--recompute-granularity`` names them (plus none)."""
RECOMPUTE_WORDS = {"none": "none", "off": "none", "selective": "selective", "full": "full", "on": "full"}
"""Every word a recomputation setting is written with (``off``/``on`` for ``none``/``full``)."""
_RECOMPUTE_VALUES = {"none": False, "selective": "selective", "full": True, False: False, True: True}
SEPARATOR = "  "
"""Between the pieces of the text form."""
_HEAD = re.compile(r"^<([^<>]+)> cut (\S+)$")


def normalize_recompute(value: bool | str) -> bool | str:
    """The stored form of a recomputation setting: ``False`` (none), ``"selective"`` or ``True``
    (full), so that plan files and callers from before the granularity existed read unchanged.

    >>> normalize_recompute("full"), normalize_recompute("none"), normalize_recompute("selective")
    (True, False, 'selective')
    """
    if isinstance(value, (bool, str)) and value in _RECOMPUTE_VALUES:
        return _RECOMPUTE_VALUES[value]
    raise MpipeError(f"recomputation {value!r} is not a granularity; use one of {', '.join(RECOMPUTE_GRANULARITIES)}")


def recompute_granularity(value: bool | str) -> str:
    """``"none"``, ``"selective"`` or ``"full"`` for a setting in either form.

    >>> recompute_granularity(True), recompute_granularity(False)
    ('full', 'none')
    """
    stored = normalize_recompute(value)
    return "full" if stored is True else "none" if stored is False else stored


def parse_recompute(word: str, where: str = "recompute") -> bool | str:
    """The stored setting of a recomputation word (:data:`RECOMPUTE_WORDS`), or one line naming it."""
    if word not in RECOMPUTE_WORDS:
        raise MpipeError(f"{where} {word!r} is not a recomputation setting; use one of {', '.join(RECOMPUTE_WORDS)}")
    return normalize_recompute(RECOMPUTE_WORDS[word])


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _list(values) -> str:
    return ",".join(map(str, values))


def format_candidate(c) -> str:
    """The text form of a :class:`~mpipe_tune.algebra._candidate.Candidate` (module docstring)."""
    pieces = [f"<{c.schedule}> cut {_list(c.cut) or '-'}", str(c.degrees), f"M={c.num_microbatches}"]
    if c.owner_policy:
        pieces.append(f"owners {c.owner_policy}")
    if c.owner_map is not None:
        pieces.append(f"owner map {_list(c.owner_map)}")
    if c.slab_counts is not None:
        pieces.append("slabs " + ("/".join("-".join(map(str, counts)) for counts in c.slab_counts) or "-"))
    granularity = recompute_granularity(c.recompute)
    if granularity != "none":
        pieces.append("recompute" if granularity == "full" else f"recompute {granularity}")
    policy = {None: "", True: " reshard", False: " keep"}[c.reshard_after_forward]
    pieces += [f"zero{c.zero_stage}{policy}"] * (c.zero_stage != 1) + ["sp"] * c.sequence_parallel
    pieces += [c.dtype] * (c.dtype != "bf16")
    if c.frozen:
        pieces.append(f"frozen {_list(c.frozen)}")
    if c.encoder_backward != COOLDOWN:
        moved = (f" ({moved_count(c.encoder_backward_ranks, c.owner_map)} on other ranks)"
                 if c.encoder_backward_ranks is not None and c.owner_map is not None else "")
        pieces.append(f"encoder backward {c.encoder_backward}{moved}")
    if c.encoder_backward_slots is not None:
        pieces.append(f"backward slots {_list(c.encoder_backward_slots)}")
    if c.encoder_backward_ranks is not None:
        pieces.append(f"backward ranks {_list(c.encoder_backward_ranks)}")
    if c.label:
        pieces.append(f"label {c.label}")
    return SEPARATOR.join(pieces)


_KEYWORDS = ("owners", "owner map", "slabs", "recompute", "frozen", "encoder backward", "backward slots",
             "backward ranks", "label", "zero3")
RESHARD_POLICIES = {"reshard": True, "keep": False}
"""The words of ZeRO-3's reshard policy (``reshard_after_forward`` on, off)."""


def parse_candidate_fields(text: str) -> dict[str, Any]:
    """The keyword arguments of the candidate whose text form is ``text`` (module docstring), or one
    line naming the piece that does not parse and how the form reads."""
    example = "'<transpose,1f1b> cut 9  pp4 tp1 dp2  M=8  owners greedy'"
    pieces = [p.strip() for p in text.strip().split(SEPARATOR) if p.strip()]
    head = _HEAD.match(pieces[0]) if pieces else None
    if head is None or len(pieces) < 3 or not pieces[2].startswith("M="):
        raise MpipeError(f"candidate '{text}' does not start with its schedule, cut, degrees and microbatch count "
                         f"(pieces separated by two spaces), e.g. {example}")
    schedule, cut = head.groups()
    fields: dict[str, Any] = {}
    try:
        fields.update(schedule=schedule.strip(), cut=() if cut == "-" else _ints(cut),
                      degrees=Degrees.parse(pieces[1]), num_microbatches=int(pieces[2][2:]))
        for piece in pieces[3:]:
            key = next((k for k in _KEYWORDS if piece == k or piece.startswith(k + " ")), piece)
            value = piece[len(key):].strip()
            name = {"owners": "owner_policy", "owner map": "owner_map", "slabs": "slab_counts", "frozen": "frozen",
                    "encoder backward": "encoder_backward", "backward slots": "encoder_backward_slots",
                    "backward ranks": "encoder_backward_ranks", "label": "label", "recompute": "recompute",
                    "zero0": "zero_stage", "zero2": "zero_stage", "zero3": "zero_stage",
                    "sp": "sequence_parallel"}.get(key, "dtype" if key in DTYPE_BYTES else None)
            if name is None:
                raise ValueError(f"'{piece}' is not a piece of the form")
            if name in fields:
                raise ValueError(f"'{piece}' repeats a setting given before")
            if name in ("owner_map", "encoder_backward_slots", "encoder_backward_ranks"):
                fields[name] = _ints(value)
            elif name == "slab_counts":
                fields[name] = () if value == "-" else tuple(tuple(int(v) for v in counts.split("-"))
                                                            for counts in value.split("/"))
            elif name == "recompute":
                fields[name] = parse_recompute(value or "full")
            elif name == "frozen":
                fields[name] = tuple(value.split(","))
            elif name == "encoder_backward":
                fields[name] = value.split(" (")[0]
            elif name == "zero_stage":
                fields[name] = int(key[4:])
                if value and value not in RESHARD_POLICIES:
                    raise ValueError(f"'{piece}' has reshard policy {value!r}; use {' or '.join(RESHARD_POLICIES)}")
                if value:
                    fields["reshard_after_forward"] = RESHARD_POLICIES[value]
            elif name == "sequence_parallel":
                fields[name] = True
            elif name == "dtype":
                fields[name] = key
            elif not value:
                raise ValueError(f"'{piece}' has no value")
            else:
                fields[name] = value
    except (ValueError, MpipeError) as exc:
        raise MpipeError(f"candidate '{text}': {exc}; write it as {example}") from None
    return fields
