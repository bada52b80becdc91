"""MoE as the trainers run it (cost/_moe.py): the rows the experts see, the dispatchers' collectives, the settings
as a framework option from the flags to plan.json."""

from __future__ import annotations

import json

import pytest

from mpipe_tune.algebra import Degrees
from mpipe_tune.cli import main
from mpipe_tune.cost._arch import estimate_parallel_traffic
from mpipe_tune.cost._arch_pieces import Collective
from mpipe_tune.cost import Framework, build_layer_table
from mpipe_tune.cost._moe import DISPATCHERS, MoeSettings, dispatcher_gathers, expert_rows
from mpipe_tune.errors import MpipeError
from mpipe_tune.cost import estimate_collective_s, load_profile
from mpipe_tune.inputs import load_model, Microbatch, Workload

MIXTRAL = {"hidden": 4096, "heads": 32, "kv_heads": 8, "experts": 8, "top_k": 2, "moe_ffn": 14336}


def test_dropless_rows_follow_the_imbalance_a_capacity_caps_them_and_padding_fixes_them() -> None:
    balanced = expert_rows(4096, 2, 8, MoeSettings())
    assert balanced == 4096 * 2
    assert expert_rows(4096, 2, 8, MoeSettings(), imbalance=1.5) == 1.5 * balanced
    assert expert_rows(4096, 2, 8, MoeSettings(capacity_factor=1.25), imbalance=1.5) == 1.25 * balanced
    assert expert_rows(4096, 2, 8, MoeSettings(capacity_factor=1.25), imbalance=1.1) == pytest.approx(1.1 * balanced)
    padded = MoeSettings(capacity_factor=1.0, pad_to_capacity=True)
    assert expert_rows(4096, 2, 8, padded, imbalance=3.0) == expert_rows(4096, 2, 8, padded) == balanced
    assert expert_rows(4095, 2, 8, padded) == 8 * 1024  # each expert's capacity rounds up


def _traffic(dispatcher: str, *, tp: int, ep: int, top_k: int = 2):
    return estimate_parallel_traffic("moe_block", {**MIXTRAL, "top_k": top_k}, Microbatch(0, 4096), dtype_bytes=2,
                                     tp_degree=tp, ep_degree=ep, sequence_parallel=tp > 1,
                                     moe=MoeSettings(dispatcher))


def test_alltoall_exchanges_the_routed_rows_and_gathers_them_over_tensor_parallelism() -> None:
    only_ep = _traffic("alltoall", tp=1, ep=8)
    counts = Collective("all_to_all", 8, 8, 8 * 8, forward_only=True)  # each rank's 8 int64 counts, forward only
    assert only_ep.all_to_all_bytes == (2 * 4096 * 2 * 4096,) * 2 and only_ep.group_collectives == (counts,)
    with_tp = _traffic("alltoall", tp=4, ep=8)
    assert with_tp.all_to_all_bytes == tuple(n / 4 for n in only_ep.all_to_all_bytes)  # each rank its shard's rows
    assert [(c.kind, c.group, c.forward_only) for c in with_tp.group_collectives] == \
        [("all_to_all", 8, True)] + [("all_gather", 4, False)] * 2  # the counts' group spans the tp x ep devices
    assert with_tp.group_collectives[1].elems == 2 * 4096 * 2 * 4096  # the group's T x k rows, gathered
    assert _traffic("alltoall", tp=1, ep=1).all_to_all_bytes == ()


def test_allgather_moves_the_groups_tokens_whatever_top_k() -> None:
    top2, top4 = _traffic("allgather", tp=1, ep=8), _traffic("allgather", tp=1, ep=8, top_k=4)
    assert top2.group_collectives == top4.group_collectives and top2.all_to_all_bytes == ()
    assert [(c.group, c.span) for c in top2.group_collectives] == [(8, 8)] * 2
    assert top2.group_collectives[0].elems == 2 * 4096 * 8 * 4096
    assert dispatcher_gathers(4096, 8, 8192, dispatcher="allgather", tp=1, ep=1) == ()


def _moe_fwd_s(framework: Framework, *, ep: int, imbalance: float = 1.0) -> float:
    model = load_model("benchmarks/models/mixtral-8x7b.yaml")
    options = framework.cost_options(Degrees(1, dp=ep, ep=ep))
    options = type(options)(**{**options.__dict__, "moe_imbalance": imbalance})
    table = build_layer_table(model, Workload((Microbatch(0, 4096),), "one"), load_profile("h100-sxm"), options)
    return float(table.fwd_s[1, 0])


def test_the_dispatcher_and_the_capacity_change_a_moe_layers_time() -> None:
    alltoall, allgather = _moe_fwd_s(Framework(), ep=8), _moe_fwd_s(Framework(moe_dispatcher="allgather"), ep=8)
    assert allgather > alltoall  # top-2 over 8 ranks: the gather moves 8 tokens' rows where the exchange moves 2
    skewed = _moe_fwd_s(Framework(), ep=8, imbalance=1.5)
    assert skewed > alltoall
    padded = Framework(moe_capacity_factor=1.0, moe_pad_to_capacity=True)
    counts_s = estimate_collective_s(load_profile("h100-sxm").link_spanning("all_to_all", 8), "all_to_all", 8 * 8, 8)
    assert counts_s > 0  # padded: the routing is moot, and every split known without exchanging the counts
    assert _moe_fwd_s(padded, ep=8, imbalance=1.5) == pytest.approx(alltoall - counts_s)
    capped = Framework(moe_capacity_factor=1.25)
    assert alltoall < _moe_fwd_s(capped, ep=8, imbalance=1.5) < skewed


@pytest.mark.parametrize("kwargs, message", [
    (dict(dispatcher="flex"), "MoE token dispatcher 'flex' is not one of " + ", ".join(DISPATCHERS)),
    (dict(capacity_factor=0.0), "MoE capacity factor 0.0 must be a number > 0"),
    (dict(pad_to_capacity=True), "MoE padding to capacity needs a capacity factor"),
])
def test_bad_settings_are_refused_in_one_line(kwargs, message) -> None:
    with pytest.raises(MpipeError, match="^" + message) as info:
        MoeSettings(**kwargs)
    assert "\n" not in str(info.value)


def _predict(capsys, *flags: str):
    code = main(["predict", "--model", "benchmarks/models/mixtral-8x7b.yaml", "--profile", "h100-sxm", "--pp", "2",
                 "--dp", "4", "--ep", "4", "--schedule", "1f1b", "--microbatches", "4", "--workload", "text-heavy",
                 "--json", *flags])
    out = capsys.readouterr()
    return code, out


def test_the_flags_reach_the_prediction_and_a_bad_one_is_one_line(capsys) -> None:
    code, out = _predict(capsys)
    code_ag, out_ag = _predict(capsys, "--moe-dispatcher", "allgather")
    assert code == code_ag == 0
    default, gathered = json.loads(out.out), json.loads(out_ag.out)
    assert (default["moe_dispatcher"], gathered["moe_dispatcher"]) == ("alltoall", "allgather")
    assert gathered["makespan_s"] > default["makespan_s"]
    code, out = _predict(capsys, "--moe-pad-to-capacity")
    assert code == 2 and out.err.count("\n") == 1 and "needs a capacity factor" in out.err


def test_the_allgather_dispatcher_permutes_the_gathered_rows_and_syncs_on_its_data_sized_tensors() -> None:
    """Megatron core_r0.6's all-gather dispatcher (as MindSpeed runs it) picks and sorts the local experts' rows of
    the tensor-parallel group's gathered tokens on each rank (the all-to-all one only its sequence shard's), and
    sizes three tensors by their data."""
    from mpipe_tune.cost._arch import estimate_layer
    from mpipe_tune.cost._arch_layers import LayerDegrees
    from mpipe_tune.cost._moe import host_syncs_per_forward, permutation_elems

    def permute_bytes(dispatcher):
        degrees = LayerDegrees(8, sequence_parallel=True, moe=MoeSettings(dispatcher=dispatcher))
        pieces = estimate_layer("moe_block", MIXTRAL, Microbatch(0, 4096), dtype_bytes=2, tp_degree=8,
                                sequence_parallel=True, moe=degrees.moe)[1].pieces
        return sum(p.fwd_elems for p in pieces if p.index)

    assert permute_bytes("allgather") > 8 * permute_bytes("alltoall")
    permuted, _ = permutation_elems(4096, 2, 4096, dispatcher="allgather", ep=1, shards=8, rows=4096 * 2)
    assert permuted.read == permuted.write == 2 * 4096 * 2 * 4096  # the pick of the local rows, then their sort
    assert (host_syncs_per_forward(8, "allgather"), host_syncs_per_forward(8), host_syncs_per_forward(0)) == (4, 1, 0)


def test_allgather_permutation_traffic_grows_with_the_local_rows_and_the_gathered_tokens() -> None:
    """The permutation moves every local row (``tokens * top_k`` at any ep: a rank's experts take 1/ep of the
    group's routings) a fixed number of times, the un-permutation also the fp32 buffer of every gathered token."""
    from mpipe_tune.cost._moe import permutation_elems

    def traffic(tokens, top_k, hidden, ep):
        permuted, unpermuted = permutation_elems(tokens, top_k, hidden, dispatcher="allgather", ep=ep, shards=1,
                                                 rows=expert_rows(tokens, top_k, 64, MoeSettings()))
        return permuted, unpermuted

    base_p, base_u = traffic(4096, 2, 1024, 1)
    for tokens, top_k, hidden in ((8192, 2, 1024), (4096, 4, 1024), (4096, 2, 2048)):
        permuted, _ = traffic(tokens, top_k, hidden, 1)
        scale = tokens * top_k * hidden / (4096 * 2 * 1024)
        assert (permuted.read, permuted.write) == pytest.approx((scale * base_p.read, scale * base_p.write))
        assert permuted.backward == 7 * tokens * top_k * hidden + tokens * hidden  # two scatter-adds into zeros
    wide_p, wide_u = traffic(4096, 2, 1024, 8)
    assert (wide_p.read, wide_p.write) == (base_p.read, base_p.write)  # the same local rows at ep 8
    assert wide_u.write - base_u.write == 3 * 4096 * 7 * 1024  # the fp32 buffer of the 7 more gathered ranks' tokens
    assert wide_u.backward > base_u.backward > base_p.backward > 0


def test_the_profile_s_index_curve_times_the_permutation_kernels_and_nothing_else() -> None:
    """A profile's ``kernel_efficiency.index`` slows exactly the dispatcher's index kernels: a dense layer and the
    rest of a MoE layer keep their time, and the MoE layer's permutation time scales as 1 / the curve's top."""
    from dataclasses import replace

    from mpipe_tune.cost._arch import estimate_layer
    from mpipe_tune.cost._kernel_model import MemoryCurve
    from mpipe_tune.cost._kernel_passes import shaped_pass_seconds

    profile = load_profile("ascend-910b")
    curves = profile.kernel_efficiency
    memory = curves.memory
    same = replace(profile, kernel_efficiency=replace(curves, index=memory))
    slow = replace(profile, kernel_efficiency=replace(curves, index=MemoryCurve(memory.max / 4, memory.half_bytes)))
    moe = estimate_layer("moe_block", MIXTRAL, Microbatch(0, 4096), dtype_bytes=2, tp_degree=8,
                         sequence_parallel=True, moe=MoeSettings("allgather"))[1].pieces
    dense = estimate_layer("dense_block", {**MIXTRAL, "ffn": 14336}, Microbatch(0, 4096), dtype_bytes=2,
                           tp_degree=8, sequence_parallel=True)[1].pieces
    index = [p for p in moe if p.index]
    assert len(index) == 2 and not any(p.index for p in dense)

    def seconds(pieces, prof):
        return sum(shaped_pass_seconds(pieces, "moe_block", prof, "bf16", 2)[0])

    assert seconds(dense, slow) == seconds(dense, same)
    rest = [p for p in moe if not p.index]
    assert seconds(rest, slow) == seconds(rest, same)
    assert seconds(index, slow) == pytest.approx(4 * seconds(index, same))
