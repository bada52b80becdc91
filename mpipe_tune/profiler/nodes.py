"""Profiling links across nodes: ``mpipe-tune profile`` run by torchrun on several nodes.

Under torchrun every process runs the command. Each reads its place from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, and ``GROUP_RANK``, the node's rank
among the agents), joins the world group (``env://``: torchrun's ``MASTER_ADDR`` and ``MASTER_PORT``),
and the places of all ranks are exchanged and checked, so the node a rank counts as is the one its
torchrun agent gave it, never a guess from the host name. Then the two link classes are swept apart,
with the same sweep as one host's (:mod:`~mpipe_tune.profiler.links`), one class at a time while the
other ranks wait:

- ``intra_node``: the ranks of the first node (pairs on one node, and collectives over that node's
  devices, the group of a tensor- or data-parallel group inside a node); needs two or more processes a node;
- ``inter_node``: local rank 0 of every node (pairs across nodes, as a pipeline boundary or a
  hierarchical all-reduce's cross-node step sees them; collectives over one device a node).

Rank 0 gets both classes' sweeps (it is a member of both).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler.device import BACKENDS, Timer, import_torch, threads_per_process
from mpipe_tune.profiler.links import LinkSweep, GroupSweep
from mpipe_tune.profiler.settings import SweepSettings

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_DIST_TIMEOUT_S = 300
_MAX_WORLD = 2**20
"""More processes than any cluster runs: a larger WORLD_SIZE is a damaged environment."""


@dataclass(frozen=True)
class NodePlace:
    """Where one process runs, as its torchrun agent says."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    """torchrun's ``GROUP_RANK``: the rank of this process's agent (node) among the agents."""


def is_under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchrun (it sets every one of :data:`TORCHRUN_VARIABLES`)."""
    env = os.environ if env is None else env
    return all(name in env for name in TORCHRUN_VARIABLES)


def place_from_env(env: Mapping[str, str] | None = None) -> NodePlace:
    """This process's place from torchrun's environment, or one line naming what is missing or wrong."""
    env = os.environ if env is None else env
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        raise MpipeError(f"profiling across nodes runs under torchrun, which sets {', '.join(TORCHRUN_VARIABLES)}; "
                         f"{', '.join(missing)} not set: start it with torchrun --nnodes N --nproc-per-node K ...")
    try:
        values = {name: int(env[name]) for name in TORCHRUN_VARIABLES}
    except ValueError:
        shown = {name: env[name] for name in TORCHRUN_VARIABLES}
        raise MpipeError(f"torchrun's environment {shown} holds a value that is not an integer; start the "
                         f"command with torchrun") from None
    place = NodePlace(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"],
                      values["GROUP_RANK"])
    if not (0 <= place.rank < place.world_size <= _MAX_WORLD and 0 <= place.local_rank < place.local_world_size
            <= place.world_size and 0 <= place.node_rank < place.world_size):
        raise MpipeError(f"torchrun's environment is inconsistent ({place}); start the command with torchrun")
    _check_node(place, env)
    # as env:// reads them, unstripped: an address with a space or a control character (a NEL, U+0085, that
    # str.strip() removes) is no host name, and a port of other digits than 0-9 ('²') no port
    address, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if (not address or not address.isprintable() or any(c.isspace() for c in address)
            or not (re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535)):
        raise MpipeError(f"torchrun's environment gives MASTER_ADDR={env.get('MASTER_ADDR')!r} and "
                         f"MASTER_PORT={env.get('MASTER_PORT')!r}; the ranks meet at a host name or address and a port "
                         f"1-65535: start the command with torchrun (--rdzv-endpoint HOST:PORT)")
    return place


def _check_node(place: NodePlace, env: Mapping[str, str]) -> None:
    """The node's block of ranks against the world, before any rendezvous: torchrun numbers ranks node by node
    (node ``g``'s first rank is the sum of the earlier nodes' process counts), so every earlier node holds one
    rank at least, every later one too, and ``GROUP_WORLD_SIZE`` (where set) counts the nodes. An environment
    that breaks this would wait for a peer that cannot exist."""
    first = place.rank - place.local_rank
    nodes = env.get("GROUP_WORLD_SIZE")
    if nodes is not None and not re.fullmatch(r"[0-9]{1,7}", nodes):
        raise MpipeError(f"torchrun's environment gives GROUP_WORLD_SIZE={nodes[:20]!r}, not a node count; start the "
                         f"command with torchrun")
    after = place.world_size - first - place.local_world_size  # ranks on the nodes after this one
    later = None if nodes is None else int(nodes) - 1 - place.node_rank  # nodes after this one
    if after < 0 or place.node_rank > first or (later is not None and not 0 <= later <= after):
        counted = f"{nodes} nodes" if nodes is not None else f"nodes of {place.local_world_size} processes"
        raise MpipeError(f"torchrun's environment is inconsistent: node {place.node_rank} of {counted} holds ranks "
                         f"{first}..{first + place.local_world_size - 1} of a world of {place.world_size}, which leaves "
                         f"{first} ranks for the {place.node_rank} nodes before it and {after} for those after it; "
                         f"start every node with the same torchrun --nnodes and --nproc-per-node, and --node-rank 0..N-1")


def join_env_world(dist, backend: str, place: NodePlace, timeout_s: float, **kwargs) -> None:
    """``dist.init_process_group`` through torchrun's ``env://`` rendezvous, bounded by ``timeout_s``: peers that
    never come are one line (torch's own C++ log of a client's retries may come before it)."""
    try:
        dist.init_process_group(backend, init_method="env://", rank=place.rank, world_size=place.world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    except dist.DistError as exc:
        at = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        detail = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise MpipeError(f"rank {place.rank}: the {place.world_size} ranks did not all meet at {at} within "
                         f"{timeout_s:g} s ({detail}); start the same torchrun command on every node, rank 0's "
                         f"--rdzv-endpoint reachable from each") from None


@dataclass(frozen=True)
class NodeLayout:
    """Every rank's node, as the ranks reported it: node rank -> global ranks by local rank."""

    nodes: tuple[tuple[int, tuple[int, ...]], ...]

    @classmethod
    def from_places(cls, places: list[NodePlace]) -> "NodeLayout":
        by_node: dict[int, list[NodePlace]] = {}
        for place in places:
            by_node.setdefault(place.node_rank, []).append(place)
        nodes = tuple((node, tuple(p.rank for p in sorted(members, key=lambda p: p.local_rank)))
                      for node, members in sorted(by_node.items()))
        for node, members in by_node.items():
            if sorted(p.local_rank for p in members) != list(range(len(members))):
                raise MpipeError(f"node {node}: its ranks report local ranks {sorted(p.local_rank for p in members)}; "
                                 f"each node's processes must be local ranks 0..K-1 (torchrun --nproc-per-node K)")
        return cls(nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def devices_per_node(self) -> int:
        return min(len(ranks) for _, ranks in self.nodes)

    def intra_members(self) -> tuple[int, ...]:
        """The first node's ranks (empty when it holds a single process: no pair on one node)."""
        ranks = self.nodes[0][1]
        return ranks if len(ranks) >= 2 else ()

    def inter_members(self) -> tuple[int, ...]:
        """Local rank 0 of every node, in node order (empty on one node)."""
        return tuple(ranks[0] for _, ranks in self.nodes) if self.num_nodes >= 2 else ()


class _Progress:
    """The sweep's progress messages, handed to a callback (the sweep puts ``("progress", label)``)."""

    def __init__(self, progress: Callable[[str], None], prefix: str) -> None:
        self.progress, self.prefix = progress, prefix

    def put(self, message: tuple[str, str]) -> None:
        self.progress(f"{self.prefix} {message[1]}")


def measure_link_classes(device: str, place: NodePlace, settings: SweepSettings,
                         progress: Callable[[str], None]) -> tuple[NodeLayout, dict[str, dict[str, LinkSweep]] | None]:
    """Join torchrun's world, exchange and check every rank's node, and sweep both link classes.

    Returns the layout on every rank, and on rank 0 the sweeps by class (``intra_node`` and
    ``inter_node``, each present where its group has two members or more; None elsewhere)."""
    torch = import_torch(device)
    import torch.distributed as dist

    if device == "cpu":
        torch.set_num_threads(threads_per_process(place.local_world_size))
        where = "cpu"
    else:
        getattr(torch, device).set_device(place.local_rank)
        where = f"{device}:{place.local_rank}"
    bound = {} if device == "cpu" else {"device_id": torch.device(where)}
    join_env_world(dist, BACKENDS[device], place, _DIST_TIMEOUT_S, **bound)
    try:
        places: list = [None] * place.world_size
        dist.all_gather_object(places, place)
        layout = NodeLayout.from_places(places)
        if layout.num_nodes < 2:
            raise MpipeError(f"all {place.world_size} processes report node {layout.nodes[0][0]}: profiling across "
                             f"nodes needs torchrun --nnodes 2 or more")
        groups = {}
        for link_class, members in (("intra_node", layout.intra_members()), ("inter_node", layout.inter_members())):
            if members:  # every rank creates every group, in the same order, as new_group requires
                groups[link_class] = (members, dist.new_group(list(members)))
        timer = Timer(torch, device)
        sweeps: dict[str, dict[str, LinkSweep]] = {}
        for link_class, (members, group) in groups.items():
            result = None
            if place.rank in members:
                sweep = GroupSweep(torch, dist, where, timer, place.rank, members, group, settings)
                result = sweep.all_collectives(_Progress(progress, link_class) if place.rank == 0 else None)
            box = [result]
            dist.broadcast_object_list(box, src=members[0])  # to every rank, rank 0 among them
            sweeps[link_class] = box[0]
            dist.barrier()
        return layout, sweeps if place.rank == 0 else None
    finally:
        dist.destroy_process_group()
