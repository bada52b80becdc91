"""Which tokens of a decoder sequence a context-parallel rank holds, as plain data (no torch).

Context parallelism divides every decoder layer's sequence over the ``cp`` ranks of a data replica
(:mod:`mpipe_tune.runtime._ring_attention` passes keys and values round them). Causal attention makes
a token's work grow with its position, so a contiguous split would give the last rank most of the
scores; the cost model charges every rank ``1/cp`` of them (:func:`~mpipe_tune.cost._arch_pieces.attention`),
which is the load-balanced layout of Megatron-LM's and torch's context parallelism: the sequence is
cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, one early and one
late. Chunk sizes differ by at most one token when ``cp`` does not divide the sequence (the first
``n % (2 * cp)`` chunks take one more), so no padding is needed: every rank computes any rank's
share from the sequence length alone.

>>> split = ContextSplit(degree=2, rank=0)
>>> split.chunks(10)
((0, 3), (7, 10))
>>> split.positions(10)
(0, 1, 2, 7, 8, 9)
>>> ContextSplit(degree=2, rank=1).positions(10)
(3, 4, 5, 6)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ContextSplit:
    degree: int
    """Context-parallel ranks the sequence is divided over."""
    rank: int
    """This rank's place among them."""

    def bounds(self, num_tokens: int) -> tuple[tuple[int, int], ...]:
        """The ``2 * degree`` chunks of a ``num_tokens`` sequence, ``[start, stop)`` in order."""
        parts = 2 * self.degree
        base, extra = divmod(num_tokens, parts)
        out, start = [], 0
        for i in range(parts):
            stop = start + base + (i < extra)
            out.append((start, stop))
            start = stop
        return tuple(out)

    def chunk_indices(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunks rank ``rank`` (default: this one) holds, early one first."""
        r = self.rank if rank is None else rank
        return r, 2 * self.degree - 1 - r

    def chunks(self, num_tokens: int, rank: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """``[start, stop)`` of the two chunks rank ``rank`` (default: this one) holds."""
        bounds = self.bounds(num_tokens)
        early, late = self.chunk_indices(rank)
        return bounds[early], bounds[late]

    def rows(self, num_tokens: int, rank: int | None = None) -> int:
        """How many of the sequence's tokens rank ``rank`` (default: this one) holds."""
        return sum(stop - start for start, stop in self.chunks(num_tokens, rank))

    def positions(self, num_tokens: int) -> tuple[int, ...]:
        """This rank's token positions, in the order its rows hold them."""
        return tuple(p for start, stop in self.chunks(num_tokens) for p in range(start, stop))
