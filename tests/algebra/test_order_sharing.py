"""Candidates that differ only in their Sharded slabs share one order, and it is theirs exactly.

derive keeps the last orders it built by what they read (the schedule, P, M, the owner map, the
units' trainable bits, the encoder backward placement), so a second candidate with other slabs is
handed the first one's order object. Each must still equal its own plain reference build
(``test_derive_reference``), and a slab change that changes what the order reads (a unit's trainable
bit, hence the footprint gates) must not be handed the kept one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mpipe_tune.algebra import Cut, Owners, derive, parse_schedule

from conftest import make_model
from test_derive_reference import random_candidate, reference_order


def _other_slabs(rng, owners: Owners, P: int) -> Owners:
    """The same layer counts per region, dealt to the ranks in another (random) order."""
    return replace(owners, slab_counts=tuple(tuple(int(c) for c in rng.permutation(counts))
                                             for counts in owners.slab_counts))


def _assert_is_reference(plan, model) -> None:
    events, edges, nodes, topo = reference_order(plan, model)
    assert (plan.order.events, plan.order.edges, plan.order.nodes, plan.order.topo) == (events, edges, nodes, topo)


@pytest.mark.parametrize("seed", range(60))
def test_a_candidate_with_other_slabs_gets_its_own_order(seed):
    rng = np.random.default_rng(seed)
    cut, schedule, model, P, M, owners = random_candidate(rng, zero_bubble=seed % 3 == 0)
    first = derive(cut, schedule, model, P, M, owners)
    second = derive(cut, schedule, model, P, M, _other_slabs(rng, owners, P))
    _assert_is_reference(first, model)
    _assert_is_reference(second, model)
    if first.order == second.order:  # the same gates: the order is shared, not rebuilt
        assert first.order is second.order


def test_slabs_that_change_the_gates_get_another_order():
    # Rank 0's slab is the frozen layer alone in the first candidate, so it sends no gradient upstream.
    model = make_model(["llm"] * 4, trainable=[False, True, True, True])
    schedule = parse_schedule("1f1b")
    frozen_first = derive(Cut(()), schedule, model, 2, 4, Owners(slab_counts=((1, 3),)))
    trained_first = derive(Cut(()), schedule, model, 2, 4, Owners(slab_counts=((2, 2),)))
    assert frozen_first.order != trained_first.order
    _assert_is_reference(frozen_first, model)
    _assert_is_reference(trained_first, model)


def test_an_order_is_immutable():
    plan = derive(Cut((2,)), parse_schedule("transpose,1f1b"), make_model(["encoder"] * 2 + ["llm"] * 4), 2, 4)
    with pytest.raises(AttributeError):
        plan.order.events = ()
    with pytest.raises(ValueError):
        plan.order.columns.rank[0] = 1
