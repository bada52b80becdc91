"""Full-mesh link classes (``mesh_links``): a collective over g ranks drives only its g - 1 direct links."""

from __future__ import annotations

import copy

import pytest

from mpipe_tune.algebra import Degrees
from mpipe_tune.cost import CostOptions, build_layer_table
from mpipe_tune.cost._profile import COLLECTIVES, LinkCost, estimate_collective_s, load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model, Microbatch, Workload

MESH = LinkCost(1e-5, 1e-9, mesh_links=7)
SWITCHED = LinkCost(1e-5, 1e-9)


@pytest.mark.parametrize("collective", [c for c in COLLECTIVES if c != "p2p"])
@pytest.mark.parametrize("g", [2, 3, 4, 8])
def test_a_group_of_g_ranks_uses_g_minus_one_of_the_meshs_links(collective: str, g: int) -> None:
    """The byte term is the switched one's times 7 / (g - 1); the latency steps are the same."""
    n = 8e6
    latency = estimate_collective_s(LinkCost(1e-5, 0.0, mesh_links=7), collective, n, g)
    assert latency == estimate_collective_s(LinkCost(1e-5, 0.0), collective, n, g)
    byte_term = estimate_collective_s(MESH, collective, n, g) - latency
    switched = estimate_collective_s(SWITCHED, collective, n, g) - latency
    assert byte_term == pytest.approx(switched * 7 / (g - 1), rel=1e-12)


def test_a_full_group_and_a_point_to_point_transfer_see_the_entrys_own_rate() -> None:
    for collective in COLLECTIVES:
        assert estimate_collective_s(MESH, collective, 4e6, 8) == estimate_collective_s(SWITCHED, collective, 4e6, 8)
    assert estimate_collective_s(MESH, "p2p", 4e6, 2) == estimate_collective_s(SWITCHED, "p2p", 4e6, 2)


def _ascend_without_mesh() -> dict:
    data = copy.deepcopy(load_profile("ascend-910b").to_dict())
    for entry in data["links"]["intra_node"].values():
        entry.pop("mesh_links", None)
    return data


def _tp_layer_fwd_s(profile, tp: int) -> float:
    model = load_model("llama3-8b")
    options = CostOptions(degrees=Degrees(1, tp=tp), sequence_parallel=True)
    table = build_layer_table(model, Workload((Microbatch(0, 4096),), "one"), profile, options)
    return float(table.fwd_s[1, 0])


def test_a_profile_without_the_field_predicts_as_before_and_with_it_a_tp2_layer_pays_one_link() -> None:
    """Without ``mesh_links`` a tp2 layer's all-reduce runs at the entry's full 7-link rate (today's
    behaviour); with it, on one direct link: slower at tp 2, the same at tp 8 (all 7 links in use)."""
    shipped = load_profile("ascend-910b")
    plain = parse_profile(_ascend_without_mesh(), where="test")
    assert all(link.mesh_links is None for link in plain.links.values())
    assert _tp_layer_fwd_s(shipped, 8) == _tp_layer_fwd_s(plain, 8)
    assert _tp_layer_fwd_s(shipped, 2) > _tp_layer_fwd_s(plain, 2)
    link = shipped.link("all_reduce")
    slow = estimate_collective_s(link, "all_reduce", 1e8, 2)
    assert slow == pytest.approx(2 * (link.alpha_s + 1e8 / 2 / 28e9), rel=1e-9)  # one 28e9 B/s link each way


def test_profiles_without_mesh_links_keep_them_absent_and_the_field_round_trips() -> None:
    for name in ("h100-sxm", "h200", "ascend-910c-cm384", "ideal", "cpu-generic"):
        profile = load_profile(name)
        assert all(link.mesh_links is None for link in profile.links.values()), name
        assert "mesh_links" not in str(profile.to_dict()["links"])
    shipped = load_profile("ascend-910b")
    assert shipped.link("all_gather").mesh_links == 7 and shipped.link("p2p").mesh_links is None
    assert parse_profile(shipped.to_dict(), where="again") == shipped


@pytest.mark.parametrize(("path", "value", "message"), [
    ("all_reduce", 0, "mesh_links = 0: must be an integer >= 1"),
    ("all_reduce", True, "must be an integer >= 1"),
    ("all_reduce", 2.5, "must be an integer >= 1"),
    ("p2p", 7, "applies to collectives, not to p2p"),
])
def test_a_bad_mesh_links_is_one_line_naming_it(path: str, value: object, message: str) -> None:
    data = _ascend_without_mesh()
    data["links"]["intra_node"][path]["mesh_links"] = value
    with pytest.raises(MpipeError, match=message) as error:
        parse_profile(data, where="bad.json")
    assert f"links.intra_node.{path}.mesh_links" in str(error.value) and "\n" not in str(error.value)
