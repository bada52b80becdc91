"""The executor: one rank walks its event list of the plan and does what each event says.

There is no code per schedule. For each event of ``nodes(rank)``, in order: receive what its incoming
transfers carry, run it (forward or backward of the stage's slab, the loss, a gradient reduce, the
step barrier, or the weight-gradient half of a split backward), then send what its outgoing
transfers carry. Between the events, a ZeRO-2 or ZeRO-3 plan that keeps its weights has its stages'
sharding actions (gather, reduce-scatter, free: :mod:`mpipe_tune.algebra._sharding`), run as they come. Which tensors those are is read off the
graph (:mod:`mpipe_tune.runtime._plan_view`), so a new skeleton in the algebra runs unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from mpipe_tune.algebra import Bwd, DpReduce, Fwd, Loss, StepBarrier, Wgrad
from mpipe_tune.runtime._plan_view import PlanView
from mpipe_tune.runtime._transport import Transport


@dataclass(frozen=True)
class StepRecord:
    """One rank's timings of one step, in seconds of its ``time.perf_counter`` clock."""

    start: float
    """After the barrier that starts the step."""
    end: float
    """After the optimizer update (time spent in a ``before_update`` hook left out)."""
    spans: tuple[tuple[int, float, float, float], ...]
    """Per event run: (event index, ready, start, end); ready -> start is the wait for its inputs."""
    update_s: float
    losses: dict[int, float]
    """Per microbatch whose loss this rank computed."""


class Executor:
    def __init__(self, view: PlanView, rank: int, compute, transport: Transport) -> None:
        self.view = view
        self.rank = rank
        self.compute = compute
        self.transport = transport

    def run_step(self, before_update: Callable[[], None] | None = None, view: PlanView | None = None) -> StepRecord:
        """Run one step of ``view`` (default: the executor's own): the same plan with another owner
        map or other microbatches (:mod:`mpipe_tune.runtime._steps`) runs through the same loop."""
        view = self.view = view if view is not None else self.view
        compute, transport = self.compute, self.transport
        compute.begin_step(view)
        transport.begin_step(view)
        spans = []
        dist.barrier()
        step_start = time.perf_counter()
        for i in view.program(self.rank):
            if not isinstance(i, int):  # a sharding action of one of the rank's stages
                compute.act(i)
                continue
            ready = time.perf_counter()
            event = view.events[i]
            incoming = [transport.recv(t) for t in view.recvs.get(i, ())]
            assert len(incoming) <= 1, f"{event} has {len(incoming)} incoming transfers; the runtime expects at most one"
            received = incoming[0] if incoming else None
            start = time.perf_counter()
            out = None
            if isinstance(event, Fwd):
                assert incoming or view.slab(event.region, event.rank)[0] == 0, f"{event} has no input"
                out = compute.forward(i, event, received)
            elif isinstance(event, Bwd):
                out = compute.backward(i, event, received)
            elif isinstance(event, Wgrad):
                compute.weight_grad(i, event)
            elif isinstance(event, Loss):
                compute.loss(i)
            elif isinstance(event, DpReduce):
                compute.reduce(i, event)
            elif isinstance(event, StepBarrier):
                transport.finish()
            else:
                raise AssertionError(f"event {event} cannot run on a rank")
            for t in view.sends.get(i, ()):
                transport.send(t, out)
            spans.append((i, ready, start, time.perf_counter()))
        walk_end = time.perf_counter()
        if before_update is not None:
            before_update()  # not timed: checks read the gradients here
        update_start = time.perf_counter()
        compute.update()
        update_s = time.perf_counter() - update_start
        return StepRecord(step_start, walk_end + update_s, tuple(spans), update_s, dict(compute.losses))
