"""The standard schedules as points of the same algebra: a cut, a skeleton list, slabs, owners.

No baseline has code of its own downstream: each is a :class:`Candidate` that ``derive`` and the
cost model treat like any searched one. With ``pre`` the layers before the first backbone (``llm``)
layer (encoder and projector) and the backbone split *evenly* by layer count (extra layers on the
last ranks, which carry no encoder):

- ``megatron``: ``<1f1b>``, one region; stage 0 holds the encoder, the projector and the first
  backbone share (Megatron-LM with the vision encoder in its first pipeline stage);
- ``disttrain``: ``<1f1b>``, one region; stage 0 holds only the encoder and projector, the backbone
  is split over the other ``P - 1`` ranks (the encoder on a dedicated stage, as in DistTrain);
- ``vpp``: ``<1f1b,1f1b>`` cut in the middle of the backbone, each half split as ``megatron`` does
  (interleaved 1F1B with two virtual stages per rank; ``M`` one that interleaving allows); with
  ``num_chunks`` v, ``v`` woven 1F1B regions over ``v`` even parts of the backbone;
- ``gpipe``: ``<gpipe>`` with ``megatron``'s slabs;
- ``mpipe-rr``: ``<transpose,1f1b>`` cut before the backbone, slabs balanced by expected cost,
  round-robin owners (the paper's default).

At ``pp = 1`` only ``megatron`` exists: the whole model on every rank, its data-, tensor- or fully-sharded
(ZeRO-3: FSDP) layout as Megatron-LM, MindSpeed-MM and torchtitan run small models. The others have no
meaning there (:data:`UNPIPELINED`, the reason each is left out, which the comparison table prints).

>>> even_split(10, 4)
(2, 2, 3, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

from mpipe_tune.algebra import Model, Candidate
from mpipe_tune.plan_file import BASELINES

UNPIPELINED = {
    "disttrain": "needs pp >= 2: the encoder's own stage and the backbone's",
    "vpp": "needs pp >= 2: at pp 1 there is no pipeline to interleave",
    "gpipe": "at pp 1 megatron's step holding every microbatch's activations",
    "mpipe-rr": "needs pp >= 2: at pp 1 no pipeline bubble for the encoder to fill",
}
"""The baselines that do not exist at ``pp = 1``, and why (at one pipeline rank every schedule runs the same
events in sequence: :meth:`~mpipe_tune.search._space.SearchSpace.unpipelined`)."""
_SCHEDULES = {"megatron": "1f1b", "disttrain": "1f1b", "gpipe": "gpipe", "mpipe-rr": "transpose,1f1b"}


def schedule_of(name: str, num_chunks: int = 2) -> str:
    """The skeleton list of baseline ``name`` (``vpp``: ``num_chunks`` woven 1F1B regions).

    >>> schedule_of("vpp", 3), schedule_of("mpipe-rr")
    ('1f1b,1f1b,1f1b', 'transpose,1f1b')
    """
    assert name in BASELINES, f"unknown baseline {name}"
    return _SCHEDULES.get(name) or ",".join(["1f1b"] * num_chunks)


def even_split(num_layers: int, num_parts: int) -> tuple[int, ...]:
    """``num_layers`` into ``num_parts`` counts differing by at most one, the larger ones last."""
    base, extra = divmod(num_layers, num_parts)
    return tuple(base + (1 if i >= num_parts - extra else 0) for i in range(num_parts))


def baseline(
    name: str, model: Model, pp: int, tp: int, dp: int, num_microbatches: int,
    vpp_microbatches: Sequence[int] = (), num_chunks: int = 2,
) -> Candidate | None:
    """The named baseline at the given degrees, or None where it does not exist (too few layers
    for its stages, no encoder to separate, no microbatch count that interleaving allows, or
    ``pp = 1`` for any but ``megatron``: :data:`UNPIPELINED`).

    ``vpp_microbatches``: the microbatch counts allowed for interleaving (the space's); the one
    nearest ``num_microbatches`` is used. ``num_chunks``: ``vpp``'s woven regions (>= 2).
    """
    if pp == 1 and name in UNPIPELINED:
        return None
    pre = model.backbone_start
    llm = model.num_layers - pre
    schedule = schedule_of(name, num_chunks)
    common = dict(pp=pp, tp=tp, dp=dp, num_microbatches=num_microbatches, label=name)
    if name in ("megatron", "gpipe"):
        if llm < pp:
            return None
        return Candidate(schedule, (), slab_counts=(_with_pre(pre, even_split(llm, pp)),), **common)
    if name == "disttrain":
        if pre == 0 or llm < pp - 1:
            return None
        return Candidate(schedule, (), slab_counts=((pre, *even_split(llm, pp - 1)),), **common)
    if name == "vpp":
        assert num_chunks >= 2, "interleaving needs two chunks or more"
        parts = even_split(llm, num_chunks)  # the smallest first
        if parts[0] < pp or not vpp_microbatches:
            return None
        m = min(vpp_microbatches, key=lambda k: (abs(k - num_microbatches), -k))
        slabs = (_with_pre(pre, even_split(parts[0], pp)), *(even_split(part, pp) for part in parts[1:]))
        cut = tuple(pre + sum(parts[:i + 1]) for i in range(num_chunks - 1))
        return Candidate(schedule, cut, slab_counts=slabs, **{**common, "num_microbatches": m})
    if pre == 0 or llm < pp:  # mpipe-rr
        return None
    return Candidate(schedule, (pre,), owner_policy="round-robin", **common)


def _with_pre(pre: int, shares: tuple[int, ...]) -> tuple[int, ...]:
    """Stage 0's share grown by the ``pre`` layers before the backbone (encoder and projector)."""
    return (pre + shares[0], *shares[1:])
