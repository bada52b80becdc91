"""MoE as the trainers run it (cost/moe.py): the rows the experts see, the dispatchers' collectives."""

from __future__ import annotations

import pytest

from mpipe_tune.cost.moe import DISPATCHERS, MoeSettings, dispatcher_collectives, expert_rows
from mpipe_tune.errors import MpipeError


def test_dropless_rows_follow_the_imbalance_a_capacity_caps_them_and_padding_fixes_them() -> None:
    balanced = expert_rows(4096, 2, 8, MoeSettings())
    assert balanced == 4096 * 2
    assert expert_rows(4096, 2, 8, MoeSettings(imbalance=1.5)) == 1.5 * balanced
    assert expert_rows(4096, 2, 8, MoeSettings(capacity_factor=1.25, imbalance=1.5)) == 1.25 * balanced
    assert expert_rows(4096, 2, 8, MoeSettings(capacity_factor=1.25, imbalance=1.1)) == pytest.approx(1.1 * balanced)
    padded = MoeSettings(capacity_factor=1.0, pad_to_capacity=True)
    skewed = MoeSettings(capacity_factor=1.0, pad_to_capacity=True, imbalance=3.0)
    assert expert_rows(4096, 2, 8, padded) == expert_rows(4096, 2, 8, skewed) == balanced  # padded: the routing is moot
    assert expert_rows(4095, 2, 8, padded) == 8 * 1024  # each expert's capacity rounds up


def _bytes(collectives, kind: str) -> float:
    return sum(c.elems for c in collectives if c.kind == kind)


def test_alltoall_exchanges_the_routed_rows_and_gathers_them_over_tensor_parallelism() -> None:
    only_ep = dispatcher_collectives(4096, 1024, 8192, dispatcher="alltoall", tp=1, ep=8)
    assert [c.kind for c in only_ep] == ["all_to_all", "all_to_all"] and all(c.group == 8 for c in only_ep)
    assert only_ep[0].elems == 8192 * 1024
    with_tp = dispatcher_collectives(4096, 1024, 8192, dispatcher="alltoall", tp=4, ep=8)
    assert _bytes(with_tp, "all_to_all") == _bytes(only_ep, "all_to_all") / 4  # each rank sends its shard's rows
    assert [c.group for c in with_tp if c.kind == "all_gather"] == [4, 4]
    assert dispatcher_collectives(4096, 1024, 8192, dispatcher="alltoall", tp=1, ep=1) == ()


def test_allgather_moves_the_whole_groups_tokens_whatever_the_routing() -> None:
    """The all-gather dispatcher's traffic does not depend on top-k or the rows (it gathers hidden states), and
    grows with the group: at top-2 over eight ranks it moves more than the all-to-all."""
    a = dispatcher_collectives(4096, 1024, 8192, dispatcher="allgather", tp=1, ep=8)
    b = dispatcher_collectives(4096, 1024, 99999, dispatcher="allgather", tp=1, ep=8)
    assert a == b and {c.group for c in a} == {8}
    assert _bytes(a, "all_gather") > _bytes(dispatcher_collectives(4096, 1024, 8192, dispatcher="alltoall", tp=1, ep=8),
                                            "all_to_all")


def test_alltoall_seq_exchanges_over_the_tensor_and_expert_group() -> None:
    seq = dispatcher_collectives(4096, 1024, 8192, dispatcher="alltoall_seq", tp=2, ep=4)
    assert [(c.kind, c.group, c.span) for c in seq] == [("all_to_all", 8, 8)] * 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(dispatcher="flex"), "MoE token dispatcher 'flex' is not one of " + ", ".join(DISPATCHERS)),
    (dict(capacity_factor=0.0), "MoE capacity factor 0.0 must be a number > 0"),
    (dict(pad_to_capacity=True), "MoE padding to capacity needs a capacity factor"),
    (dict(imbalance=0.5), "MoE imbalance 0.5 must be a number >= 1"),
])
def test_bad_settings_are_refused_in_one_line(kwargs, message) -> None:
    with pytest.raises(MpipeError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as info:
        MoeSettings(**kwargs)
    assert "\n" not in str(info.value)
