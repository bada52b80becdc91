"""Per-rank programs of a wavefront: which forward and backward each rank runs next.

A wavefront is one or more consecutive Sharded regions; each rank owns one slab of each, so it runs
``v`` virtual stages (chunks). A program is a list of ``(op, chunk, mb)`` with ``op`` in ``"F"``,
``"B"`` and, for the zero-bubble skeletons, ``"W"`` (the weight-gradient half of a split backward,
whose ``"B"`` is then the input-gradient half); :func:`mpipe_tune.algebra._derive.derive` turns it
into events.

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
- ``zb1p`` (:func:`zero_bubble_h1`) is torch's ``ScheduleInterleavedZeroBubble`` (ZB1P, the ZB-H1
  schedule of Qi et al. 2024): the order of forwards and input-gradient backwards of 1F1B with
  ``P-r-1`` warmup forwards (plus ``(v-1)·g`` with v chunks), and rank r runs the weight gradient of
  its k-th backward right after its (k+r)-th backward, the last ``r`` of them at the end.
- ``zbv`` (:func:`zero_bubble_v`) is torch's ``ScheduleZBVZeroBubble`` (the ZB-V schedule): two
  chunks, chunk 1 placed in reverse (rank r runs stages r and 2P-1-r).

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
    return _in_rounds(P, M, v, warmup=(v - 1) * g + 2 * (P - rank - 1), weight_delay=None)


def _in_rounds(P: int, M: int, v: int, warmup: int, weight_delay: int | None) -> Program:
    """``warmup`` forwards (at most all ``M·v``), then one forward (while any is left) and one backward
    at a time. Forward k runs chunk ``(k // g) % v``, backward k chunk ``v-1 - (k // g) % v``, each
    chunk's microbatches in increasing order (``g`` microbatches a round). With a ``weight_delay`` d
    the backwards are split: the weight gradient of backward k runs right after backward k+d, those of
    the last d backwards at the end."""
    g = M // num_rounds(P, M) if v > 1 else M
    total = M * v
    warmup = min(warmup, total)

    def step(op: str, chunk: int, k: int) -> tuple[str, int, int]:
        return (op, chunk, (k // (g * v)) * g + k % g)

    program: Program = [step("F", (k // g) % v, k) for k in range(warmup)]
    backwards = [step("B", v - 1 - (k // g) % v, k) for k in range(total)]
    for k, backward in enumerate(backwards):
        if warmup + k < total:
            program.append(step("F", ((warmup + k) // g) % v, warmup + k))
        program.append(backward)
        if weight_delay is not None and k >= weight_delay:
            program.append(("W", *backwards[k - weight_delay][1:]))
    if weight_delay is not None:
        program.extend(("W", *b[1:]) for b in backwards[max(0, total - weight_delay):])
    return program


def zero_bubble_h1(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Program:
    """ZB-H1 (torch's ZB1P): 1F1B's forwards and input-gradient backwards with ``(v-1)·g + P-r-1``
    warmup forwards, and rank r's weight gradients each ``r`` backwards late, so that the last ranks,
    idle at the end of 1F1B, fill their cooldown with deferred weight gradients while holding no more
    microbatches' activations than 1F1B's first rank does (``P``). With ``v > 1`` chunks ``M`` must
    pass :func:`is_interleavable`.

    >>> zero_bubble_h1(rank=1, num_ranks=2, num_microbatches=3)
    [('F', 0, 0), ('B', 0, 0), ('F', 0, 1), ('B', 0, 1), ('W', 0, 0), ('F', 0, 2), ('B', 0, 2), ('W', 0, 1), ('W', 0, 2)]
    """
    P, M, v = num_ranks, num_microbatches, num_chunks
    assert v == 1 or is_interleavable(P, M), "zero bubble with chunks needs M to be a multiple of max(1, M // P)"
    g = M // num_rounds(P, M)
    return _in_rounds(P, M, v, warmup=(v - 1) * g + P - rank - 1, weight_delay=rank)


def zero_bubble_v(rank: int, num_ranks: int, num_microbatches: int) -> Program:
    """ZB-V (torch's ``ScheduleZBVZeroBubble``): two chunks, rank r holding stage r of chunk 0 and stage
    2P-1-r of chunk 1. The program is written for ``n = max(2P-1, M)`` microbatches and those of
    index ``M`` or more are dropped:

    1. warmup: ``2(P-r)-1`` forwards of chunk 0; ``r`` times a forward of chunk 1 then of chunk 0;
       ``P-r`` times forward, input gradient and weight gradient of chunk 1;
    2. steady state, until every forward has run: a forward of chunk 0 (while any is left), the input
       and weight gradients of chunk 0, then forward, input and weight gradient of chunk 1;
    3. cooldown: ``r`` times the input gradients of chunk 0 and chunk 1; ``P-r`` times input and
       weight gradient of chunk 0; then every weight gradient left, chunk 1's first.

    >>> [f"{op}{chunk}.{mb}" for op, chunk, mb in zero_bubble_v(rank=1, num_ranks=2, num_microbatches=3)]
    ['F0.0', 'F1.0', 'F0.1', 'F1.1', 'B1.0', 'W1.0', 'F0.2', 'B0.0', 'W0.0', 'F1.2', 'B1.1', 'W1.1', 'B0.1', 'B1.2', 'B0.2', 'W0.1', 'W1.2', 'W0.2']
    """
    P, M = num_ranks, num_microbatches
    n = max(2 * P - 1, M)
    count = {(op, chunk): 0 for op in "FBW" for chunk in (0, 1)}
    program: Program = []

    def run(*steps: tuple[str, int]) -> None:
        for op, chunk in steps:
            program.append((op, chunk, count[(op, chunk)]))
            count[(op, chunk)] += 1

    run(*[("F", 0)] * (2 * (P - rank) - 1))
    run(*[("F", 1), ("F", 0)] * rank)
    run(*[("F", 1), ("B", 1), ("W", 1)] * (P - rank))
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            run(("F", 0))
        run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    run(*[("B", 0), ("B", 1)] * rank)
    run(*[("B", 0), ("W", 0)] * (P - rank))
    run(*[("W", 1)] * (count[("B", 1)] - count[("W", 1)]))
    run(*[("W", 0)] * (count[("B", 0)] - count[("W", 0)]))
    return [step for step in program if step[2] < M]


def gpipe(num_microbatches: int, num_chunks: int) -> Program:
    program: Program = [("F", c, m) for c in range(num_chunks) for m in range(num_microbatches)]
    program.extend(("B", c, m) for c in reversed(range(num_chunks)) for m in range(num_microbatches))
    return program
