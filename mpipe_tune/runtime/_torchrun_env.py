"""torchrun's environment, read and checked before any rendezvous: where this process runs (its
:class:`NodePlace`), whether its node's block of ranks fits the world, and the bounded ``env://`` join.
Both the runtime's ranks and ``profile`` across nodes read it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from mpipe_tune.errors import MpipeError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
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
