"""Per-rank programs of a wavefront: which forward and backward each rank runs next.

A wavefront is one or more consecutive Sharded regions; each rank owns one slab of each, so it runs
``v`` virtual stages (chunks). A program is a list of ``(op, chunk, mb)`` with ``op`` in ``"F"``,
``"B"``; :func:`mpipe_tune.algebra.derive.derive` turns it into events.

- ``1f1b`` with v = 1 is Megatron-LM's non-interleaved schedule: rank r runs ``min(P-r-1, M)``
  warmup forwards, then alternates one forward and one backward, then drains the backwards.
- ``1f1b`` with v > 1 is interleaved 1F1B in rounds (torch's ``ScheduleInterleaved1F1B``): the
  microbatches run in ``max(1, M // P)`` rounds of ``g = M // rounds`` each (M must be a multiple of
  the round count); a rank runs ``g`` microbatches through chunk 0, then through chunk 1, ..., and
  its backwards likewise from the last chunk down. For M a multiple of P, ``g = P`` and this is
  Megatron-LM's interleaved schedule (core 0.10 and later: with M == P too the last ranks start
  alternating before every forward has run; core 0.9 and earlier ran all forwards first there).
- ``gpipe`` runs every forward (chunk-major, microbatches in order), then every backward (last
  chunk first, microbatches in order).

>>> one_f_one_b(rank=0, num_ranks=2, num_microbatches=3)
[('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)]
>>> interleaved_one_f_one_b(rank=1, num_ranks=2, num_microbatches=3, num_chunks=2)[:6]
[('F', 0, 0), ('F', 0, 1), ('F', 0, 2), ('F', 1, 0), ('B', 1, 0), ('F', 1, 1)]
"""

from __future__ import annotations

Program = list[tuple[str, int, int]]


def one_f_one_b(rank: int, num_ranks: int, num_microbatches: int) -> Program:
    warmup = min(num_ranks - rank - 1, num_microbatches)
    program: Program = [("F", 0, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        program.append(("F", 0, warmup + i))
        program.append(("B", 0, i))
    program.extend(("B", 0, m) for m in range(num_microbatches - warmup, num_microbatches))
    return program


def num_rounds(num_ranks: int, num_microbatches: int) -> int:
    """Rounds of interleaved 1F1B: ``max(1, M // P)``; each runs ``M // rounds`` microbatches.

    >>> num_rounds(4, 10), num_rounds(4, 3)
    (2, 1)
    """
    return max(1, num_microbatches // num_ranks)


def is_interleavable(num_ranks: int, num_microbatches: int) -> bool:
    """Whether interleaved 1F1B runs ``M`` microbatches on ``P`` ranks: M splits into equal rounds
    (torch's rule; every M below 2P and every multiple of P passes).

    >>> [m for m in range(1, 13) if is_interleavable(4, m)]
    [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    """
    return num_microbatches % num_rounds(num_ranks, num_microbatches) == 0


def interleaved_one_f_one_b(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int) -> Program:
    """Interleaved 1F1B in rounds of ``g`` microbatches (torch's ``ScheduleInterleaved1F1B``, and
    Megatron-LM's schedule when ``g = P``); ``M`` must pass :func:`is_interleavable`.

    Rank r runs ``(v-1)·g + 2·(P-r-1)`` warmup forwards (at most all ``M·v``), then alternates one
    forward and one backward, then drains the backwards.
    Forward k runs chunk ``(k // g) % v``; backward k runs chunk ``v-1 - (k // g) % v``; both take
    the microbatches of a chunk in increasing order.
    """
    P, M, v = num_ranks, num_microbatches, num_chunks
    assert is_interleavable(P, M), "interleaved 1F1B needs M to be a multiple of its rounds, max(1, M // P)"
    g = M // num_rounds(P, M)
    total = M * v
    warmup = min((v - 1) * g + 2 * (P - rank - 1), total)

    def microbatch(k: int) -> int:
        return (k // (g * v)) * g + k % g

    def forward(k: int) -> tuple[str, int, int]:
        return ("F", (k // g) % v, microbatch(k))

    def backward(k: int) -> tuple[str, int, int]:
        return ("B", v - 1 - (k // g) % v, microbatch(k))

    program: Program = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        program.append(forward(warmup + i))
        program.append(backward(i))
    program.extend(backward(k) for k in range(total - warmup, total))
    return program


def gpipe(num_microbatches: int, num_chunks: int) -> Program:
    program: Program = [("F", c, m) for c in range(num_chunks) for m in range(num_microbatches)]
    program.extend(("B", c, m) for c in reversed(range(num_chunks)) for m in range(num_microbatches))
    return program
