"""Placement: each region's layout and owner.

A Sharded region is owned ``ByLayer``: rank ``r`` holds the contiguous slab ``[start, stop)`` of the
region's layers. A Replicated region is owned ``ByMicrobatch``: microbatch ``m`` runs on rank
``owners[m]``, and every rank holds the whole region.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from mpipe_tune.algebra._schedule import Layout
from mpipe_tune.errors import MpipeError


@dataclass(frozen=True)
class ByLayer:
    slabs: tuple[tuple[int, int], ...]
    """Per rank, its slab ``(start, stop)`` in model layer indices."""

    def counts(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slabs)


@dataclass(frozen=True)
class ByMicrobatch:
    owners: tuple[int, ...]
    """Per microbatch, the rank that runs it."""

    def microbatches_of(self, rank: int) -> tuple[int, ...]:
        return tuple(m for m, r in enumerate(self.owners) if r == rank)


Owner = Union[ByLayer, ByMicrobatch]


@dataclass(frozen=True)
class RegionPlacement:
    region: int
    layers: tuple[int, int]
    layout: Layout
    owner: Owner


def round_robin(num_microbatches: int, num_ranks: int) -> tuple[int, ...]:
    """Microbatch ``m`` to rank ``m mod P`` (the authors' default owner map)."""
    return tuple(m % num_ranks for m in range(num_microbatches))


def balanced_counts(weights: Sequence[float], num_parts: int) -> tuple[int, ...]:
    """Layer counts of the contiguous partition of ``weights`` into ``num_parts`` non-empty slabs that
    minimises the largest slab weight (exact dynamic program, not greedy).

    >>> balanced_counts([1, 1, 1, 1, 4], 2)
    (4, 1)
    """
    n = len(weights)
    assert 1 <= num_parts <= n, "need at least one layer per part"
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=float))))
    # seg[j, i] = weight of layers [j, i), valid for j < i.
    seg = prefix[None, :] - prefix[:, None]
    invalid = np.tril(np.ones((n + 1, n + 1), dtype=bool))
    best = np.where(np.arange(n + 1) > 0, prefix, np.inf)  # one part covering [0, i)
    best[0] = np.inf
    choices = []
    for _ in range(1, num_parts):
        cand = np.maximum(best[:, None], seg)
        cand[invalid] = np.inf
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n + 1)]
        choices.append(arg)
    counts = []
    stop = n
    for arg in reversed(choices):
        start = int(arg[stop])
        counts.append(stop - start)
        stop = start
    counts.append(stop)
    return tuple(reversed(counts))


def slabs_from_counts(start: int, counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    slabs = []
    for count in counts:
        slabs.append((start, start + count))
        start += count
    return tuple(slabs)


def validate_owners(owners: Sequence[int], num_ranks: int, num_microbatches: int) -> None:
    if len(owners) != num_microbatches:
        raise MpipeError(
            f"the owner map lists {len(owners)} rank(s) but there are {num_microbatches} microbatches; "
            f"give one rank per microbatch (0-based), or use the round-robin owners"
        )
    for m, rank in enumerate(owners):
        if not 0 <= rank < num_ranks:
            raise MpipeError(
                f"owner map: microbatch {m} is owned by rank {rank}, but ranks are 0..{num_ranks - 1} for P={num_ranks}"
            )


def validate_counts(counts: Sequence[int], region: int, num_layers: int, num_ranks: int) -> None:
    if len(counts) != num_ranks or any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise MpipeError(
            f"slab counts for region {region}: got {list(counts)}, but need {num_ranks} counts >= 1 (one per rank) "
            f"summing to the region's {num_layers} layers"
        )
