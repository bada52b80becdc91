"""Cuts, skeletons, schedules, and the normal form.

A cut ``c1 < ... < c(k-1)`` in ``(0, L)`` splits the model's layers into ``k`` regions; region ``j``
(1-based, as in the paper) holds layers ``[c(j-1), c(j))`` with ``c0 = 0`` and ``ck = L``. A schedule
gives one skeleton to each region. Normal form merges adjacent ``transpose`` regions (the seam between
two Replicated regions is the identity), dropping the cut boundary between them. A schedule is valid
when its cut tiles the model, it has one skeleton per region and it is in normal form.

>>> cut, sched = normalize(Cut((4, 6)), parse_schedule("transpose,transpose,1f1b"))
>>> cut.boundaries, str(sched)
((6,), 'transpose,1f1b')
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mpipe_tune.errors import MpipeError


class Layout(enum.Enum):
    SHARDED = "sharded"
    REPLICATED = "replicated"


class Skeleton(enum.Enum):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    TRANSPOSE = "transpose"
    ZB1P = "zb1p"
    """Zero bubble, ZB-H1 style: 1F1B's order with each backward split into an input-gradient and a
    weight-gradient event, the weight gradients deferred into the cooldown (torch's ZB1P)."""
    ZBV = "zbv"
    """Zero bubble, ZB-V style: two chunks in a V (the second chunk's stages on the ranks in reverse
    order, so the loss is on rank 0), backwards split as in ``zb1p`` (torch's ZBV)."""

    @property
    def layout(self) -> Layout:
        """``transpose`` is Replicated; ``1f1b``, ``gpipe``, ``zb1p`` and ``zbv`` are Sharded."""
        return Layout.REPLICATED if self is Skeleton.TRANSPOSE else Layout.SHARDED

    @property
    def splits_backward(self) -> bool:
        """Whether a trainable stage's backward runs as two events, input gradient (``Bwd``) then
        weight gradient (``Wgrad``): the zero-bubble skeletons."""
        return self in (Skeleton.ZB1P, Skeleton.ZBV)

    @property
    def runs_in_rounds(self) -> bool:
        """Whether several regions of it interleave in equal rounds of ``M // P`` microbatches (torch's
        rule, :func:`~mpipe_tune.algebra._order.is_interleavable`): ``1f1b`` and ``zb1p``."""
        return self in (Skeleton.ONE_F_ONE_B, Skeleton.ZB1P)

    @property
    def chunk_counts(self) -> tuple[int, ...] | None:
        """The numbers of woven regions it runs, None for any: ``zbv`` runs exactly two."""
        return (2,) if self is Skeleton.ZBV else None


@dataclass(frozen=True)
class Cut:
    """Interior boundaries, strictly increasing, counted in layers after ``repeat`` expansion."""

    boundaries: tuple[int, ...] = ()

    @property
    def num_regions(self) -> int:
        return len(self.boundaries) + 1

    def regions(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` layer intervals of regions 1..k."""
        edges = (0, *self.boundaries, num_layers)
        return tuple(zip(edges[:-1], edges[1:]))

    def __str__(self) -> str:
        return ",".join(map(str, self.boundaries))


@dataclass(frozen=True)
class Schedule:
    """One skeleton per region, input to loss."""

    skeletons: tuple[Skeleton, ...]

    def __str__(self) -> str:
        return ",".join(s.value for s in self.skeletons)

    def __len__(self) -> int:
        return len(self.skeletons)

    def layouts(self) -> tuple[Layout, ...]:
        return tuple(s.layout for s in self.skeletons)

    def is_normal(self) -> bool:
        """No two adjacent regions are both Replicated."""
        layouts = self.layouts()
        return not any(a is b is Layout.REPLICATED for a, b in zip(layouts, layouts[1:]))


def parse_schedule(text: str) -> Schedule:
    """Parse the CLI form ``"transpose,1f1b"``; unknown skeletons are a user error."""
    tokens = [t.strip() for t in str(text).split(",")]
    known = [s.value for s in Skeleton]
    skeletons = []
    for position, token in enumerate(tokens):
        if token not in known:
            raise MpipeError(
                f"schedule '{text}': skeleton {position + 1} is '{token}', which is not a skeleton; "
                f"use one of {', '.join(known)} (e.g. 'transpose,1f1b')"
            )
        skeletons.append(Skeleton(token))
    return Schedule(tuple(skeletons))


def parse_cut(text: str | None) -> Cut:
    """Parse ``"32"`` or ``"32,48"``; an empty string or None is the one-region cut."""
    if text is None or str(text).strip() == "":
        return Cut(())
    try:
        return Cut(tuple(int(t) for t in str(text).split(",")))
    except ValueError:
        raise MpipeError(f"cut '{text}': boundaries must be integers separated by commas, e.g. 32 or 32,48") from None


def validate_cut(cut: Cut, num_layers: int) -> None:
    """Raise unless the cut tiles a model of ``num_layers`` layers."""
    b = cut.boundaries
    for position, value in enumerate(b):
        if not 0 < value < num_layers:
            raise MpipeError(
                f"cut {cut}: boundary {position + 1} is {value}, but boundaries must lie in (0, {num_layers}) "
                f"for a model of {num_layers} layers (after expanding 'repeat')"
            )
    for position, (lo, hi) in enumerate(zip(b, b[1:])):
        if not lo < hi:
            raise MpipeError(
                f"cut {cut}: boundaries must increase strictly so that every region is non-empty, "
                f"but boundary {position + 1} is {lo} and boundary {position + 2} is {hi}"
            )


def validate_schedule(cut: Cut, schedule: Schedule, num_layers: int) -> None:
    """Raise unless ``(cut, schedule)`` is valid: the cut tiles, one skeleton per region, normal form."""
    validate_cut(cut, num_layers)
    if len(schedule) != cut.num_regions:
        raise MpipeError(
            f"schedule '{schedule}' has {len(schedule)} skeleton(s) but cut '{cut}' makes {cut.num_regions} region(s); "
            f"give one skeleton per region (a cut with n boundaries makes n+1 regions)"
        )
    if not schedule.is_normal():
        raise MpipeError(
            f"schedule '{schedule}' has adjacent transpose regions, which is not normal form; "
            f"merge them into one region (normalize) and drop the cut boundary between them"
        )


def normalize(cut: Cut, schedule: Schedule) -> tuple[Cut, Schedule]:
    """Merge adjacent ``transpose`` regions and drop the boundary between them. Idempotent."""
    assert len(schedule) == cut.num_regions, "normalize needs one skeleton per region"
    boundaries: list[int] = []
    skeletons = [schedule.skeletons[0]]
    for boundary, skeleton in zip(cut.boundaries, schedule.skeletons[1:]):
        if skeleton is Skeleton.TRANSPOSE and skeletons[-1] is Skeleton.TRANSPOSE:
            continue
        boundaries.append(boundary)
        skeletons.append(skeleton)
    return Cut(tuple(boundaries)), Schedule(tuple(skeletons))
