"""MoE layers as the trainers run them: the dispatcher's collectives, the rows the experts see, the host syncs.

Megatron-Core's token dispatchers (``--moe-token-dispatcher-type``), per MoE layer and microbatch on one rank.
``T`` is the tokens of the rank's tensor-parallel group (the microbatch's, or a context-parallel rank's share),
``k`` the experts a token is routed to, ``E`` the experts over ``ep`` expert-parallel ranks, ``tp`` the
tensor-parallel degree (with it, sequence parallelism: a rank holds ``T / tp`` tokens outside the tensor-parallel
regions, as Megatron-Core requires for MoE with tp), expert parallelism outside tensor parallelism (an expert
group's ranks ``tp`` devices apart):

- ``alltoall`` (``MoEAlltoAllTokenDispatcher``): the rank permutes its ``T/tp * k`` rows into expert order and
  exchanges them with the ``ep`` ranks in one all-to-all; with ``tp > 1`` (the all-to-all with tensor
  parallelism) it then all-gathers its tensor-parallel group's rows, each rank's slice of an expert seeing all
  ``T * k`` of them; the experts run; a reduce-scatter over ``tp`` and an all-to-all back return the rows, which
  are un-permuted and weighted into token order.
- ``allgather`` (``MoEAllGatherTokenDispatcher``): the hidden states of the whole ``tp x ep`` group are
  all-gathered (``T * ep`` rows), the rank picks the rows of its local experts, runs them, scatters their outputs
  into the gathered buffer and reduce-scatters it over the group: its traffic is the group's tokens whatever
  ``k``.

The backward runs each collective's mirror (an all-to-all again, a reduce-scatter for an all-gather and the
reverse) on the gradients. Both read the per-expert token counts back to the host once per forward (the
all-to-all's splits, the grouped GEMM's batch sizes, or the sequential experts' split sizes): one
device-to-host sync that drains the device's queue. Before it, ``alltoall`` with ``ep > 1`` and routing that is
not padded to capacity exchanges each rank's per-expert counts over the expert-parallel group (``E`` int64s;
core_r0.6 all-gathers them over the group, later versions over ``tp x ep``, this project's runtime all-to-alls
them: :func:`count_exchange`), so that each rank knows what it will receive: a small collective, its latency
alone, in the forward only (the counts have no gradient; the backward reuses the splits). Padded to capacity
every split is known beforehand and nothing is exchanged.

Rows: dropless routing gives the busiest expert-parallel rank the stated imbalance times the mean; a capacity
factor ``c`` caps each expert at ``ceil(c * tokens * k / E)`` rows of each source (tokens beyond it dropped), and
padding to capacity (``--moe-pad-expert-input-to-capacity``) runs every expert at exactly its capacity, whatever
the routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpipe_tune.algebra import MOE_DISPATCHERS as DISPATCHERS
from mpipe_tune.cost._arch_pieces import Collective, minimum
from mpipe_tune.errors import MpipeError


@dataclass(frozen=True)
class MoeSettings:
    """How the trainer routes and dispatches tokens (the defaults: Megatron-Core's, dropless)."""

    dispatcher: str = "alltoall"
    """One of :data:`DISPATCHERS`."""
    capacity_factor: float | None = None
    """Expert capacity over the balanced share (``--moe-expert-capacity-factor``); None: dropless."""
    pad_to_capacity: bool = False
    """Every expert runs exactly its capacity rows (``--moe-pad-expert-input-to-capacity``); needs a capacity."""

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise MpipeError(f"MoE token dispatcher {self.dispatcher!r} is not one of {', '.join(DISPATCHERS)}; "
                             f"give Megatron-Core's --moe-token-dispatcher-type")
        if self.capacity_factor is not None and not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
            raise MpipeError(f"MoE capacity factor {self.capacity_factor!r} must be a number > 0; give the trainer's "
                             f"--moe-expert-capacity-factor, or none for dropless routing")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise MpipeError("MoE padding to capacity needs a capacity factor; give one, or drop the padding")


def expert_rows(tokens: float, top_k: int, experts: int, settings: MoeSettings, *, imbalance: float = 1.0,
                sources: int = 1) -> float:
    """Rows the busiest expert-parallel rank's local experts run, ``tokens`` routed by each of ``sources``
    ranks whose rows they all see (the tensor-parallel group's sequence shards under ``alltoall``) to ``top_k``
    of ``experts`` experts: the mean ``tokens * top_k * sources`` (a rank's ``E/ep`` experts receive, from its
    ``ep`` peers, one ``1/ep`` share each), times ``imbalance`` where dropless, capped at the capacity
    (``ceil(c * tokens * top_k / E)`` rows per expert and source), or exactly the capacity when padded.

    >>> expert_rows(4096, 2, 8, MoeSettings(), imbalance=1.3)
    10649.6
    >>> expert_rows(4096, 2, 8, MoeSettings(capacity_factor=1.0), imbalance=1.3)
    8192.0
    >>> expert_rows(4000, 2, 8, MoeSettings(capacity_factor=1.0, pad_to_capacity=True), sources=2)
    16000.0
    """
    mean = tokens * top_k * sources
    if settings.capacity_factor is None:
        return mean * imbalance
    capacity = np.ceil(settings.capacity_factor * tokens * top_k / experts) * experts * sources
    if np.isscalar(tokens):
        capacity = float(capacity)
    return capacity if settings.pad_to_capacity else minimum(mean * imbalance, capacity)


def dispatcher_gathers(tokens: float, hidden: int, rows: float, *, dispatcher: str, tp: int,
                       ep: int) -> tuple[Collective, ...]:
    """The forward gathers of one MoE layer's dispatch and combine on one rank, beyond the all-to-alls (see the
    module docstring; the combine's reduce-scatter written as the all-gather it mirrors): ``tokens`` the
    tensor-parallel group's tokens (``T``), ``rows`` the rows the rank's experts run (:func:`expert_rows`).
    Groups of one rank are left out.

    >>> [(c.kind, c.group, c.span) for c in dispatcher_gathers(4096, 8, 8192, dispatcher="alltoall", tp=2, ep=4)]
    [('all_gather', 2, 2), ('all_gather', 2, 2)]
    >>> [(c.group, c.elems) for c in dispatcher_gathers(4096, 8, 8192, dispatcher="allgather", tp=2, ep=4)]
    [(8, 131072), (8, 131072)]
    """
    if dispatcher == "allgather":
        group, elems = tp * ep, tokens * ep * hidden  # the group's hidden states; the combined outputs back
    else:
        assert dispatcher == "alltoall", dispatcher
        group, elems = tp, rows * hidden  # the tensor-parallel group's rows; their outputs back
    return () if group == 1 else (Collective("all_gather", group, group, elems),) * 2


COUNT_BYTES = 8
"""Bytes of one per-expert token count (an int64)."""


def count_exchange(experts: int, settings: MoeSettings, *, tp: int, ep: int, dtype_bytes: int) -> tuple[Collective, ...]:
    """The forward-only exchange of one MoE layer's per-expert token counts over its ``ep`` expert-parallel ranks
    (``tp`` devices apart), its size in elements of the step's ``dtype_bytes``-wide dtype (see the module
    docstring): ``alltoall`` dispatch with ``ep > 1`` and routing not padded to capacity; none otherwise.

    >>> [(c.kind, c.group, c.span, c.elems, c.forward_only)
    ...  for c in count_exchange(8, MoeSettings(), tp=2, ep=4, dtype_bytes=2)]
    [('all_to_all', 4, 8, 32.0, True)]
    >>> count_exchange(8, MoeSettings(dispatcher="allgather"), tp=1, ep=4, dtype_bytes=2)
    ()
    """
    if settings.dispatcher != "alltoall" or ep == 1 or settings.pad_to_capacity:
        return ()
    return (Collective("all_to_all", ep, tp * ep, experts * COUNT_BYTES / dtype_bytes, forward_only=True),)


def exchange_elems(rows: float, hidden: int, *, dispatcher: str, tp: int, ep: int) -> float:
    """Elements of the buffer one rank sends in each expert-parallel all-to-all (dispatch, combine):
    ``alltoall`` with ``ep > 1``, its sequence shard's share of the ``rows``; none otherwise."""
    return rows / tp * hidden if dispatcher == "alltoall" and ep > 1 else 0.0


@dataclass(frozen=True)
class Traffic:
    """Elements one rank's token-permutation kernels read and write in a MoE layer's forward (in the step's
    2-byte dtype: an fp32 element counts as two), and those its backward moves (None: a pointwise kernel's,
    what it kept, the output gradient and the input gradient)."""

    read: float
    write: float
    backward: float | None = None


def permutation_elems(tokens: float, top_k: int, hidden: int, *, dispatcher: str, ep: int, shards: int,
                      rows: float) -> tuple[Traffic, Traffic]:
    """The :class:`Traffic` of one MoE layer's permutation into expert order and of its un-permutation back into
    token order, on one rank: ``tokens`` the tensor-parallel group's (``T``), ``shards`` sequence parallelism's
    divisor of a rank's tokens, ``rows`` the rows the rank's experts run (:func:`expert_rows`, ``R``).

    ``alltoall``: the rank permutes its own ``T / shards`` tokens' ``k`` rows, and weights and sums them back.
    ``allgather`` as MindSpeed runs it (``allgather_token_permutation`` / ``_unpermutation``,
    mindspeed/core/transformer/moe/token_dispatcher.py at 4ea42a23, with ``--moe-permutation-async-comm``;
    Megatron-Core core_r0.6's dispatcher otherwise alike), on the ``G = T * ep`` tokens gathered over the
    ``tp x ep`` group: forward, the local experts' ``R`` rows picked (``global_hidden[map]``) and sorted
    (``local[indices]``), each a read and a write of every row; back, a zero buffer of the rows and an ``index_put``
    into it, the scaling by the router's weights, an fp32 zero buffer of the ``G`` tokens, the rows cast to fp32
    and added into it (``index_put`` with ``accumulate``: each target read and written) and the buffer cast back.
    Their backward (autograd's): the two picks' scatter-adds into zero buffers of ``R`` and ``G`` rows; the cast's,
    the ``index_select`` of the fp32 gradient, its cast, the scaling's two products and the gather of the sorted
    rows' gradient.

    >>> a, b = permutation_elems(8, 2, 4, dispatcher="alltoall", ep=1, shards=2, rows=16)
    >>> (a.read, a.write), (b.read, b.write), a.backward
    ((16.0, 32.0), (40.0, 16.0), None)
    >>> a, b = permutation_elems(8, 2, 4, dispatcher="allgather", ep=2, shards=1, rows=16)
    >>> (a.read, a.write, a.backward), (b.read, b.write, b.backward)
    ((128, 128, 512), (576, 640, 1024))
    """
    if dispatcher == "alltoall":
        routed = tokens * top_k / shards
        return (Traffic(tokens * hidden / shards, routed * hidden),
                Traffic(routed * (hidden + 1), tokens * hidden / shards))
    local, gathered = rows * hidden, tokens * ep * hidden
    return (Traffic(2 * local, 2 * local, 7 * local + gathered),
            Traffic(7 * local + 2 * gathered, 7 * local + 3 * gathered, 13 * local + 3 * gathered))


def host_syncs_per_forward(num_experts: int, dispatcher: str = "alltoall") -> int:
    """Device-to-host syncs of one MoE layer's forward; none for a layer without routed experts. Every dispatcher
    reads the per-expert counts back once; ``allgather`` also sizes three tensors by their data (core_r0.6 and
    MindSpeed 1.0.RC3: ``masked_select`` of the indices and of the probabilities, ``nonzero`` of the local mask),
    each a sync."""
    if num_experts <= 0:
        return 0
    return 4 if dispatcher == "allgather" else 1
