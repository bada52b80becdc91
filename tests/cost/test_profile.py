"""Hardware profiles: shipped files, validation messages, collective closed forms, dump/load."""

from __future__ import annotations

import copy
import json

import pytest

from mpipe_tune.cost._profile import (
    COLLECTIVES, SOURCES, LinkCost, builtin_profiles, dump_profile, estimate_collective_s, load_profile, parse_profile,
)
from mpipe_tune.errors import MpipeError

SHIPPED = ["ascend-910b", "ascend-910c-cm384", "ascend-910c-cm384-die", "cpu-generic", "h100-hbm2e-500w", "h100-sxm", "h200",
           "ideal"]


@pytest.fixture
def ideal_dict() -> dict:
    return load_profile("ideal").to_dict()


def test_builtin_names() -> None:
    assert builtin_profiles() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert profile.source_path is not None and profile.source_path.endswith(f"{name}.json")
    assert profile.peak("bf16") > 0
    assert 0 < profile.efficiency_for("default") <= 1
    for inter in (False, True):
        for collective in COLLECTIVES:
            cost = profile.link(collective, inter_node=inter)
            assert cost.alpha_s >= 0 and cost.beta_s_per_byte >= 0
    # every number says where it came from
    assert all(p["source"] in SOURCES for p in profile.provenance.values())


def test_shipped_figures() -> None:
    h100, h200 = load_profile("h100-sxm"), load_profile("h200")
    assert h100.peak("bf16") == h200.peak("bf16") == 989e12
    assert (h100.memory_capacity_bytes, h200.memory_capacity_bytes) == (80e9, 141e9)
    assert h200.memory_bytes_per_s == 4.8e12
    assert h100.link("p2p").beta_s_per_byte == pytest.approx(1 / 450e9)
    assert h100.link("p2p", inter_node=True).beta_s_per_byte == pytest.approx(1 / 50e9)
    cm = load_profile("ascend-910c-cm384")
    assert cm.peak("bf16") == 752e12
    assert cm.link("all_reduce", inter_node=True) == cm.link("p2p") == LinkCost(1e-5, 1 / 392e9)
    assert load_profile("h100-sxm").provenance["links.intra_node.p2p"]["alpha_source"] == "assumed"


def test_ideal_links_cost_nothing() -> None:
    ideal = load_profile("ideal")
    for inter in (False, True):
        for collective in COLLECTIVES:
            link = ideal.link(collective, inter_node=inter)
            assert link == LinkCost(0.0, 0.0)
            assert estimate_collective_s(link, collective, 1e9, 8) == 0.0


def test_lookups() -> None:
    ideal = load_profile("ideal")
    with pytest.raises(MpipeError, match=r"no peak_flops_per_s for 'fp8'.*'bf16'.*as the dtype"):
        ideal.peak("fp8")
    with pytest.raises(MpipeError, match="unknown collective 'broadcast'"):
        ideal.link("broadcast")
    b = load_profile("ascend-910b")
    assert b.link("all_gather") != b.link("p2p")  # its own entry
    assert b.link("all_gather", inter_node=True) == b.link("p2p", inter_node=True)  # falls back


def test_efficiency_falls_back_to_default(ideal_dict: dict) -> None:
    ideal_dict["efficiency"]["dense_block"] = {"value": 0.5, "source": "measured", "fit_r2": 0.99}
    profile = parse_profile(ideal_dict, where="x.json")
    assert profile.efficiency_for("dense_block") == 0.5
    assert profile.efficiency_for("vit_block") == 1.0


# ----------------------------------------------------------------------------- closed forms

LINK = LinkCost(alpha_s=1e-5, beta_s_per_byte=1e-9)


@pytest.mark.parametrize(
    ("collective", "n", "g", "expected"),
    [
        ("p2p", 1e6, 2, 1e-5 + 1e-3),
        ("all_reduce", 4e6, 4, 2 * 3 * (1e-5 + 1e-9 * 1e6)),
        ("all_gather", 8e6, 8, 7 * (1e-5 + 1e-9 * 1e6)),
        ("gather", 3e6, 3, 2 * (1e-5 + 1e-9 * 1e6)),
        ("scatter", 3e6, 3, 2 * (1e-5 + 1e-9 * 1e6)),
        ("all_reduce", 0, 4, 6e-5),  # an empty payload pays the latency terms
        ("all_gather", 0, 2, 1e-5),
    ],
)
def test_collective_closed_forms(collective: str, n: float, g: int, expected: float) -> None:
    assert estimate_collective_s(LINK, collective, n, g) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_group_of_one_is_free(collective: str) -> None:
    assert estimate_collective_s(LINK, collective, 1e9, 1) == 0.0


def test_ring_all_reduce_tends_to_twice_the_buffer() -> None:
    big = estimate_collective_s(LinkCost(0.0, 1e-9), "all_reduce", 1e9, 1024)
    assert big == pytest.approx(2 * 1023 / 1024)


# ------------------------------------------------------------------------------- validation


def _set(data: dict, path: str, value: object) -> dict:
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("name", _DELETE, r"x\.json: name is missing and is required"),
        ("links", _DELETE, "links is missing"),
        ("links.inter_node", _DELETE, "links.inter_node is missing"),
        ("links.intra_node.p2p", _DELETE, "links.intra_node.p2p is missing"),
        ("links.intra_node.p2p.alpha_s", _DELETE, "links.intra_node.p2p.alpha_s is missing"),
        ("memory_bytes_per_s.source", _DELETE, "memory_bytes_per_s.source is missing"),
        ("efficiency", {"dense_block": {"value": 0.5, "source": "assumed"}}, "efficiency.default is missing"),
        ("efficiency", {}, "efficiency = {}: must be a non-empty JSON object"),
        ("name", 3, "name = 3: must be a non-empty string"),
        ("devices_per_node", 0, "devices_per_node = 0: must be an integer >= 1"),
        ("devices_per_node", 8.0, "devices_per_node = 8.0"),
        ("schema_version", 2, "schema_version = 2: must be 1"),
        ("peak_flops_per_s.bf16.value", 0, r"peak_flops_per_s\.bf16\.value = 0: must be > 0"),
        ("peak_flops_per_s.bf16.value", -1e15, r"peak_flops_per_s\.bf16\.value = -1e15: must be > 0"),
        ("peak_flops_per_s.bf16.value", True, "must be a finite number"),
        ("peak_flops_per_s.bfloat16", {"value": 1e15, "source": "ideal"},
         r"peak_flops_per_s\.bfloat16 .* is not a known key.*bf16"),
        ("memory_bytes_per_s.value", 0.0, r"memory_bytes_per_s\.value = 0\.0: must be > 0"),
        ("memory_capacity_bytes.value", -5, "memory_capacity_bytes.value = -5"),
        ("memory_capacity_bytes.value", "80 GB",
         r"memory_capacity_bytes\.value = '80 GB'.*SI base units \(bytes, seconds"),
        ("memory_capacity_bytes", "80 GB", r"memory_capacity_bytes = '80 GB'.*SI base units"),
        ("memory_capacity_bytes", 80e9, r"memory_capacity_bytes = 8e10: must be an object"),
        ("memory_bytes_per_s.value", float("nan"), "must be a finite number"),
        ("links.intra_node.p2p.alpha_s", -1e-6, r"links\.intra_node\.p2p\.alpha_s = -1e-06: must be >= 0"),
        ("links.inter_node.p2p.beta_s_per_byte", -1.0, r"links\.inter_node\.p2p\.beta_s_per_byte = -1\.0"),
        ("links.intra_node.p2p.beta_s_per_byte", "1 ns", "SI base units"),
        ("efficiency.default.value", 1.5, r"efficiency\.default\.value = 1\.5: must lie in \(0, 1\]"),
        ("efficiency.default.value", 0.0, r"efficiency\.default\.value = 0\.0: must be > 0"),
        ("efficiency.default.backward_value", 1.2, r"efficiency\.default\.backward_value = 1\.2: must lie in \(0, 1\]"),
        ("efficiency.default.backward_value", 0, r"efficiency\.default\.backward_value = 0: must be > 0"),
        ("efficiency.default.forward_overhead_s", -1e-4, r"efficiency\.default\.forward_overhead_s = -0\.0001: must be >= 0"),
        ("efficiency.default.backward_overhead_s", "1 ms", r"efficiency\.default\.backward_overhead_s = '1 ms'.*SI base"),
        ("memory_bytes_per_s.source", "guess", r"memory_bytes_per_s\.source = 'guess': must be one of"),
        ("links.intra_node.p2p.source", "vendor", r"links\.intra_node\.p2p\.source = 'vendor'"),
        ("links.intra_node.p2p.alpha_source", "vendor", r"links\.intra_node\.p2p\.alpha_source"),
        ("links.intra_node.p2p.fit_r2", 2.0, r"links\.intra_node\.p2p\.fit_r2 = 2\.0"),
        ("colour", "red", r"colour = 'red': is not a profile field"),
        ("links.rack", {"p2p": {"alpha_s": 0, "beta_s_per_byte": 0, "source": "ideal"}},
         r"links\.rack .* is not a known key of links; use one of intra_node, inter_node"),
        ("links.intra_node.broadcast", {"alpha_s": 0, "beta_s_per_byte": 0, "source": "ideal"},
         r"links\.intra_node\.broadcast .* is not a known key.*all_reduce"),
    ],
)
def test_validation_errors(ideal_dict: dict, path: str, value: object, message: str) -> None:
    with pytest.raises(MpipeError, match=message) as info:
        parse_profile(_set(ideal_dict, path, value), where="x.json")
    text = str(info.value)
    assert text.startswith("x.json: ") and "\n" not in text and ";" in text  # file, one line, a fix


def test_unknown_provenance_keys_are_kept(ideal_dict: dict) -> None:
    entry = {"alpha_s": 2e-6, "beta_s_per_byte": 1e-11, "source": "measured", "date": "2025-01-02",
             "fit_r2": 0.998, "sizes_bytes": [1024, 1048576], "median_s": [1e-6, 2e-5], "spread": 0.03}
    profile = parse_profile(_set(ideal_dict, "links.intra_node.p2p", entry), where="x.json")
    assert profile.link("p2p") == LinkCost(2e-6, 1e-11)
    assert profile.provenance["links.intra_node.p2p"]["spread"] == 0.03
    assert profile.to_dict()["links"]["intra_node"]["p2p"] == entry


def test_backward_efficiency_and_call_overheads_are_optional_numbers(ideal_dict: dict) -> None:
    entry = {"value": 0.4, "backward_value": 0.6, "forward_overhead_s": 5e-4, "backward_overhead_s": 1e-3,
             "source": "measured", "median_s": [1e-3, 2e-3]}
    profile = parse_profile(_set(ideal_dict, "efficiency.dense_block", entry), where="x.json")
    assert profile.efficiency_for("dense_block") == 0.4
    assert profile.backward_efficiency_for("dense_block") == 0.6
    assert profile.call_overhead_for("dense_block") == (5e-4, 1e-3)
    # Numbers, not provenance; the JSON form gives them back unchanged.
    assert "backward_value" not in profile.provenance["efficiency.dense_block"]
    assert profile.to_dict()["efficiency"]["dense_block"] == entry
    # Only one overhead given: the other is 0. Absent: the entry's value serves the backward, no overhead.
    only = parse_profile(_set(ideal_dict, "efficiency.default.backward_overhead_s", 2e-3), where="y.json")
    assert only.call_overhead_for("vit_block") == (0.0, 2e-3)
    plain = load_profile("ideal")
    assert plain.backward_efficiency_for("vit_block") == plain.efficiency_for("vit_block") == 1.0
    assert plain.call_overhead_for("vit_block") == (0.0, 0.0)
    assert profile.content_hash() != parse_profile(_set(ideal_dict, "efficiency.dense_block",
                                                        {**entry, "backward_value": 0.7}), where="z").content_hash()


def test_unknown_builtin_lists_the_names() -> None:
    with pytest.raises(MpipeError, match="unknown hardware profile 'h300'; built-in profiles: ascend-910b, "):
        load_profile("h300")


def test_unreadable_and_invalid_json(tmp_path) -> None:
    with pytest.raises(MpipeError, match="cannot read"):
        load_profile(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1,\n "name": }')
    with pytest.raises(MpipeError, match=r"bad\.json: not valid JSON \(line 2 column 10") as info:
        load_profile(str(bad))
    assert "\n" not in str(info.value)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    with pytest.raises(MpipeError, match="must be a JSON object"):
        load_profile(top)


# ---------------------------------------------------------------------------- dump and hash


@pytest.mark.parametrize("name", SHIPPED)
def test_dump_load_round_trip(tmp_path, name: str) -> None:
    profile = load_profile(name)
    out = tmp_path / f"{name}.json"
    dump_profile(profile.to_dict(), out)
    again = load_profile(out)
    assert again == profile
    assert again.content_hash() == profile.content_hash()
    assert again.to_dict() == profile.to_dict()
    assert json.loads(out.read_text()) == profile.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.json"]  # no temporary file left


def test_dump_validates_first_and_keeps_the_old_file(tmp_path, ideal_dict: dict) -> None:
    out = tmp_path / "p.json"
    dump_profile(ideal_dict, out)
    before = out.read_text()
    with pytest.raises(MpipeError, match="efficiency.default.value"):
        dump_profile(_set(ideal_dict, "efficiency.default.value", 2.0), out)
    assert out.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_content_hash_is_stable_and_tracks_the_data(ideal_dict: dict) -> None:
    a = parse_profile(ideal_dict, where="a.json")
    b = parse_profile(copy.deepcopy(ideal_dict), where="b.json")
    assert a.content_hash() == b.content_hash() == load_profile("ideal").content_hash()
    assert len(a.content_hash()) == 64 and hash(a) == hash(b)
    reordered = dict(reversed(list(ideal_dict.items())))
    assert parse_profile(reordered, where="c.json").content_hash() == a.content_hash()
    changed = parse_profile(_set(ideal_dict, "memory_bytes_per_s.value", 2e13), where="d.json")
    assert changed.content_hash() != a.content_hash()
    reref = parse_profile(_set(ideal_dict, "memory_bytes_per_s.ref", "other"), where="e.json")
    assert reref.content_hash() != a.content_hash()  # provenance is part of the data
    assert len({a, b, changed}) == 2


def test_profile_is_immutable() -> None:
    profile = load_profile("ideal")
    with pytest.raises(AttributeError):
        profile.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        profile.peak_flops_per_s["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError):
        profile.provenance["memory_bytes_per_s"]["source"] = "measured"  # type: ignore[index]


def test_a_dtype_far_below_the_best_training_dtype_gets_a_note() -> None:
    h100 = load_profile("h100-sxm")
    assert h100.slow_dtype_note("bf16") is None
    note = h100.slow_dtype_note("fp32")
    assert "15x below its bf16 peak" in note and "plan with dtype bf16" in note  # not fp8: no whole step runs in it
    assert load_profile("cpu-generic").slow_dtype_note("bf16") is None
