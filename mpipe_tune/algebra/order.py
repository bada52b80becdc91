"""Per-rank programs of a wavefront: which forward and backward each rank runs next.

A wavefront is one or more consecutive Sharded regions; each rank owns one slab of each, so it runs
``v`` virtual stages (chunks). A program is a list of ``(op, chunk, mb)`` with ``op`` in ``"F"``,
``"B"``; :func:`mpipe_tune.algebra.derive.derive` turns it into events.

- ``1f1b`` with v = 1 is Megatron-LM's non-interleaved schedule: rank r runs ``min(P-r-1, M)``
  warmup forwards, then alternates one forward and one backward, then drains the backwards.
- ``1f1b`` with v > 1 is Megatron-LM's interleaved schedule (M must be a multiple of P).
- ``gpipe`` runs every forward (chunk-major, microbatches in order), then every backward (last
  chunk first, microbatches in order).

>>> one_f_one_b(rank=0, num_ranks=2, num_microbatches=3)
[('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)]
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


def interleaved_one_f_one_b(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int) -> Program:
    """Megatron-LM's interleaved 1F1B; ``num_microbatches`` must be a multiple of ``num_ranks``."""
    P, M, v = num_ranks, num_microbatches, num_chunks
    assert M % P == 0, "interleaved 1F1B needs M to be a multiple of P"
    total = M * v
    if M == P:
        warmup = total
    else:
        warmup = min((P - rank - 1) * 2 + (v - 1) * P, total)

    def forward(k: int) -> tuple[str, int, int]:
        return ("F", (k % (P * v)) // P, (k // (P * v)) * P + k % P)

    def backward(k: int) -> tuple[str, int, int]:
        return ("B", v - 1 - (k % (P * v)) // P, (k // (P * v)) * P + k % P)

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
