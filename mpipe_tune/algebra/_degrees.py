"""The parallel degrees of a candidate, as one record with one text form.

``pp * tp * cp * dp`` devices: ``pp`` pipeline ranks, each a slab of ``tp`` tensor-parallel devices
times ``cp`` context-parallel ones, replicated ``dp`` times; the expert-parallel group of ``ep``
ranks is carved from the data- (and context-) parallel ranks, and the encoder block may run at its
own tensor-parallel degree ``encoder_tp``, a divisor of ``tp``.

The text form names each degree by its short name with its value glued on, ``pp`` first; ``ep``,
``cp`` and ``etp`` (the encoder's) appear only where they differ from their defaults:

>>> str(Degrees(4, tp=2, dp=8, ep=4))
'pp4 tp2 dp8 ep4'
>>> Degrees.parse("pp4 tp4 dp2 etp1") == Degrees(4, 4, 2, encoder_tp=1)
True
>>> Degrees.parse("pp2")
Degrees(pp=2, tp=1, dp=1, ep=1, cp=1, encoder_tp=None)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mpipe_tune.errors import MpipeError

NAMES = {"pp": "pp", "tp": "tp", "dp": "dp", "ep": "ep", "cp": "cp", "etp": "encoder_tp"}
"""Each degree's short name in the text form, and its field."""
_TOKEN = re.compile(r"^(pp|tp|dp|ep|cp|etp)(\d+)$")


@dataclass(frozen=True)
class Degrees:
    """Pipeline, tensor-, data-, expert- and context-parallel degrees and the encoder's own tensor-parallel one."""

    pp: int
    """Pipeline degree P: ranks the pipeline runs on."""
    tp: int = 1
    """Tensor-parallel degree inside every slab."""
    dp: int = 1
    """Data-parallel degree: replicas of the whole pipeline."""
    ep: int = 1
    """Expert-parallel degree, carved from the data- (and context-) parallel ranks."""
    cp: int = 1
    """Context-parallel degree: ``pp * tp * cp * dp`` devices."""
    encoder_tp: int | None = None
    """The encoder block's own tensor-parallel degree, a divisor of ``tp``; ``None`` (stored for ``tp``
    itself): ``tp``."""

    def __post_init__(self) -> None:
        if self.encoder_tp == self.tp:
            object.__setattr__(self, "encoder_tp", None)

    @property
    def num_devices(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    def validate(self) -> None:
        """One-line :class:`MpipeError` unless pp, tp and dp are integers >= 1."""
        for what, symbol, value in (("pipeline degree", "P", self.pp), ("tensor-parallel degree", "tp", self.tp),
                                    ("data-parallel degree", "dp", self.dp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MpipeError(f"the {what} {symbol} is {value!r}, but {symbol} must be an integer >= 1")

    def __str__(self) -> str:
        extra = "".join(f" {name}{value}" for name, value in (("ep", self.ep), ("cp", self.cp)) if value > 1)
        extra += f" etp{self.encoder_tp}" if self.encoder_tp is not None else ""
        return f"pp{self.pp} tp{self.tp} dp{self.dp}{extra}"

    @classmethod
    def parse(cls, text: str) -> Degrees:
        """The inverse of ``str``: space-separated ``NAMEvalue`` tokens (:data:`NAMES`), each at most
        once, ``pp`` required, the others defaulting as the fields do."""
        values: dict[str, int] = {}
        for token in text.split():
            match = _TOKEN.match(token)
            if match is None:
                raise MpipeError(f"degrees '{text}': '{token}' is not a degree; write each as its name and value, "
                                 f"e.g. 'pp4 tp2 dp8' (names: {', '.join(NAMES)})")
            name = NAMES[match.group(1)]
            if name in values:
                raise MpipeError(f"degrees '{text}': {match.group(1)} is given twice; give each degree once")
            values[name] = int(match.group(2))
        if "pp" not in values:
            raise MpipeError(f"degrees '{text}': the pipeline degree is missing; write it first, e.g. 'pp4 tp1 dp2'")
        return cls(**values)
