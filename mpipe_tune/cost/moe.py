"""MoE layers as the trainers run them: the dispatcher's collectives, the rows the experts see, the host syncs.

Megatron-Core's token dispatchers (``--moe-token-dispatcher-type``), per MoE layer and microbatch on one rank.
``T`` is the tokens of the rank's tensor-parallel group (the microbatch's, or a context-parallel rank's share),
``k`` the experts a token is routed to, ``E`` the experts over ``ep`` expert-parallel ranks, ``tp`` the
tensor-parallel degree (with it, sequence parallelism: a rank holds ``T / tp`` tokens outside the tensor-parallel
regions, as Megatron-Core requires for MoE with tp):

- ``alltoall`` (``MoEAlltoAllTokenDispatcher``): the rank permutes its ``T/tp * k`` rows into expert order,
  exchanges them with the ``ep`` ranks in one all-to-all and, with ``tp > 1``, all-gathers its tensor-parallel
  group's rows (each rank's slice of an expert then sees all ``T * k`` of them); the experts run; a reduce-scatter
  over ``tp`` and an all-to-all back return the rows, which are un-permuted and weighted into token order.
- ``allgather`` (``MoEAllGatherTokenDispatcher``): the hidden states of the whole ``tp x ep`` group are
  all-gathered (``T * ep`` rows), the rank picks the rows of its local experts, runs them, scatters their outputs
  into the gathered buffer and reduce-scatters it over the group.
- ``alltoall_seq`` (the sequence-parallel all-to-all, MindSpeed's and Megatron-Core 0.8's ``alltoall_seq``): one
  all-to-all over the ``tp x ep`` group exchanges each rank's ``T/tp * k`` rows, no tensor-parallel gather; each
  rank's expert slice sees the rows of its ``ep`` peers only, so the experts are not split over ``tp``.

The backward runs each collective's mirror (an all-to-all again, a reduce-scatter for an all-gather and the reverse)
on the gradients. Every dispatcher reads the per-expert token counts back to the host once per forward (the
all-to-all's splits, the grouped GEMM's batch sizes, or the sequential experts' split sizes): one device-to-host
sync that drains the device's queue.

Rows: dropless routing gives the busiest rank ``moe_imbalance`` times the mean; a capacity factor ``c`` caps each
expert at ``ceil(c * tokens * k / E)`` rows of each source (tokens beyond it dropped), and padding to capacity
(``--moe-pad-expert-input-to-capacity``) runs every expert at exactly its capacity, whatever the routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpipe_tune.errors import MpipeError

DISPATCHERS = ("alltoall", "allgather", "alltoall_seq")
"""Megatron-Core's ``--moe-token-dispatcher-type`` values the cost model runs (its default first)."""


@dataclass(frozen=True)
class MoeSettings:
    """How the trainer routes and dispatches tokens (the defaults: Megatron-Core's, dropless)."""

    dispatcher: str = "alltoall"
    """One of :data:`DISPATCHERS`."""
    capacity_factor: float | None = None
    """Expert capacity over the balanced share (``--moe-expert-capacity-factor``); None: dropless."""
    pad_to_capacity: bool = False
    """Every expert runs exactly its capacity rows (``--moe-pad-expert-input-to-capacity``); needs a capacity."""
    imbalance: float = 1.0
    """Routed rows on the busiest expert-parallel rank over the mean (>= 1), where routing is dropless."""

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise MpipeError(f"MoE token dispatcher {self.dispatcher!r} is not one of {', '.join(DISPATCHERS)}; "
                             f"give Megatron-Core's --moe-token-dispatcher-type")
        if self.capacity_factor is not None and not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
            raise MpipeError(f"MoE capacity factor {self.capacity_factor!r} must be a number > 0; give the trainer's "
                             f"--moe-expert-capacity-factor, or none for dropless routing")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise MpipeError("MoE padding to capacity needs a capacity factor; give one, or drop the padding")
        if not (math.isfinite(self.imbalance) and self.imbalance >= 1):
            raise MpipeError(f"MoE imbalance {self.imbalance!r} must be a number >= 1 (the busiest rank's routed rows "
                             f"over the mean; 1 for balanced routing)")


@dataclass(frozen=True)
class Collective:
    """One forward collective of a dispatcher: ``kind`` over ``group`` ranks that lie within ``span``
    consecutive devices, on a buffer of ``elems`` elements (the gathered or reduced buffer for an all-gather and
    a reduce-scatter, each rank's send buffer for an all-to-all, as
    :func:`~mpipe_tune.cost.profile.estimate_collective_s` takes them)."""

    kind: str
    group: int
    span: int
    elems: float


def expert_rows(tokens: float, top_k: int, experts: int, settings: MoeSettings, *, sources: int = 1) -> float:
    """Rows the busiest expert-parallel rank's local experts run, ``tokens`` routed by each of ``sources``
    ranks whose rows they all see (the tensor-parallel group's sequence shards under ``alltoall``) to ``top_k``
    of ``experts`` experts: the mean ``tokens * top_k * sources`` (a rank's ``E/ep`` experts receive, from its
    ``ep`` peers, one ``1/ep`` share each), times the imbalance where dropless, capped at the capacity
    (``ceil(c * tokens * top_k / E)`` rows per expert and source), or exactly the capacity when padded.

    >>> expert_rows(4096, 2, 8, MoeSettings(imbalance=1.3))
    10649.6
    >>> expert_rows(4096, 2, 8, MoeSettings(capacity_factor=1.0, imbalance=1.3))
    8192.0
    >>> expert_rows(4000, 2, 8, MoeSettings(capacity_factor=1.0, pad_to_capacity=True), sources=2)
    16000.0
    """
    mean = tokens * top_k * sources
    if settings.capacity_factor is None:
        return mean * settings.imbalance
    capacity = math.ceil(settings.capacity_factor * tokens * top_k / experts) * experts * sources
    return float(capacity) if settings.pad_to_capacity else min(mean * settings.imbalance, float(capacity))


def dispatcher_collectives(tokens: float, hidden: int, rows: float, *, dispatcher: str, tp: int,
                           ep: int) -> tuple[Collective, ...]:
    """The forward collectives of one MoE layer's dispatch and combine on one rank (see the module docstring):
    ``tokens`` the tensor-parallel group's tokens (``T``), ``rows`` the rows the rank's experts run (what it
    receives: :func:`expert_rows` of its group), expert parallelism innermost after tensor parallelism (the
    ``ep`` ranks of an expert group ``tp`` devices apart). Groups of one rank are left out.

    >>> [(c.kind, c.group, c.span) for c in dispatcher_collectives(4096, 8, 8192, dispatcher="alltoall", tp=2, ep=4)]
    [('all_to_all', 4, 8), ('all_gather', 2, 2), ('all_gather', 2, 2), ('all_to_all', 4, 8)]
    >>> [(c.kind, c.group, c.elems) for c in dispatcher_collectives(4096, 8, 8192, dispatcher="allgather", tp=2, ep=4)]
    [('all_gather', 8, 131072), ('all_gather', 8, 131072)]
    """
    out: list[Collective] = []
    if dispatcher == "allgather":
        group = tp * ep
        if group > 1:  # the gather of the group's hidden states, and the reduce-scatter of the combined outputs
            gathered = tokens * ep * hidden
            out = [Collective("all_gather", group, group, gathered), Collective("all_gather", group, group, gathered)]
        return tuple(out)
    if dispatcher == "alltoall_seq":
        group = tp * ep
        if group > 1:
            exchange = rows / ep * hidden  # each rank's send buffer: its own rows before the exchange
            out = [Collective("all_to_all", group, group, exchange), Collective("all_to_all", group, group, exchange)]
        return tuple(out)
    assert dispatcher == "alltoall", dispatcher
    per_rank_rows = rows / tp  # before the tensor-parallel gather each rank holds its sequence shard's rows
    if ep > 1:
        out.append(Collective("all_to_all", ep, tp * ep, per_rank_rows * hidden))
    if tp > 1:  # the gather of the tensor-parallel group's rows, and the reduce-scatter back
        out += [Collective("all_gather", tp, tp, rows * hidden), Collective("all_gather", tp, tp, rows * hidden)]
    if ep > 1:
        out.append(Collective("all_to_all", ep, tp * ep, per_rank_rows * hidden))
    return tuple(out)


def expert_split(dispatcher: str, tp: int) -> int:
    """Ranks one expert's weights are split over: ``tp``, but 1 under ``alltoall_seq`` (each rank keeps whole
    experts and sees its own rows)."""
    return 1 if dispatcher == "alltoall_seq" else tp


def host_syncs_per_forward(num_experts: int) -> int:
    """Device-to-host syncs of one MoE layer's forward: the per-expert counts read back once (every dispatcher);
    none for a layer without routed experts."""
    return 1 if num_experts > 0 else 0
