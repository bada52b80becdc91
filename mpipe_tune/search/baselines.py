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
  (interleaved 1F1B with two virtual stages per rank; ``M`` a multiple of ``P``);
- ``gpipe``: ``<gpipe>`` with ``megatron``'s slabs;
- ``mpipe-rr``: ``<transpose,1f1b>`` cut before the backbone, slabs balanced by expected cost,
  round-robin owners (the paper's default).

>>> even_split(10, 4)
(2, 2, 3, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

from mpipe_tune.algebra.model import Model
from mpipe_tune.search.candidate import Candidate

BASELINES = ("megatron", "disttrain", "vpp", "gpipe", "mpipe-rr")
REFERENCE = "megatron"
"""The baseline speedups are measured against."""


def even_split(num_layers: int, num_parts: int) -> tuple[int, ...]:
    """``num_layers`` into ``num_parts`` counts differing by at most one, the larger ones last."""
    base, extra = divmod(num_layers, num_parts)
    return tuple(base + (1 if i >= num_parts - extra else 0) for i in range(num_parts))


def backbone_start(model: Model) -> int:
    """Index of the first backbone (``llm``) layer: the encoder and projector come before it."""
    return next((i for i, u in enumerate(model.layers) if u.block == "llm"), 0)


def baseline(
    name: str, model: Model, pp: int, tp: int, dp: int, num_microbatches: int,
    vpp_microbatches: Sequence[int] = (),
) -> Candidate | None:
    """The named baseline at the given degrees, or None where it does not exist (too few layers
    for its stages, no encoder to separate, or no microbatch count that interleaving allows).

    ``vpp_microbatches``: the microbatch counts allowed for interleaving (multiples of ``pp``); the
    one nearest ``num_microbatches`` is used.
    """
    pre = backbone_start(model)
    llm = model.num_layers - pre
    common = dict(pp=pp, tp=tp, dp=dp, num_microbatches=num_microbatches, label=name)
    if name in ("megatron", "gpipe"):
        if llm < pp:
            return None
        shares = even_split(llm, pp)
        slabs = ((pre + shares[0], *shares[1:]),)
        return Candidate("1f1b" if name == "megatron" else "gpipe", (), slab_counts=slabs, **common)
    if name == "disttrain":
        if pre == 0 or pp < 2 or llm < pp - 1:
            return None
        return Candidate("1f1b", (), slab_counts=((pre, *even_split(llm, pp - 1)),), **common)
    if name == "vpp":
        first = llm // 2
        if first < pp or llm - first < pp or not vpp_microbatches:
            return None
        m = min(vpp_microbatches, key=lambda k: (abs(k - num_microbatches), -k))
        shares = even_split(first, pp)
        slabs = ((pre + shares[0], *shares[1:]), even_split(llm - first, pp))
        return Candidate("1f1b,1f1b", (pre + first,), slab_counts=slabs,
                         **{**common, "num_microbatches": m})
    if name == "mpipe-rr":
        if pre == 0 or llm < pp:
            return None
        return Candidate("transpose,1f1b", (pre,), owner_policy="round-robin", **common)
    raise AssertionError(f"unknown baseline {name}")
