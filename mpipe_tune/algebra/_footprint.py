"""The backward footprint (the paper's Lemma 1).

Order the units (regions, or the stages of a wavefront) input to loss as ``U1..Uk``. Then ``Uj``

(i)  sends its input-activation gradient upstream iff some unit before it is trainable;
(ii) receives a gradient from downstream iff it or some unit before it is trainable;
(iii) reduces weight gradients iff it is trainable.

The gates read trainable bits only, never skeletons (Corollary 1), so one schedule serves a frozen
and a trained encoder.

>>> footprint((False, True, True))
Footprint(sends_grad=(False, False, True), receives_grad=(False, True, True), reduces=(False, True, True))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Footprint:
    sends_grad: tuple[bool, ...]
    receives_grad: tuple[bool, ...]
    reduces: tuple[bool, ...]


def footprint(trainable: Sequence[bool]) -> Footprint:
    """Lemma 1's three gates for units with the given trainable bits, input to loss."""
    upto = tuple(accumulate(trainable, lambda a, b: a or b))  # some unit at or before j
    before = (False, *upto[:-1])  # some unit strictly before j
    return Footprint(sends_grad=before, receives_grad=upto, reduces=tuple(bool(t) for t in trainable))
