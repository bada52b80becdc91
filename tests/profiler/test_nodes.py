"""Profiling links across nodes: the node identity from torchrun's environment, the two link classes'
groups, the merge into a single-node compute profile, and a real two-agent torchrun run on this host."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from mpipe_tune.cli import main
from mpipe_tune.cost import load_profile
from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler._build import COPIED_INTER_NODE, merge_link_classes
from mpipe_tune.profiler._links import LINK_COLLECTIVES, LinkSweep
from mpipe_tune.profiler._nodes import NodeLayout
from mpipe_tune.runtime import NodePlace, is_under_torchrun, place_from_env

pytest.importorskip("torch")

ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
       "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def test_the_place_is_torchrun_s():
    assert is_under_torchrun(ENV) and not is_under_torchrun({k: v for k, v in ENV.items() if k != "GROUP_RANK"})
    assert place_from_env(ENV) == NodePlace(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1)
    with pytest.raises(MpipeError, match="GROUP_RANK not set"):
        place_from_env({k: v for k, v in ENV.items() if k != "GROUP_RANK"})
    with pytest.raises(MpipeError, match="inconsistent"):
        place_from_env({**ENV, "LOCAL_RANK": "2"})
    with pytest.raises(MpipeError, match="MASTER_PORT='x'; the ranks meet at"):  # env:// would raise a traceback
        place_from_env({**ENV, "MASTER_PORT": "x"})
    # values the check once stripped or read as digits, while env:// reads them as they are (the fuzz test's
    # MASTER_ADDR '0\x85' passed as '0'; '²' is a digit to str.isdigit and no integer to int())
    for name, value in (("MASTER_ADDR", "0\x85"), ("MASTER_ADDR", "node0 "), ("MASTER_PORT", " 29500"),
                        ("MASTER_PORT", "\u00b2")):
        with pytest.raises(MpipeError, match="the ranks meet at a host name or address and a port"):
            place_from_env({**ENV, name: value})


def test_the_layout_groups_one_node_and_one_rank_per_node():
    places = [NodePlace(r, 6, r % 3, 3, node) for r, node in zip(range(6), (1, 1, 1, 0, 0, 0))]
    layout = NodeLayout.from_places(places)
    assert layout.nodes == ((0, (3, 4, 5)), (1, (0, 1, 2)))
    assert layout.intra_members() == (3, 4, 5) and layout.inter_members() == (3, 0)
    assert layout.devices_per_node == 3
    single = NodeLayout.from_places([NodePlace(r, 2, 0, 1, r) for r in range(2)])
    assert single.intra_members() == () and single.inter_members() == (0, 1)
    with pytest.raises(MpipeError, match="local ranks"):
        NodeLayout.from_places([NodePlace(0, 2, 0, 2, 0), NodePlace(1, 2, 0, 2, 0)])


def _sweeps(scale: float) -> dict[str, LinkSweep]:
    sizes = (1024, 65536, 1 << 20)
    return {c: LinkSweep(c, 2, sizes, tuple((scale * (1e-5 + s * 1e-9),) * 3 for s in sizes)) for c in LINK_COLLECTIVES}


def test_the_merge_keeps_the_compute_figures_and_replaces_the_measured_classes():
    compute = load_profile("h100-sxm").to_dict()
    compute["notes"] = "measured on one node. " + COPIED_INTER_NODE  # as a single-node profile says
    layout = NodeLayout.from_places([NodePlace(r, 4, r % 2, 2, r // 2) for r in range(4)])
    merged = merge_link_classes(compute, {"intra_node": _sweeps(1.0), "inter_node": _sweeps(10.0)}, layout,
                                device="cpu", name="cluster", quick=False, torch_version="x", date="2026-12-03")
    profile = load_profile_dict(merged)
    assert profile.peak_flops_per_s == load_profile("h100-sxm").peak_flops_per_s
    assert profile.devices_per_node == 2 and profile.name == "cluster"
    for collective in LINK_COLLECTIVES:
        inter, intra = profile.link(collective, inter_node=True), profile.link(collective, inter_node=False)
        assert inter.beta_s_per_byte == pytest.approx(10 * intra.beta_s_per_byte, rel=1e-6)
        assert profile.provenance[f"links.inter_node.{collective}"]["source"] == "measured"
    assert "measured classes intra_node, inter_node" in merged["notes"]
    assert "copy of the intra-node" not in merged["notes"] and merged["notes"].startswith("measured on one node.")
    only_inter = merge_link_classes(compute, {"inter_node": _sweeps(10.0)}, layout, device="cpu", name="c",
                                    quick=False, torch_version="x")
    assert only_inter["links"]["intra_node"] == compute["links"]["intra_node"]
    assert "intra_node kept from the compute profile 'h100-sxm'" in only_inter["notes"]
    only_intra = merge_link_classes(compute, {"intra_node": _sweeps(1.0)}, layout, device="cpu", name="c",
                                    quick=False, torch_version="x")
    assert COPIED_INTER_NODE in only_intra["notes"]  # still a copy: nothing measured it


def load_profile_dict(data):
    from mpipe_tune.cost import parse_profile

    return parse_profile(data, where="test")


def test_compute_without_torchrun_and_torchrun_without_compute_are_one_line(tmp_path, capsys, monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["profile", "--device", "cpu", "--compute", "ideal", "--out", str(tmp_path / "p.json")]) == 2
    assert "needs the command run by torchrun" in capsys.readouterr().err
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    assert main(["profile", "--device", "cpu", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "give --compute PROFILE" in err
    assert list(tmp_path.iterdir()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_as_two_nodes_measure_the_inter_node_class(tmp_path):
    """Two torchrun agents on a local rendezvous, two processes each: the written profile's inter-node
    class is measured between the nodes' local rank 0, not copied from the intra-node one."""
    out = tmp_path / "cluster.json"
    port = _free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mpipe-{port}",
               "-m", "mpipe_tune.cli", "profile", "--device", "cpu", "--quick", "--compute", "ideal",
               "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    agents = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=900) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    data = json.loads(out.read_text())
    profile = load_profile(str(out))
    assert profile.devices_per_node == 2
    assert profile.peak_flops_per_s == load_profile("ideal").peak_flops_per_s
    for collective in LINK_COLLECTIVES:
        inter, intra = data["links"]["inter_node"][collective], data["links"]["intra_node"][collective]
        assert inter["source"] == intra["source"] == "measured"
        assert inter["group_size"] == 2 and len(inter["median_s"]) == len(inter["sizes_bytes"]) >= 4
        assert "one process on each of 2 nodes" in inter["ref"] and "of one node" in intra["ref"]
        assert inter["median_s"] != intra["median_s"]  # two measurements, not one copied
    assert "measured classes intra_node, inter_node" in data["notes"]
    assert "node 0: ranks [0, 1], node 1: ranks [2, 3]" in data["notes"]  # the agents' GROUP_RANK, not a host name
    printed = "".join(o for o, _ in outputs)
    assert printed.count("wrote ") == 1 and "link (inter_node)" in printed  # rank 0 alone writes and prints
