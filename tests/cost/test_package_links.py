"""Multi-die packages counted by die: ``devices_per_package`` and the ``intra_package`` link class."""

from __future__ import annotations

import copy

import pytest

from mpipe_tune.algebra import Candidate
from mpipe_tune.cost import Framework, predict
from mpipe_tune.cost._profile import PACKAGE_LINK_CLASS, load_profile, parse_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import load_model, sample_workload

DIE = "ascend-910c-cm384-die"


def test_the_die_profile_is_half_a_package_sixteen_a_server() -> None:
    die, package = load_profile(DIE), load_profile("ascend-910c-cm384")
    assert (die.devices_per_node, die.devices_per_package) == (16, 2)
    assert die.peak("bf16") * 2 == package.peak("bf16")
    assert die.memory_bytes_per_s * 2 == package.memory_bytes_per_s
    assert die.memory_capacity_bytes * 2 == package.memory_capacity_bytes
    # the package's UB figure is the two dies' together; every link figure cites its source or says assumed
    assert die.link("p2p").beta_s_per_byte == pytest.approx(2 * package.link("p2p").beta_s_per_byte)
    assert die.provenance[f"links.{PACKAGE_LINK_CLASS}.p2p"]["source"] == "assumed"
    assert all(die.provenance[f"links.{c}.p2p"]["source"] == "datasheet" for c in ("intra_node", "inter_node"))
    assert all("2506.12708" in die.provenance[key]["ref"]
               for key in ("peak_flops_per_s.bf16", "memory_bytes_per_s", "memory_capacity_bytes"))


def test_a_group_takes_the_class_it_spans() -> None:
    die, h100 = load_profile(DIE), load_profile("h100-sxm")
    assert [die.link_class_spanning(n) for n in (1, 2, 4, 16, 17, 512)] == [
        PACKAGE_LINK_CLASS, PACKAGE_LINK_CLASS, "intra_node", "intra_node", "inter_node", "inter_node"]
    assert [h100.link_class_spanning(n) for n in (1, 2, 8, 9)] == ["intra_node"] * 3 + ["inter_node"]
    assert [die.link_class_between(0, d) for d in (1, 2, 15, 16)] == [
        PACKAGE_LINK_CLASS, "intra_node", "intra_node", "inter_node"]
    assert die.link_class_between(1, 2) == "intra_node" and die.link_class_between(3, 2) == PACKAGE_LINK_CLASS


def _with_slow_package_link(factor: float = 1000.0):
    data = copy.deepcopy(load_profile(DIE).to_dict())
    for entry in data["links"][PACKAGE_LINK_CLASS].values():
        entry["beta_s_per_byte"] *= factor
    return parse_profile(data, where="test")


def _step_s(profile, *, pp: int, tp: int) -> float:
    model = load_model("tiny-vit-llm")
    workload = sample_workload("smoke", 8, seed=0)
    candidate = Candidate("1f1b", (), pp=pp, tp=tp, dp=1, num_microbatches=8)
    return predict(candidate, model, workload, profile, Framework()).timeline.makespan_s


def test_pipeline_neighbours_on_one_package_use_the_die_to_die_link() -> None:
    """At tp 1, pipeline ranks 0-1 and 2-3 share a package: a slower die-to-die link slows the step. At tp 2
    each rank is a whole package, its neighbours in other packages: the die-to-die link changes nothing there
    but the tensor-parallel all-reduces, which it carries."""
    shipped, slow = load_profile(DIE), _with_slow_package_link()
    assert _step_s(slow, pp=4, tp=1) > _step_s(shipped, pp=4, tp=1)
    assert _step_s(slow, pp=2, tp=2) > _step_s(shipped, pp=2, tp=2)  # the tp2 all-reduces inside the package
    assert _step_s(slow, pp=2, tp=4) == _step_s(shipped, pp=2, tp=4)  # tp4 spans two packages: intra_node


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["links"].pop(PACKAGE_LINK_CLASS),
     "links.intra_package is missing and must be given exactly when devices_per_package (2) is above 1"),
    (lambda d: d.pop("devices_per_package"),
     "must be given exactly when devices_per_package (1) is above 1"),
    (lambda d: d.update(devices_per_package=3), "devices_per_package = 3: must be an integer >= 1 that divides "
                                                 "devices_per_node (16)"),
    (lambda d: d.update(devices_per_package=True), "devices_per_package = True: must be an integer"),
])
def test_a_package_without_its_link_or_a_bad_count_is_refused_in_one_line(edit, message) -> None:
    data = copy.deepcopy(load_profile(DIE).to_dict())
    edit(data)
    with pytest.raises(MpipeError, match="^test: ") as info:
        parse_profile(data, where="test")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_die_profile_round_trips_and_single_die_profiles_keep_their_form() -> None:
    die = load_profile(DIE)
    assert parse_profile(die.to_dict(), where="again") == die
    assert "devices_per_package" not in load_profile("h100-sxm").to_dict()


def test_the_profiles_command_lists_the_die_profile(capsys) -> None:
    from mpipe_tune.cli import main

    assert main(["profiles"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "one die" in lines[DIE] and "376 TFLOP/s" in lines[DIE]
