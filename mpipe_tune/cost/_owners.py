"""ByMicrobatch owner policies for the transposed (Replicated) region, and what they read.

Rank ``r`` runs the encodes of the microbatches it owns inside its warmup idle time ``w_r``; what
does not fit spills onto the critical path: ``spill_r = max(0, E_r - w_r)`` with ``E_r`` the sum of
its encode seconds (the paper's section 4.2). The owner map that minimises ``max_r spill_r`` is a
min-max balancing of encode work against per-rank slack. Three policies:

- ``round-robin``: microbatch ``m`` to rank ``m mod P`` (the authors' default; ignores costs);
- ``greedy``: heaviest encode first, each to the rank with the most slack left (longest-processing-
  time first with per-rank head starts), the paper's greedy form;
- ``optimal``: the exact minimiser, by depth-first branch and bound, for small ``P`` and ``M``.

All three read only per-microbatch encode seconds and per-rank slack seconds, so they are pure
functions of two vectors. Both are read off the cost model for one step: :func:`encode_seconds` from
the step's layer table, the slack from the timeline of the step's round-robin plan (the slack does
not depend on who encodes). :meth:`mpipe_tune.cost._predictor.Predictor.owners` does the whole of it
for one candidate and one step, for the search's evaluator and the runtime (which chooses each step's
owners from the step's metadata) alike.

At run time a step's map must be ready before the step starts, so the runtime asks for
:func:`choose_owners` with ``fallback=True``: ``optimal`` then searches at most
:data:`RUNTIME_OPTIMAL_MAX_NODES` branch-and-bound nodes and, past them, runs the step with the
greedy map (:attr:`OwnerChoice.policy` says which one it got).

>>> greedy_owners([4.0, 1.0, 3.0], [0.0, 2.0, 5.0])
(2, 2, 1)
>>> max_spill((2, 2, 1), [4.0, 1.0, 3.0], [0.0, 2.0, 5.0])
1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import ROUND_ROBIN, round_robin
from mpipe_tune.cost import _kernels as kernels
from mpipe_tune.errors import MpipeError

POLICIES = (ROUND_ROBIN, "greedy", "optimal")
OPTIMAL_MAX_NODES = 2_000_000
"""Search nodes after which :func:`optimal_owners` gives up (a user error: the instance is too big)."""
PYTHON_MAX_NODES = 10_000
"""Search nodes the branch and bound may take as Python (:mod:`mpipe_tune.jit`); a search that needs
more is run again, compiled, with the full budget (the same walk: the same result)."""
RUNTIME_OPTIMAL_MAX_NODES = 40
"""Search nodes the runtime's ``optimal`` may spend on one step before it takes the greedy map. On
the benchmark's instances a larger budget (200, 1000) finished no more of them, and with 40 a step's
map takes well under a millisecond at P = 64, M = 512 (``benchmarks/bench_step_owners.py``)."""


@dataclass(frozen=True)
class OwnerChoice:
    """One step's owner map and the policy that made it."""

    owners: tuple[int, ...]
    """Rank of microbatch 0, 1, ..."""
    policy: str
    """The policy asked for, or ``greedy`` when ``optimal`` gave up within its node budget."""


def rank_excess(owners: Sequence[int], encode_s: Sequence[float], slack_s: Sequence[float]) -> list[float]:
    """``E_r - w_r`` per rank (negative: unused slack)."""
    excess = [-float(w) for w in slack_s]
    for m, rank in enumerate(owners):
        excess[rank] += float(encode_s[m])
    return excess


def max_spill(owners: Sequence[int], encode_s: Sequence[float], slack_s: Sequence[float]) -> float:
    """``max_r max(0, E_r - w_r)``: the encode work the owner map leaves on the critical path."""
    return max(0.0, *rank_excess(owners, encode_s, slack_s))


def _vectors(encode_s: Sequence[float], slack_s: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The encodes and slack as float arrays, and the microbatches heaviest first (equal encodes in
    increasing index: a stable sort)."""
    encode = np.array(encode_s, dtype=float).reshape(-1)
    return encode, np.array(slack_s, dtype=float).reshape(-1), np.argsort(-encode, kind="stable")


def greedy_owners(encode_s: Sequence[float], slack_s: Sequence[float]) -> tuple[int, ...]:
    """Heaviest encode first, each to the rank with the most remaining slack (ties: lowest rank;
    equal encodes: lowest microbatch first). A compiled loop
    (:func:`mpipe_tune.cost._kernels.greedy_owners`): microseconds at P = 64, M = 512."""
    encode, slack, order = _vectors(encode_s, slack_s)
    out = np.zeros(len(encode), dtype=np.int64)
    kernels.greedy_owners(encode, slack, order, out)
    return tuple(out.tolist())


def optimal_owners(
    encode_s: Sequence[float], slack_s: Sequence[float], *, max_nodes: int = OPTIMAL_MAX_NODES
) -> tuple[int, ...]:
    """The owner map minimising ``max_r (E_r - w_r)`` (hence ``max_r spill_r``), exactly.

    Depth-first branch and bound over microbatches in decreasing encode order, started from the
    greedy map as the incumbent. A branch is cut when its partial maximum already reaches the
    incumbent, or when even spreading the remaining work perfectly over the ranks' remaining
    slack cannot beat it. Ranks with equal load (slack included) are interchangeable, so only the
    first of them is tried. Exponential in the worst case: meant for small ``P`` and ``M``; past
    ``max_nodes`` search nodes it gives up with a one-line error. The walk is a compiled loop
    (:func:`mpipe_tune.cost._kernels.owners_branch_and_bound`).
    """
    owners = _branch_and_bound(encode_s, slack_s, greedy_owners(encode_s, slack_s), max_nodes)
    if owners is None:
        raise MpipeError(
            f"optimal owners: branch and bound gave up after {max_nodes} nodes for P={len(slack_s)}, "
            f"M={len(encode_s)}; use the 'greedy' owner policy for instances this large"
        )
    return owners


def _branch_and_bound(encode_s: Sequence[float], slack_s: Sequence[float], greedy: tuple[int, ...],
                      max_nodes: int) -> tuple[int, ...] | None:
    """:func:`optimal_owners`' search from the incumbent ``greedy``; None past ``max_nodes`` nodes."""
    encode, slack, order = _vectors(encode_s, slack_s)
    incumbent = np.array(greedy, dtype=np.int64).reshape(-1)
    out = np.zeros(len(encode), dtype=np.int64)
    walk = kernels.owners_branch_and_bound
    limit = max_nodes if walk.uses_compiled((encode,)) else min(max_nodes, PYTHON_MAX_NODES)
    gave_up = walk(encode, slack, order, incumbent, limit, out)
    if gave_up and limit < max_nodes:
        gave_up = walk.compiled(encode, slack, order, incumbent, max_nodes, out)
    return None if gave_up else tuple(out.tolist())


def choose_owners(policy: str, encode_s: Sequence[float], slack_s: Sequence[float], *,
                  fallback: bool = False) -> OwnerChoice:
    """Apply a named policy (one of :data:`POLICIES`). With ``fallback`` (the runtime's), ``optimal``
    searches at most :data:`RUNTIME_OPTIMAL_MAX_NODES` nodes and then takes the greedy map; without
    it, it searches up to :data:`OPTIMAL_MAX_NODES` and then fails with one line."""
    if policy == ROUND_ROBIN:
        return OwnerChoice(round_robin(len(encode_s), len(slack_s)), policy)
    if policy == "greedy":
        return OwnerChoice(greedy_owners(encode_s, slack_s), policy)
    if policy == "optimal":
        if not fallback:
            return OwnerChoice(optimal_owners(encode_s, slack_s), policy)
        greedy = greedy_owners(encode_s, slack_s)
        exact = _branch_and_bound(encode_s, slack_s, greedy, RUNTIME_OPTIMAL_MAX_NODES)
        return OwnerChoice(greedy, "greedy") if exact is None else OwnerChoice(exact, policy)
    raise MpipeError(f"owner policy '{policy}' is unknown; use one of {', '.join(POLICIES)}")


def owners_for(policy: str, encode_s: Sequence[float], slack_s: Sequence[float]) -> tuple[int, ...]:
    """Apply a named policy (one of :data:`POLICIES`), exactly (:func:`choose_owners`)."""
    return choose_owners(policy, encode_s, slack_s).owners


def encode_seconds(fwd_s: np.ndarray, replicated: Sequence[tuple[int, int]]) -> np.ndarray:
    """Owned forward seconds of each microbatch: the per-layer, per-microbatch forward seconds
    ``fwd_s`` of a layer table summed over the layers ``[start, stop)`` of every transposed region
    (the encoder, and any interior or sink transpose: they share the owner map)."""
    return sum(fwd_s[start:stop].sum(axis=0) for start, stop in replicated)
