"""ByMicrobatch owner policies for the transposed (Replicated) region.

Rank ``r`` runs the encodes of the microbatches it owns inside its warmup idle time ``w_r``; what
does not fit spills onto the critical path: ``spill_r = max(0, E_r - w_r)`` with ``E_r`` the sum of
its encode seconds (the paper's section 4.2). The owner map that minimises ``max_r spill_r`` is a
min-max balancing of encode work against per-rank slack. Three policies:

- ``round-robin``: microbatch ``m`` to rank ``m mod P`` (the authors' default; ignores costs);
- ``greedy``: heaviest encode first, each to the rank with the most slack left (longest-processing-
  time first with per-rank head starts), the paper's greedy form;
- ``optimal``: the exact minimiser, by depth-first branch and bound, for small ``P`` and ``M``.

All three read only per-microbatch encode seconds and per-rank slack seconds, so they are pure
functions of two vectors; :mod:`mpipe_tune.search.evaluate` reads both off a prediction.

>>> greedy_owners([4.0, 1.0, 3.0], [0.0, 2.0, 5.0])
(2, 2, 1)
>>> max_spill((2, 2, 1), [4.0, 1.0, 3.0], [0.0, 2.0, 5.0])
1.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mpipe_tune.algebra.placement import round_robin
from mpipe_tune.errors import MpipeError

POLICIES = ("round-robin", "greedy", "optimal")
OPTIMAL_MAX_NODES = 2_000_000
"""Search nodes after which :func:`optimal_owners` gives up (a user error: the instance is too big)."""


def rank_excess(owners: Sequence[int], encode_s: Sequence[float], slack_s: Sequence[float]) -> list[float]:
    """``E_r - w_r`` per rank (negative: unused slack)."""
    excess = [-float(w) for w in slack_s]
    for m, rank in enumerate(owners):
        excess[rank] += float(encode_s[m])
    return excess


def max_spill(owners: Sequence[int], encode_s: Sequence[float], slack_s: Sequence[float]) -> float:
    """``max_r max(0, E_r - w_r)``: the encode work the owner map leaves on the critical path."""
    return max(0.0, *rank_excess(owners, encode_s, slack_s))


def greedy_owners(encode_s: Sequence[float], slack_s: Sequence[float]) -> tuple[int, ...]:
    """Heaviest encode first, each to the rank with the most remaining slack (ties: lowest rank;
    equal encodes: lowest microbatch first)."""
    remaining = [float(w) for w in slack_s]
    owners = [0] * len(encode_s)
    for m in sorted(range(len(encode_s)), key=lambda m: (-encode_s[m], m)):
        rank = max(range(len(remaining)), key=lambda r: (remaining[r], -r))
        owners[m] = rank
        remaining[rank] -= float(encode_s[m])
    return tuple(owners)


def optimal_owners(
    encode_s: Sequence[float], slack_s: Sequence[float], *, max_nodes: int = OPTIMAL_MAX_NODES
) -> tuple[int, ...]:
    """The owner map minimising ``max_r (E_r - w_r)`` (hence ``max_r spill_r``), exactly.

    Depth-first branch and bound over microbatches in decreasing encode order, started from the
    greedy map as the incumbent. A branch is cut when its partial maximum already reaches the
    incumbent, or when even spreading the remaining work perfectly over the ranks' remaining
    slack cannot beat it. Ranks with equal load (slack included) are interchangeable, so only the
    first of them is tried. Exponential in the worst case: meant for small ``P`` and ``M``.
    """
    M, P = len(encode_s), len(slack_s)
    order = sorted(range(M), key=lambda m: (-encode_s[m], m))
    work = [float(encode_s[m]) for m in order]
    suffix = [0.0] * (M + 1)
    for i in reversed(range(M)):
        suffix[i] = suffix[i + 1] + work[i]
    greedy = greedy_owners(encode_s, slack_s)
    best_value = max(rank_excess(greedy, encode_s, slack_s))
    best = [greedy[m] for m in order]
    load = [-float(w) for w in slack_s]
    assign = [0] * M
    nodes = 0
    tolerance = 1e-12 * max(1.0, abs(best_value))

    def descend(i: int, current_max: float) -> None:
        nonlocal best_value, best, nodes
        nodes += 1
        if nodes > max_nodes:
            raise MpipeError(
                f"optimal owners: branch and bound gave up after {max_nodes} nodes for P={P}, M={M}; "
                f"use the 'greedy' owner policy for instances this large"
            )
        if i == M:
            if current_max < best_value - tolerance:
                best_value, best = current_max, assign[:]
            return
        # Lower bound: the remaining work cannot end below the level that fills every rank evenly.
        level = (sum(load) + suffix[i]) / P
        if max(current_max, level) >= best_value - tolerance:
            return
        tried = set()
        for r in sorted(range(P), key=lambda r: load[r]):
            if load[r] in tried:  # ranks with equal load are interchangeable from here on
                continue
            tried.add(load[r])
            new_load = load[r] + work[i]
            if max(current_max, new_load) >= best_value - tolerance:
                break  # ranks are sorted by load: every later one is at least as bad
            load[r] = new_load
            assign[i] = r
            descend(i + 1, max(current_max, new_load))
            load[r] -= work[i]

    descend(0, -math.inf)
    owners = [0] * M
    for position, m in enumerate(order):
        owners[m] = best[position]
    return tuple(owners)


def owners_for(policy: str, encode_s: Sequence[float], slack_s: Sequence[float]) -> tuple[int, ...]:
    """Apply a named policy (one of :data:`POLICIES`)."""
    if policy == "round-robin":
        return round_robin(len(encode_s), len(slack_s))
    if policy == "greedy":
        return greedy_owners(encode_s, slack_s)
    if policy == "optimal":
        return optimal_owners(encode_s, slack_s)
    raise MpipeError(f"owner policy '{policy}' is unknown; use one of {', '.join(POLICIES)}")
