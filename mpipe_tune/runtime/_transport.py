"""Point-to-point transfers of one rank: non-blocking sends, receives posted in the sender's order.

- A transfer between two stages on the same rank is a local hand-off (no communication).
- Sends are ``isend``: the sender never blocks; handles (and their tensors) are kept until
  :meth:`Transport.finish` at the step barrier.
- Receives are posted per source rank in the order that source issues its sends (read off the plan:
  the source's event order, each event's sends by event index). NCCL matches point-to-point messages
  of a pair in issue order, ignoring tags; posting in the sender's order makes every backend match
  the right message to the right buffer. Gloo also gets the Coll's event index as tag.
- ``rank`` is the pipeline rank whose order this process runs; ``peer`` maps a pipeline rank to the
  global rank of the same (dp, tp) coordinate, so each data and tensor-parallel coordinate runs its
  own copy of the pipeline's transfers.
- Both ends know every payload's shape (from the workload); an empty payload (a microbatch without
  images crossing an image-stream seam) is not sent at all.
- A step may run another view of the plan (:meth:`Transport.begin_step`: another owner map, other
  microbatches); ``pairs`` then names every rank pair any step may use, so that :meth:`Transport.connect`
  opens them all before the first step.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mpipe_tune.runtime._plan_view import PlanView, Transfer, rank_pairs


class Transport:
    def __init__(
        self,
        view: PlanView,
        rank: int,
        *,
        shape_of: Callable[[PlanView, Transfer], tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        peer: Callable[[int], int] = lambda pp_rank: pp_rank,
        link_delay_s: Callable[[PlanView, Transfer], float] | None = None,
        pairs: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """``shape_of(view, t)``: the payload's shape in the current step's view. ``link_delay_s``
        (emulation): the payload is the sender's clock, and a receive returns no earlier than that
        time plus the transfer's delay in the current view, as the cost model's link would.
        ``pairs``: the (low, high) rank pairs to connect (default: those of ``view``)."""
        self.view = view
        self.rank = rank
        self.peer = peer
        self.shape_of = shape_of
        self.dtype = dtype
        self.device = device
        self.link_delay_s = link_delay_s
        self._mailbox: dict[int, torch.Tensor | None] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self._pairs = sorted(pairs if pairs is not None else rank_pairs(view))
        self._queues = self._incoming_queues(view)

    def begin_step(self, view: PlanView) -> None:
        """A new step of ``view``: its receives are posted in its senders' orders."""
        assert not self._sends and not self._posted and not self._mailbox, "a step began before the last one finished"
        self.view = view
        self._queues = self._incoming_queues(view)

    def connect(self) -> None:
        """Open every rank pair that exchanges transfers, one pair at a time in one global order.

        NCCL and HCCL create a pair's communicator on its first message and block until both ends
        join; opening them here, in an order every rank agrees on, keeps that first message from
        deadlocking inside a step. (Gloo is connected already; it runs the same code.)"""
        token = torch.zeros(1, device=self.device)
        for low, high in self._pairs:
            if self.rank == low:
                dist.send(token, self.peer(high))
            elif self.rank == high:
                dist.recv(token, self.peer(low))

    def _incoming_queues(self, view: PlanView) -> dict[int, deque[Transfer]]:
        queues: dict[int, deque[Transfer]] = defaultdict(deque)
        for src, nodes in enumerate(view.nodes):
            if src == self.rank:
                continue
            for i in nodes:
                for t in view.sends.get(i, ()):
                    if t.dst_rank == self.rank and self._travels(t):
                        queues[src].append(t)
        return queues

    def _travels(self, t: Transfer) -> bool:
        return not t.is_local and (self.link_delay_s is not None or _numel(self.shape_of(self.view, t)) > 0)

    def send(self, t: Transfer, tensor: torch.Tensor | None) -> None:
        if t.is_local:
            self._mailbox[t.index] = tensor
            return
        if not self._travels(t):
            return
        if self.link_delay_s is not None:
            tensor = torch.tensor([time.perf_counter()], dtype=torch.float64, device=self.device)
        else:
            assert tensor is not None and tuple(tensor.shape) == self.shape_of(self.view, t), (t, None if tensor is None else tensor.shape)
            tensor = tensor.detach().contiguous()
        self._sends.append((dist.isend(tensor, self.peer(t.dst_rank), tag=t.index), tensor))

    def recv(self, t: Transfer) -> torch.Tensor | None:
        if t.is_local:
            return self._mailbox.pop(t.index)
        if not self._travels(t):
            return torch.empty(self.shape_of(self.view, t), dtype=self.dtype, device=self.device)
        queue = self._queues[t.src_rank]
        while t.index not in self._posted:
            ahead = queue.popleft()
            self._posted[ahead.index] = self._post(ahead)
        work, buffer = self._posted.pop(t.index)
        work.wait()
        if self.link_delay_s is not None:
            _sleep_until(float(buffer.item()) + self.link_delay_s(self.view, t))
            return None
        return buffer

    def _post(self, t: Transfer) -> tuple[dist.Work, torch.Tensor]:
        if self.link_delay_s is not None:
            buffer = torch.empty(1, dtype=torch.float64, device=self.device)
        else:
            buffer = torch.empty(self.shape_of(self.view, t), dtype=self.dtype, device=self.device)
        return dist.irecv(buffer, self.peer(t.src_rank), tag=t.index), buffer

    def finish(self) -> None:
        """End of step: every send has completed and every receive was consumed."""
        for work, _tensor in self._sends:
            work.wait()
        self._sends.clear()
        assert not self._posted and not self._mailbox and not any(self._queues.values()), "unconsumed transfers"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
