"""Causal ring attention over a context-parallel group: each rank's queries meet every rank's keys.

Each of the ``cp`` ranks holds two chunks of the sequence (:class:`~mpipe_tune.runtime._sequence_split.ContextSplit`,
the load-balanced layout the cost model charges). The forward runs ``cp`` steps; at step ``t`` a rank
holds the keys and values of rank ``r - t`` and, while it computes their block, already sends them on
to rank ``r + 1`` and receives the next ones from rank ``r - 1`` (point-to-point, ``batch_isend_irecv``
on the group's own communicator): the ``cp - 1`` exchanges of ``ring_exchange_elems`` elements that
:func:`~mpipe_tune.cost._arch_pieces.attention` charges, overlapped with the compute as the cost model
assumes. Between chunks, causality is decided per chunk pair (an earlier chunk is seen whole, the
rank's own chunk with a causal mask, a later one not at all), so a rank computes only the blocks its
queries see; each block's output is merged into the running output with log-sum-exp weights (the
online softmax of flash attention).

The backward runs the same ring: the keys and values travel again, and each block's key and value
gradients are added into accumulators that travel with them, one step behind; after ``cp`` steps
every rank has received the full gradient of its own keys and values. Keys and values travel with
their own heads only (grouped-query attention repeats them per query head after they arrive).

The ring's messages use the context-parallel group's communicator and tags of their own, so they
never match a pipeline transfer (which use the world group). Every rank of a group runs its
decoder layers in the same order (they run the same pipeline rank's order on the same
microbatches), so the exchanges pair up.

This is our own ring over ``torch.distributed`` point-to-point rather than torch's experimental
``torch.distributed.tensor.experimental.context_parallel``: that one swaps ``scaled_dot_product_attention``
for DTensor dispatch and, in torch 2.13, supports the fused CUDA kernels (flash, efficient, cuDNN)
only, not the CPU and gloo on which the runtime's float64 equivalence tests run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpipe_tune.runtime._sequence_split import ContextSplit

_KV_TAG, _GRAD_TAG = 1, 2


@dataclass(frozen=True)
class Ring:
    """A rank's context-parallel group and its neighbours on the ring."""

    split: ContextSplit
    group: dist.ProcessGroup
    next_rank: int
    """Global rank of the ring's next member (``cp`` rank ``r + 1``)."""
    prev_rank: int
    """Global rank of the previous one (``cp`` rank ``r - 1``)."""

    def exchange(self, payload: torch.Tensor, recv_numel: int, tag: int) -> tuple[list[dist.Work], torch.Tensor]:
        """Send ``payload`` to the next rank and receive ``recv_numel`` elements from the previous one
        (non-blocking: wait on the works before reading the buffer)."""
        buffer = payload.new_empty(recv_numel)
        ops = [dist.P2POp(dist.isend, payload.contiguous(), self.next_rank, self.group, tag),
               dist.P2POp(dist.irecv, buffer, self.prev_rank, self.group, tag)]
        return dist.batch_isend_irecv(ops), buffer


@dataclass(frozen=True)
class RingCall:
    """One attention call's ring: the group and the length of the sequence it divides."""

    ring: Ring
    num_tokens: int


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, num_tokens: int,
                   scale: float) -> torch.Tensor:
    """Causal attention of this rank's ``q`` ``[rows, heads, qk_dim]`` over the whole sequence of
    ``num_tokens``, whose keys and values ``k`` ``[rows, kv_heads, qk_dim]`` and ``v`` ``[rows, kv_heads,
    v_dim]`` are held in shares by the ring's ranks (``kv_heads`` divides ``heads``; each key head serves
    ``heads / kv_heads`` consecutive query heads). Returns ``[rows, heads * v_dim]``, differentiable."""
    return _RingAttention.apply(q, k, v, ring, num_tokens, scale).reshape(q.shape[0], -1)


def _pieces(split: ContextSplit, num_tokens: int, src: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """For each of this rank's two chunks (its rows), the rows of rank ``src``'s keys it sees, and
    whether the piece needs the causal mask (the chunk itself)."""
    def local(rank: int) -> list[tuple[int, slice]]:
        (a0, a1), (b0, b1) = split.chunks(num_tokens, rank)
        early, late = split.chunk_indices(rank)
        return [(early, slice(0, a1 - a0)), (late, slice(a1 - a0, a1 - a0 + b1 - b0))]

    out = []
    for qi, q_rows in local(split.rank):
        seen = [(k_rows, qi == ki) for ki, k_rows in local(src) if ki <= qi and k_rows.stop > k_rows.start]
        if q_rows.stop > q_rows.start and seen:
            out.append((q_rows, seen))
    return out


def _gather(t: torch.Tensor, seen: list[tuple[slice, bool]]) -> torch.Tensor:
    return torch.cat([t[rows] for rows, _ in seen]) if len(seen) > 1 else t[seen[0][0]]


def _mask(num_q: int, seen: list[tuple[slice, bool]], device: torch.device) -> torch.Tensor | None:
    """``[num_q, keys]`` visibility: all of an earlier chunk, the lower triangle of the rank's own."""
    if not any(causal for _, causal in seen):
        return None
    parts = [torch.ones(num_q, rows.stop - rows.start, dtype=torch.bool, device=device) for rows, _ in seen]
    for part, (_, causal) in zip(parts, seen):
        if causal:
            part.tril_()
    return torch.cat(parts, dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``[heads, q, k]`` scaled scores, masked out to -inf; ``k`` already repeated to the query heads."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient ``[rows, heads, dim]`` of repeated key heads summed back to ``kv_heads``."""
    rows, heads, dim = t.shape
    return t if heads == kv_heads else t.view(rows, kv_heads, heads // kv_heads, dim).sum(2)


class _Block:
    """Keys and values of one ring member, packed for travel."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def pack(self) -> torch.Tensor:
        return torch.cat([self.k.reshape(-1), self.v.reshape(-1)])

    @staticmethod
    def numel(rows: int, k: torch.Tensor, v: torch.Tensor) -> int:
        return rows * (k.shape[1] * k.shape[2] + v.shape[1] * v.shape[2])

    @staticmethod
    def unpack(flat: torch.Tensor, rows: int, k: torch.Tensor, v: torch.Tensor) -> _Block:
        nk = rows * k.shape[1] * k.shape[2]
        return _Block(flat[:nk].view(rows, *k.shape[1:]), flat[nk:].view(rows, *v.shape[1:]))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, num_tokens: int, scale: float):
        split, c = ring.split, ring.split.degree
        heads = q.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((q.shape[0], heads, v.shape[2]), dtype=acc)
        lse = q.new_full((q.shape[0], heads), float("-inf"), dtype=acc)
        block, src = _Block(k, v), split.rank
        for step in range(c):
            if step < c - 1:  # the next block travels while this one is computed
                nxt = (src - 1) % c
                works, buffer = ring.exchange(block.pack(), _Block.numel(split.rows(num_tokens, nxt), k, v), _KV_TAG)
            for q_rows, seen in _pieces(split, num_tokens, src):
                mask = _mask(q_rows.stop - q_rows.start, seen, q.device)
                s = _scores(q[q_rows].to(acc), _repeat(_gather(block.k, seen), heads).to(acc), mask, scale)
                block_lse = torch.logsumexp(s, dim=-1).transpose(0, 1)  # [q, heads]
                p = torch.exp(s - block_lse.transpose(0, 1).unsqueeze(-1))
                o = torch.einsum("hqk,khd->qhd", p, _repeat(_gather(block.v, seen), heads).to(acc))
                merged = torch.logaddexp(lse[q_rows], block_lse)
                out[q_rows] = (out[q_rows] * torch.exp(lse[q_rows] - merged).unsqueeze(-1)
                               + o * torch.exp(block_lse - merged).unsqueeze(-1))
                lse[q_rows] = merged
            if step < c - 1:
                for w in works:
                    w.wait()
                block, src = _Block.unpack(buffer, split.rows(num_tokens, nxt), k, v), nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.num_tokens, ctx.scale = ring, num_tokens, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, num_tokens, scale = ctx.ring, ctx.num_tokens, ctx.scale
        split, c = ring.split, ring.split.degree
        heads, kv_heads = q.shape[1], k.shape[1]
        acc = lse.dtype
        qa, douta = q.to(acc), dout.to(acc)
        delta = (douta * out.to(acc)).sum(-1)  # [q, heads]
        dq = torch.zeros_like(qa)
        block, src = _Block(k, v), split.rank
        grads = _Block(torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
        for step in range(c):
            if step < c - 1:
                nxt = (src - 1) % c
                works, buffer = ring.exchange(block.pack(), _Block.numel(split.rows(num_tokens, nxt), k, v), _KV_TAG)
            for q_rows, seen in _pieces(split, num_tokens, src):
                mask = _mask(q_rows.stop - q_rows.start, seen, q.device)
                kk = _repeat(_gather(block.k, seen), heads).to(acc)
                vv = _repeat(_gather(block.v, seen), heads).to(acc)
                p = torch.exp(_scores(qa[q_rows], kk, mask, scale) - lse[q_rows].transpose(0, 1).unsqueeze(-1))
                dv = torch.einsum("hqk,qhd->khd", p, douta[q_rows])
                dp = torch.einsum("qhd,khd->hqk", douta[q_rows], vv)
                ds = p * (dp - delta[q_rows].transpose(0, 1).unsqueeze(-1))
                dq[q_rows] += torch.einsum("hqk,khd->qhd", ds, kk) * scale
                dk = torch.einsum("hqk,qhd->khd", ds, qa[q_rows]) * scale
                offset = 0
                for rows, _ in seen:  # back into the travelling accumulators, piece by piece
                    n = rows.stop - rows.start
                    grads.k[rows] += _fold(dk[offset:offset + n], kv_heads)
                    grads.v[rows] += _fold(dv[offset:offset + n], kv_heads)
                    offset += n
            # the accumulators follow their block to the next rank; the last pass brings each rank its own
            back = (src - 1) % c
            grad_works, grad_buffer = ring.exchange(grads.pack(), _Block.numel(split.rows(num_tokens, back), k, v),
                                                    _GRAD_TAG)
            for w in grad_works:
                w.wait()
            grads = _Block.unpack(grad_buffer, split.rows(num_tokens, back), k, v)
            if step < c - 1:
                for w in works:
                    w.wait()
                block, src = _Block.unpack(buffer, split.rows(num_tokens, nxt), k, v), nxt
        return dq.to(q.dtype), grads.k.to(k.dtype), grads.v.to(v.dtype), None, None, None
