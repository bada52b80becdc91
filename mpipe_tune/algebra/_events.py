"""Events and edges of the order graph, with one-line text forms that parse back exactly.

A *stage* is a pair (region, rank); regions are 1-based as in the paper, ranks and microbatches
0-based. Text forms:

==========================  =====================================================
``F2.0#3``                  Fwd(region 2, rank 0, mb 3)
``B2.0#3``                  Bwd(region 2, rank 0, mb 3)
``W2.0#3``                  Wgrad(region 2, rank 0, mb 3)
``gather(1.3>2.0)#3``       Coll(Gather, from stage (1, 3) to stage (2, 0), mb 3)
``L#3``                     Loss(mb 3)
``reduce(1,replica)``       DpReduce(region 1, ReplicaGroup) over every rank
``reduce(2,data,r1)``       DpReduce(region 2, DataGroup) of rank 1's slab
``barrier``                 StepBarrier
==========================  =====================================================

>>> parse_event("gather(1.3>2.0)#3") == Coll(Comm.GATHER, (1, 3), (2, 0), 3)
True
>>> str(parse_event("B2.0#3"))
'B2.0#3'

A skeleton that splits the backward (``zb1p``, ``zbv``) runs a trainable stage's ``Bwd`` as the
input-gradient part only (what it sends upstream) and a ``Wgrad`` after it for the weight gradients,
which the stage's DataGroup reduce accumulates; the other skeletons run one ``Bwd`` for both.

>>> parse_event("W2.0#3") == Wgrad(2, 0, 3), Wgrad(2, 0, 3) == Bwd(2, 0, 3)
(True, False)

ZeRO's sharding actions of a stage (:mod:`~mpipe_tune.algebra._sharding` places them in a rank's order, as
torch's pipelining IR carries UNSHARD, RESHARD and REDUCE_GRAD):

==========================  =====================================================
``unshard(2.0)``            Unshard(region 2, rank 0): gather the stage's weights
``reshard(2.0)``            Reshard(region 2, rank 0): free them
``reducegrad(2.0)``         ReduceGrad(region 2, rank 0): reduce-scatter its gradients
==========================  =====================================================

>>> parse_action("reducegrad(2.0)") == ReduceGrad(2, 0), str(Unshard(1, 3))
(True, 'unshard(1.3)')
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple, Union

from mpipe_tune.errors import MpipeError

Stage = tuple[int, int]
"""(region, rank)."""


class Comm(str, enum.Enum):
    GATHER = "gather"
    SCATTER = "scatter"
    SEND = "send"
    RECV_GRAD = "recvgrad"

    __hash__ = str.__hash__  # C-level hashing: events are dict keys on the hot path


class Group(str, enum.Enum):
    REPLICA = "replica"
    DATA = "data"

    __hash__ = str.__hash__


class EdgeKind(enum.Enum):
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    TURNAROUND = "turnaround"
    ACCUMULATE = "accumulate"
    SEQUENCE = "sequence"


# Events are immutable named tuples: hashing and equality run in C, which the order builder, the
# memory pass and the plan index do thousands of times per candidate. The trailing ``tag`` keeps
# events of different kinds with equal fields apart (Fwd(1, 0, 0) != Bwd(1, 0, 0)).


class Fwd(NamedTuple):
    region: int
    rank: int
    mb: int
    tag: str = "F"

    def __str__(self) -> str:
        return f"F{self.region}.{self.rank}#{self.mb}"


class Bwd(NamedTuple):
    region: int
    rank: int
    mb: int
    tag: str = "B"

    def __str__(self) -> str:
        return f"B{self.region}.{self.rank}#{self.mb}"


class Wgrad(NamedTuple):
    """The weight-gradient part of a split backward of stage (region, rank) on microbatch ``mb``."""

    region: int
    rank: int
    mb: int
    tag: str = "W"

    def __str__(self) -> str:
        return f"W{self.region}.{self.rank}#{self.mb}"


class Coll(NamedTuple):
    """A transfer of microbatch ``mb``'s activation (forward comms) or gradient (backward comms)
    from stage ``src`` to stage ``dst``. It occupies a link, not a rank."""

    comm: Comm
    src: Stage
    dst: Stage
    mb: int
    tag: str = "C"

    @property
    def seam(self) -> tuple[int, int]:
        """The (region, region) pair it crosses; equal regions for a stage boundary inside a region."""
        return (self.src[0], self.dst[0])

    def __str__(self) -> str:
        return f"{self.comm.value}({self.src[0]}.{self.src[1]}>{self.dst[0]}.{self.dst[1]})#{self.mb}"


class Loss(NamedTuple):
    mb: int
    tag: str = "L"

    def __str__(self) -> str:
        return f"L#{self.mb}"


class DpReduce(NamedTuple):
    """Weight-gradient reduce of a region over its group. ReplicaGroup reduces span every rank
    (``rank`` is None); a DataGroup reduce is per pipeline rank, over that rank's data-parallel peers."""

    region: int
    group: Group
    rank: int | None = None
    tag: str = "R"

    def __str__(self) -> str:
        suffix = "" if self.rank is None else f",r{self.rank}"
        return f"reduce({self.region},{self.group.value}{suffix})"


class StepBarrier(NamedTuple):
    tag: str = "S"

    def __str__(self) -> str:
        return "barrier"


class Unshard(NamedTuple):
    """Gather stage (region, rank)'s weights before its first forward of the step."""

    region: int
    rank: int
    tag: str = "U"

    def __str__(self) -> str:
        return f"unshard({self.region}.{self.rank})"


class Reshard(NamedTuple):
    """Free stage (region, rank)'s gathered weights after its last use of the step."""

    region: int
    rank: int
    tag: str = "X"

    def __str__(self) -> str:
        return f"reshard({self.region}.{self.rank})"


class ReduceGrad(NamedTuple):
    """Reduce-scatter the gradients stage (region, rank)'s backwards accumulated, after its last one."""

    region: int
    rank: int
    tag: str = "G"

    def __str__(self) -> str:
        return f"reducegrad({self.region}.{self.rank})"


Event = Union[Fwd, Bwd, Wgrad, Coll, Loss, DpReduce, StepBarrier]
Action = Union[Unshard, Reshard, ReduceGrad]
"""A sharding action of a stage (not an event of the order graph: it rides on a rank's program)."""

_COMPUTE = re.compile(r"([FBW])(\d+)\.(\d+)#(\d+)")
_COLL = re.compile(r"(gather|scatter|send|recvgrad)\((\d+)\.(\d+)>(\d+)\.(\d+)\)#(\d+)")
_LOSS = re.compile(r"L#(\d+)")
_REDUCE = re.compile(r"reduce\((\d+),(replica|data)(?:,r(\d+))?\)")


_COMPUTE_CLASSES = {"F": Fwd, "B": Bwd, "W": Wgrad}


_ACTION = re.compile(r"(unshard|reshard|reducegrad)\((\d+)\.(\d+)\)")
_ACTION_CLASSES = {"unshard": Unshard, "reshard": Reshard, "reducegrad": ReduceGrad}


def parse_action(text: str) -> Action:
    """Parse the text form of a sharding action (the inverse of ``str``)."""
    if m := _ACTION.fullmatch(text):
        return _ACTION_CLASSES[m[1]](int(m[2]), int(m[3]))
    raise MpipeError(f"'{text}' is not a sharding action; expected unshard(2.0), reshard(2.0) or reducegrad(2.0)")


def parse_event(text: str) -> Event:
    """Parse the text form of an event (the inverse of ``str``)."""
    if m := _COMPUTE.fullmatch(text):
        cls = _COMPUTE_CLASSES[m[1]]
        return cls(int(m[2]), int(m[3]), int(m[4]))
    if m := _COLL.fullmatch(text):
        return Coll(Comm(m[1]), (int(m[2]), int(m[3])), (int(m[4]), int(m[5])), int(m[6]))
    if m := _LOSS.fullmatch(text):
        return Loss(int(m[1]))
    if m := _REDUCE.fullmatch(text):
        return DpReduce(int(m[1]), Group(m[2]), None if m[3] is None else int(m[3]))
    if text == "barrier":
        return StepBarrier()
    raise MpipeError(f"'{text}' is not an event; expected forms like F2.0#3, B2.0#3, W2.0#3, gather(1.3>2.0)#3, L#3, reduce(2,data,r0), barrier")

