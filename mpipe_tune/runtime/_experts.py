"""A MoE layer's routed experts, run in one process or sharded over an expert-parallel group.

Expert parallelism as the cost model charges it (:mod:`mpipe_tune.cost._arch_layers`, Megatron-Core's
all-to-all token dispatcher): each of the ``ep`` ranks of a group holds ``E / ep`` consecutive
experts (rank ``r`` experts ``r * E / ep ..``); the router and the shared experts stay replicated.
A forward permutes the router's choices into ``tokens * top_k`` rows sorted by expert (one copy of a
token per chosen expert), exchanges the per-expert row counts (an all-to-all of ``E`` integers),
sends each row to its expert's rank (the dispatch: ``all_to_all_single`` with the split sizes the
counts give), runs the local experts on the rows they received, sends the outputs back (the combine,
the same exchange reversed) and sums each token's rows weighted by its routing scores. The two
row exchanges are differentiable (torch's functional ``all_to_all_single_autograd``): the backward runs
the same two all-to-alls on the gradients.

Every rank of a group runs its MoE layers in the same order (they run the same plan's per-rank
order on their own microbatches), so the collectives pair up; a rank that receives no rows still
joins every exchange, forward and backward (its empty output stays on the autograd path).
With tensor parallelism every rank of a tp group dispatches the same rows within its own
expert-parallel group (``etp = tp``), and each expert runs split as a dense MLP does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place in an expert-parallel group."""

    group: dist.ProcessGroup
    rank: int
    """The rank within the group."""
    degree: int

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds."""
        per_rank = num_experts // self.degree
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def route_local(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleDict) -> torch.Tensor:
    """Every expert in this process, one after another: the weighted sum of each token's chosen experts."""
    out = torch.zeros_like(x)
    for key, expert in experts.items():
        token, slot = (chosen == int(key)).nonzero(as_tuple=True)
        if token.numel():
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot].unsqueeze(-1))
    return out


def route_parallel(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleDict,
                   num_experts: int, shard: ExpertShard) -> torch.Tensor:
    """The same sum with the experts sharded over ``shard``'s group: dispatch, local experts, combine."""
    top_k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=num_experts)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=shard.group)  # per source rank, rows for my experts
    per_rank = num_experts // shard.degree
    send_splits = counts.view(shard.degree, per_rank).sum(1).tolist()
    from_sources = received_counts.view(shard.degree, per_rank)
    recv_splits = from_sources.sum(1).tolist()
    rows = x[token_of]
    received = all_to_all_single_autograd(rows, recv_splits, send_splits, shard.group)  # waited for at first use
    pieces, offset = [], 0
    local = list(shard.experts(num_experts))
    for source in range(shard.degree):
        for j, e in enumerate(local):
            n = int(from_sources[source, j])
            if n:
                pieces.append(experts[str(e)](received[offset:offset + n]))
            offset += n
    outputs = torch.cat(pieces) if pieces else received * 0  # on the autograd path either way
    back = all_to_all_single_autograd(outputs, send_splits, recv_splits, shard.group)
    scores = weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, token_of, back * scores)
