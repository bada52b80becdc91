"""The (max,+) view of a step: per-phase transfer functions, composed along the schedule.

In the (max,+) semiring (``a ⊕ b = max(a, b)``, ``a ⊗ b = a + b``) an event's finish time is
``x_e = d_e ⊗ ⊕_{p → e} x_p``, a monotone linear map of its predecessors' finish times. Group the
events into phases that follow the schedule's composition: the transposed region's forwards, the
seam Gathers, the Sharded wavefront, the seam Scatters, the transposed region's backwards, then the
reduces and the barrier. Every edge runs from a phase to itself or a later one (per-rank Sequence
edges included: they carry each rank's free time across phases), so phase ``k`` is a transfer
function ``T_k(s) = A_k* ⊗ B_k ⊗ s``: ``B_k`` injects the finish times known so far (and the step's
start at time 0), ``A_k*`` is the (max,+) closure of the phase's internal edges. The step's finish
times are ``T_K ∘ ... ∘ T_1`` applied to the injection time 0, and the makespan is their maximum.

This computes the closure by (max,+) matrix products, an independent route from the topological
longest path of :mod:`mpipe_tune.cost.timing`; on every order the algebra builds the two agree.
Matrices are dense, so use it to check orders of a few hundred events, not in the search loop.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra.plan import Plan
from mpipe_tune.algebra.events import Bwd, Coll, Comm, DpReduce, Fwd, StepBarrier

NEG = -np.inf


def maxplus_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a ⊗ b)[i, j] = max_k a[i, k] + b[k, j]`` (in row blocks, to bound memory)."""
    out = np.empty((a.shape[0], b.shape[1]))
    rows = max(1, 2_000_000 // max(1, a.shape[1] * b.shape[1]))
    for lo in range(0, a.shape[0], rows):
        out[lo:lo + rows] = np.max(a[lo:lo + rows, :, None] + b[None, :, :], axis=1)
    return out


def maxplus_closure(a: np.ndarray) -> np.ndarray:
    """``A* = I ⊕ A ⊕ A² ⊕ ...`` for an acyclic weight matrix (``-inf`` where there is no edge)."""
    n = a.shape[0]
    star = np.full((n, n), NEG)
    np.fill_diagonal(star, 0.0)
    star = np.maximum(star, a)
    power = 1
    while power < n:  # (I ⊕ A)^(2^k) covers every path of up to 2^k edges
        star = maxplus_matmul(star, star)
        power *= 2
    return star


def phase_of(plan: Plan) -> list[int]:
    """Phase index of every event, in the schedule's composition order. An interior or sink transpose
    runs inside the wavefront, so its events and seam transfers are the wavefront's phase."""
    source = plan.source.region if plan.source else None
    phases = []
    for event in plan.order.events:
        if isinstance(event, Fwd) and event.region == source:
            phases.append(0)
        elif isinstance(event, Coll) and event.comm is Comm.GATHER and event.src[0] == source:
            phases.append(1)
        elif isinstance(event, Coll) and event.comm is Comm.SCATTER and event.dst[0] == source:
            phases.append(3)
        elif isinstance(event, Bwd) and event.region == source:
            phases.append(4)
        elif isinstance(event, (DpReduce, StepBarrier)):
            phases.append(5)
        else:
            phases.append(2)  # the wavefront: sharded Fwd/Bwd, Send/RecvGrad, Loss
    return phases


def makespan_maxplus(plan: Plan, durations: np.ndarray) -> float:
    """The step makespan by composing per-phase (max,+) transfer functions."""
    return float(finish_times_maxplus(plan, durations).max(initial=0.0))


def finish_times_maxplus(plan: Plan, durations: np.ndarray) -> np.ndarray:
    n = len(plan.order.events)
    phases = np.array(phase_of(plan))
    # State: finish time of every event (-inf until its phase runs) and, last, the step start (0).
    state = np.full(n + 1, NEG)
    state[n] = 0.0
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, t, _ in plan.order.edges:
        assert phases[s] <= phases[t], "an edge runs backwards through the composition"
        preds[t].append(s)
    for k in sorted(set(phases.tolist())):
        members = np.flatnonzero(phases == k)
        local = {e: i for i, e in enumerate(members)}
        size = len(members)
        inner = np.full((size, size), NEG)  # inner[i, j] = d_i if j -> i inside the phase
        inject = np.full((size, n + 1), NEG)  # inject[i, q] = d_i if q (earlier phase or start) -> i
        for e in members:
            i = local[e]
            d = durations[e]
            if not preds[e]:
                inject[i, n] = d
            for p in preds[e]:
                if p in local:
                    inner[i, local[p]] = d
                else:
                    inject[i, p] = d
        # x = inner ⊗ x ⊕ inject ⊗ s, whose least solution is inner* ⊗ inject ⊗ s.
        transfer = maxplus_matmul(maxplus_closure(inner), inject)
        state[members] = np.max(transfer + state[None, :], axis=1)
    return state[:n]
