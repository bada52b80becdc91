"""ZeRO's sharding actions in a rank's program: where a stage's weights are gathered, freed and its
gradients reduce-scattered, as torch's pipelining IR places UNSHARD, RESHARD and REDUCE_GRAD
(``_add_unshard_reshard``, ``_add_reduce_grad``).

A plan's ZeRO setting (:attr:`~mpipe_tune.algebra.candidate.Candidate.reshards_after_forward`) decides
which actions a stage takes; they are placed on the derived per-rank order, stage by stage (a stage is a
(region, rank) whose forwards, backwards or weight-gradient events this rank runs):

- **stage 3 keeping the weights**: ``unshard`` before the stage's first event, ``reducegrad`` right
  after its last backward (or weight-gradient event), then ``reshard`` (right after its last event
  where it runs no backward);
- **stage 2**: the same without ``reducegrad`` (every backward reduce-scatters its own gradients);
- **stage 3 resharding after forward**, stages 0 and 1: no actions (FSDP2 gathers and frees each layer
  around every forward and backward itself, or nothing is sharded).

The program is the order's events with the actions between them; the order graph itself is unchanged.

>>> from mpipe_tune.algebra import Cut, Model, Schedule, Skeleton, derive
>>> from mpipe_tune.algebra.model import Layer
>>> model = Model("m", tuple(Layer(f"u{i}", "llm", True, 1.0) for i in range(4)))
>>> plan = derive(Cut(()), Schedule((Skeleton("1f1b"),)), model, 2, 2)
>>> " ".join(map(str, sharded_program(plan, 1, zero_stage=3, reshards_after_forward=False)))
'unshard(1.1) F1.1#0 L#0 B1.1#0 F1.1#1 L#1 B1.1#1 reducegrad(1.1) reshard(1.1) reduce(1,data,r1) barrier'
"""

from __future__ import annotations

from mpipe_tune.algebra.events import Action, Bwd, Event, Fwd, ReduceGrad, Reshard, Unshard, Wgrad
from mpipe_tune.algebra.plan import Plan

_STAGE_EVENTS = (Fwd, Bwd, Wgrad)


def takes_actions(zero_stage: int, reshards_after_forward: bool) -> bool:
    """Whether a plan at this ZeRO setting has sharding actions in its program (module docstring)."""
    return zero_stage == 2 or (zero_stage == 3 and not reshards_after_forward)


def sharded_program(plan: Plan, rank: int, *, zero_stage: int,
                    reshards_after_forward: bool) -> tuple[Event | Action, ...]:
    """Rank ``rank``'s events of ``plan`` in order, with its stages' sharding actions placed between them
    (module docstring); the events alone where the setting takes none."""
    events = plan.nodes(rank)
    if not takes_actions(zero_stage, reshards_after_forward):
        return tuple(events)
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    last_gradient: dict[tuple[int, int], int] = {}
    for k, e in enumerate(events):
        if isinstance(e, _STAGE_EVENTS):
            stage = (e.region, e.rank)
            first.setdefault(stage, k)
            last[stage] = k
            if not isinstance(e, Fwd):
                last_gradient[stage] = k
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for stage, k in first.items():
        before.setdefault(k, []).append(Unshard(*stage))
        end = last_gradient.get(stage, last[stage])
        reduce = [ReduceGrad(*stage)] if zero_stage == 3 and stage in last_gradient else []
        after.setdefault(end, []).extend([*reduce, Reshard(*stage)])
    out: list[Event | Action] = []
    for k, e in enumerate(events):
        out += before.get(k, ())
        out.append(e)
        out += after.get(k, ())
    return tuple(out)
