"""ZeRO's sharding actions in a rank's program: their text forms parse back, and on random plans each
stage's weights are gathered before its first forward, its gradients reduce-scattered after its last
backward, and freed after that (stage 3 keeping the weights; stage 2 without the reduce-scatter)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipe_tune.algebra._events import Bwd, Fwd, ReduceGrad, Reshard, Unshard, Wgrad, parse_action
from mpipe_tune.algebra._sharding import sharded_program, takes_actions
from mpipe_tune.errors import MpipeError

from test_derive import cases

ACTIONS = (Unshard, Reshard, ReduceGrad)


@given(kind=st.sampled_from(ACTIONS), region=st.integers(1, 99), rank=st.integers(0, 9999))
def test_action_text_forms_parse_back(kind, region, rank):
    action = kind(region, rank)
    assert parse_action(str(action)) == action and str(parse_action(str(action))) == str(action)


@pytest.mark.parametrize("text", ["unshard(2)", "reducegrad(2.0)#3", "gather(2.0)", "Unshard(2.0)"])
def test_a_text_that_is_no_action_is_one_line(text):
    with pytest.raises(MpipeError, match="is not a sharding action"):
        parse_action(text)


@given(case=cases(), setting=st.sampled_from([(2, False), (3, False)]))
def test_each_stage_is_gathered_before_its_first_forward_and_reduced_after_its_last_backward(case, setting):
    plan, _ = case
    zero, reshards = setting
    for rank in range(plan.num_ranks):
        program = sharded_program(plan, rank, zero_stage=zero, reshards_after_forward=reshards)
        assert [e for e in program if not isinstance(e, ACTIONS)] == list(plan.nodes(rank))  # the order unchanged
        stages = {(e.region, e.rank) for e in program if isinstance(e, (Fwd, Bwd, Wgrad))}
        for stage in stages:
            at = [k for k, e in enumerate(program) if isinstance(e, (Fwd, Bwd, Wgrad)) and (e.region, e.rank) == stage]
            grads = [k for k in at if not isinstance(program[k], Fwd)]
            unshard, reshard = program.index(Unshard(*stage)), program.index(Reshard(*stage))
            assert unshard == at[0] - 1  # right before the stage's first event
            assert reshard > max(at) and (not grads or reshard > max(grads))
            if zero == 3 and grads:  # reduce-scattered once, right after the last backward, before the reshard
                assert program.index(ReduceGrad(*stage)) == max(grads) + 1 < reshard
            else:
                assert ReduceGrad(*stage) not in program
        assert sum(isinstance(e, Unshard) for e in program) == sum(isinstance(e, Reshard) for e in program) == len(stages)


@given(case=cases(), setting=st.sampled_from([(0, False), (1, False), (3, True)]))
def test_settings_without_actions_leave_the_order_as_it_is(case, setting):
    plan, _ = case
    assert not takes_actions(*setting)
    for rank in range(plan.num_ranks):
        assert sharded_program(plan, rank, zero_stage=setting[0], reshards_after_forward=setting[1]) == plan.nodes(rank)
