"""ZeRO's sharding actions in a rank's program: where a stage's weights are gathered, freed and its
gradients reduce-scattered, as torch's pipelining IR places UNSHARD, RESHARD and REDUCE_GRAD
(``_add_unshard_reshard``, ``_add_reduce_grad``).

A plan's ZeRO setting (:attr:`~mpipe_tune.algebra._candidate.Candidate.reshards_after_forward`) decides
which actions a stage takes; they are placed on the derived per-rank order, stage by stage (a stage is a
(region, rank) whose forwards, backwards or weight-gradient events this rank runs):

- **stage 3 keeping the weights**: ``unshard`` before the stage's first event, ``reducegrad`` right
  after its last backward (or weight-gradient event), then ``reshard`` (right after its last event
  where it runs no backward);
- **stage 2**: the same without ``reducegrad`` (every backward reduce-scatters its own gradients);
- **stage 3 resharding after forward**, stages 0 and 1: no actions (FSDP2 gathers and frees each layer
  around every forward and backward itself, or nothing is sharded).

The program is the order's events with the actions between them; the order graph itself is unchanged.

Per microbatch (:func:`microbatch_actions`), what FSDP2's hooks run around each event at the settings that
gather or reduce-scatter every microbatch (the runtime leaves these to FSDP2's own pre- and post-hooks; the
cost model times them on the timeline, :mod:`mpipe_tune.cost._sharding_events`):

- **stage 3 resharding after forward**: ``unshard`` before every ``Fwd`` and every ``Bwd`` of a stage
  (the layers' weights gathered again, one layer ahead of the compute), ``reducegrad`` after every ``Bwd``
  (each backward's gradients reduce-scattered);
- **stage 2**: ``reducegrad`` after every ``Bwd``;
- the other settings: none (their gathers and reduce-scatters are once a step: the step-level actions
  above, which the step-end reduce events time);
- with ``hooks`` (FSDP2's per-layer host work priced), stage 2 and stage 3 either way take all three
  kinds' places (an unshard before every forward and backward, a reducegrad after every backward): FSDP2's
  hooks run around every call, whether or not a collective does.

>>> from mpipe_tune.algebra import Cut, Model, Schedule, Skeleton, derive
>>> from mpipe_tune.algebra._model import Layer
>>> model = Model("m", tuple(Layer(f"u{i}", "llm", True, 1.0) for i in range(4)))
>>> plan = derive(Cut(()), Schedule((Skeleton("1f1b"),)), model, 2, 2)
>>> " ".join(map(str, sharded_program(plan, 1, zero_stage=3, reshards_after_forward=False)))
'unshard(1.1) F1.1#0 L#0 B1.1#0 F1.1#1 L#1 B1.1#1 reducegrad(1.1) reshard(1.1) reduce(1,data,r1) barrier'
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra._events import Action, Bwd, Event, Fwd, ReduceGrad, Reshard, Unshard, Wgrad
from mpipe_tune.algebra._plan import BWD, FWD, OrderColumns, Plan

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


UNSHARD, REDUCE_GRAD = 0, 1
"""The codes of :func:`microbatch_actions`' kinds: a gather before an event, a reduce-scatter after one."""


def microbatch_actions(columns: OrderColumns, *, zero_stage: int, reshards_after_forward: bool,
                       hooks: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The per-microbatch sharding actions of an order at this ZeRO setting (module docstring), as columns:
    each action's kind (:data:`UNSHARD` before its event, :data:`REDUCE_GRAD` after it) and the index of the
    event it is placed at, in the order of those events' indices (an event's unshard before its reducegrad).

    >>> from mpipe_tune.algebra import Cut, Model, Schedule, Skeleton, derive
    >>> from mpipe_tune.algebra._model import Layer
    >>> plan = derive(Cut(()), Schedule((Skeleton("1f1b"),)), Model("m", (Layer("u", "llm", True, 1.0),)), 1, 2)
    >>> kinds, at = microbatch_actions(plan.order.columns, zero_stage=3, reshards_after_forward=True)
    >>> [("unshard" if k == UNSHARD else "reducegrad", str(plan.order.events[i])) for k, i in zip(kinds, at)]
    [('unshard', 'F1.0#0'), ('unshard', 'B1.0#0'), ('reducegrad', 'B1.0#0'), ('unshard', 'F1.0#1'), ('unshard', 'B1.0#1'), ('reducegrad', 'B1.0#1')]
    """
    gathers = (zero_stage == 3 and reshards_after_forward) or (hooks and zero_stage >= 2)
    if not (gathers or zero_stage == 2):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    kind = columns.kind
    before = np.flatnonzero((kind == FWD) | (kind == BWD)) if gathers else np.zeros(0, dtype=np.int64)
    after = np.flatnonzero(kind == BWD)
    at = np.concatenate((before, after))
    kinds = np.concatenate((np.full(len(before), UNSHARD), np.full(len(after), REDUCE_GRAD)))
    order = np.lexsort((kinds, at))
    return kinds[order], at[order]
