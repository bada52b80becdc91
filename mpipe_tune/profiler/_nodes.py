"""Profiling links across nodes: ``mpipe-tune profile`` run by torchrun on several nodes.

Under torchrun every process runs the command. Each reads its place from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, and ``GROUP_RANK``, the node's rank
among the agents), joins the world group (``env://``: torchrun's ``MASTER_ADDR`` and ``MASTER_PORT``),
and the places of all ranks are exchanged and checked, so the node a rank counts as is the one its
torchrun agent gave it, never a guess from the host name. Then the two link classes are swept apart,
with the same sweep as one host's (:mod:`~mpipe_tune.profiler._links`), one class at a time while the
other ranks wait:

- ``intra_node``: the ranks of the first node (pairs on one node, and collectives over that node's
  devices, the group of a tensor- or data-parallel group inside a node); needs two or more processes a node;
- ``inter_node``: local rank 0 of every node (pairs across nodes, as a pipeline boundary or a
  hierarchical all-reduce's cross-node step sees them; collectives over one device a node).

Rank 0 gets both classes' sweeps (it is a member of both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpipe_tune.errors import MpipeError
from mpipe_tune.profiler._device import BACKENDS, Timer, import_torch, threads_per_process
from mpipe_tune.profiler._links import LinkSweep, GroupSweep
from mpipe_tune.profiler._settings import SweepSettings
from mpipe_tune.runtime import NodePlace, join_env_world

_DIST_TIMEOUT_S = 300

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
