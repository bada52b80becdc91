"""A layout written as text, such as the one a user runs today, as a candidate of the same algebra
(:func:`~mpipe_tune.search._layout.parse_layout` also reads a MindSpeed-MM model.json).

The text is ``key=value`` pairs separated by commas; a piece without ``=`` continues the value
before it, so lists keep their commas: ``pp=4,tp=1,dp=2,schedule=transpose,1f1b,cut=9,M=8``.

=============  ============================================================================
``pp``         pipeline degree (required)
``tp``         tensor-parallel degree (default 1)
``dp``         data-parallel degree (default: the devices left, ``devices / (pp * tp)``)
``schedule``   skeleton list in its text form, e.g. ``1f1b`` or ``transpose,1f1b`` (required)
``M``          microbatches per replica (default: one sequence each, ``global batch / dp``)
``recompute``  ``on`` or ``off`` (default off; or ``none``, ``selective``, ``full``)
``cut``        interior boundaries in layers; with it, slabs are balanced by expected cost
               as the search balances them
``owners``     the transposed region's owner policy (default ``round-robin``)
=============  ============================================================================

A layout may also be written in the candidate's text form, as ``plan`` prints its best plan
(``<transpose,1f1b> cut 9  pp4 tp1 dp2  M=8  owners greedy``, :meth:`Candidate.parse`): the same
checks apply, and its other settings (slabs, ZeRO stage, sequence parallelism, ...) are kept.

Without ``cut``, a schedule takes its baseline's layout: ``1f1b`` is the Megatron-style one
(encoder and projector in stage 0, the backbone split evenly by layer count), ``gpipe`` the same
with GPipe, ``v`` woven ``1f1b`` regions the VPP one, ``transpose,1f1b`` the round-robin Mpipe one
(cut before the backbone); other schedules cut before the backbone (when they transpose) and
between woven regions by expected cost, as the search does.

>>> split_pairs("pp=4,tp=1,schedule=transpose,1f1b,M=8")
{'pp': '4', 'tp': '1', 'schedule': 'transpose,1f1b', 'M': '8'}
"""

from __future__ import annotations

from dataclasses import replace

from mpipe_tune.algebra import is_interleavable, Layout, Skeleton, parse_cut, parse_schedule, validate_schedule
from mpipe_tune.cost import tensor_parallel_fits
from mpipe_tune.errors import MpipeError
from mpipe_tune.search._baselines import baseline
from mpipe_tune.algebra import Candidate, RECOMPUTE_WORDS, parse_recompute, recompute_granularity
from mpipe_tune.search._owners import POLICIES
from mpipe_tune.search._space import SearchSpace

KEYS = ("pp", "tp", "dp", "schedule", "M", "recompute", "cut", "owners")
_LISTS = ("schedule", "cut")
"""Keys whose values hold commas."""
EXAMPLE = "pp=8,tp=1,dp=1,schedule=1f1b,M=16"


def _fail(where: str, what: str) -> MpipeError:
    return MpipeError(f"{where}: {what}")


def split_pairs(text: str, where: str | None = None) -> dict[str, str]:
    """The layout text as ``{key: value}``, checked for unknown, repeated and malformed keys
    (``where`` names the layout in errors; default ``layout '<text>'``)."""
    where = where or f"layout '{text}'"
    pairs: dict[str, str] = {}
    last = None
    for piece in (p.strip() for p in text.split(",")):
        if "=" in piece:
            key, value = (s.strip() for s in piece.split("=", 1))
            if key not in KEYS:
                raise _fail(where, f"key '{key}' is unknown; use {', '.join(KEYS)}, e.g. '{EXAMPLE}'")
            if key in pairs:
                raise _fail(where, f"key '{key}' is given twice; give each key once")
            pairs[key] = value
            last = key
        elif last in _LISTS and piece:
            pairs[last] += "," + piece
        else:
            raise _fail(where, f"'{piece}' is not a key=value pair; write the layout as '{EXAMPLE}'")
    for key in ("pp", "schedule"):
        if not pairs.get(key):
            raise _fail(where, f"key '{key}' is missing; a layout needs at least pp and schedule, e.g. '{EXAMPLE}'")
    return pairs


def _count(where: str, pairs: dict[str, str], key: str, meaning: str) -> int | None:
    if key not in pairs:
        return None
    try:
        value = int(pairs[key])
    except ValueError:
        value = 0
    if value < 1:
        raise _fail(where, f"{key}={pairs[key]}, but the {meaning} must be an integer >= 1")
    return value


def parse_layout_keys(text: str, space: SearchSpace, *, label: str = "current") -> Candidate:
    """The candidate ``text`` (``key=value`` pairs, or the candidate's text form) describes, for
    ``space``'s problem (devices, global batch, model, profile). Every check that needs no derive is
    made here, with one line naming the key, its value, what must hold and how to fix it; derive's
    own checks (supported schedules) apply when the candidate is evaluated."""
    if text.lstrip().startswith("<"):
        return _from_text_form(text, space, label)
    problem, model = space.problem, space.problem.model
    where = f"{label} layout '{text}'"
    pairs = split_pairs(text, where)
    pp = _count(where, pairs, "pp", "pipeline degree")
    tp = _count(where, pairs, "tp", "tensor-parallel degree") or 1
    dp = _count(where, pairs, "dp", "data-parallel degree")
    N, G = problem.devices, problem.global_batch
    if dp is None:
        if N % (pp * tp):
            raise _fail(where, f"pp*tp = {pp * tp} does not divide the {N} devices planned for; give dp= or degrees "
                              f"whose product is {N}")
        dp = N // (pp * tp)
    if pp * tp * dp != N:
        raise _fail(where, f"pp*tp*dp = {pp}*{tp}*{dp} = {pp * tp * dp}, but it must equal the {N} devices planned "
                          f"for; change the degrees (or the device count)")
    per_node = problem.profile.devices_per_node
    if per_node % tp or not tensor_parallel_fits(model, tp):
        raise _fail(where, f"tp={tp}, but the tensor-parallel degree must divide the {per_node} devices per node of "
                          f"profile '{problem.profile.name}' and the heads and split widths of model '{model.name}'")
    if G % dp:
        raise _fail(where, f"dp={dp}, but the data-parallel degree must divide the global batch of {G} sequences")
    try:
        schedule = parse_schedule(pairs["schedule"])
    except MpipeError as exc:
        raise _fail(where, str(exc)) from None
    sharded = [s for s in schedule.skeletons if s.layout is Layout.SHARDED]
    interleaved = len(sharded) > 1 and sharded[0].runs_in_rounds
    per_replica = G // dp

    def allows(d: int) -> bool:
        return per_replica % d == 0 and (not interleaved or is_interleavable(pp, d))

    m = _count(where, pairs, "M", "microbatch count") or per_replica
    if not allows(m):
        allowed = [d for d in range(1, per_replica + 1) if allows(d)]
        rule = f"divide the {per_replica} sequences per replica" + (
            f" and, interleaved over pp={pp}, run in equal rounds of M // pp" if interleaved else "")
        raise _fail(where, f"M={m}, but the microbatch count must {rule}; use one of "
                          f"{', '.join(map(str, allowed)) or 'none: change dp or the global batch'}")
    recompute = pairs.get("recompute", "off")
    if recompute not in RECOMPUTE_WORDS:
        raise _fail(where, f"recompute={recompute}, but it must be on or off (or {', '.join(RECOMPUTE_WORDS)})")
    owners = pairs.get("owners")
    transpose = Skeleton.TRANSPOSE in schedule.skeletons  # any transpose: they share the owner map
    if owners is not None and (owners not in POLICIES or not transpose):
        raise _fail(where, f"owners={owners}: give an owner policy ({', '.join(POLICIES)}) and only with a schedule "
                          f"that has a transpose")
    if "cut" in pairs:
        c = _with_cut(where, pairs["cut"], schedule, pp, space)
    else:
        c = _baseline_layout(where, schedule, pp, tp, dp, m, space)
    c = replace(c, pp=pp, tp=tp, dp=dp, num_microbatches=m, recompute=parse_recompute(recompute), label=label)
    if transpose:
        c = replace(c, owner_policy=owners or "round-robin")
    return c


def _from_text_form(text: str, space: SearchSpace, label: str) -> Candidate:
    """A layout in the candidate's text form (``Candidate.parse``; what ``plan`` prints as ``best:``),
    checked for the problem as the key=value form is: its degrees, schedule, cut, M, recomputation and
    owner policy go through the same checks, and its other settings are kept as written."""
    try:
        c = Candidate.parse(text)
    except MpipeError as exc:
        raise _fail(f"{label} layout '{text}'", str(exc)) from None
    if c.ep > 1 or c.cp > 1:  # the key=value checks cover pp * tp * dp devices
        raise _fail(f"{label} layout '{text}'", "a current layout with expert or context parallelism is not "
                                                "supported yet; give ep1 cp1")
    pairs = {"pp": c.pp, "tp": c.tp, "dp": c.dp, "schedule": c.schedule, "M": c.num_microbatches,
             "recompute": recompute_granularity(c.recompute), "cut": ",".join(map(str, c.cut))}
    if c.owner_policy is not None:
        pairs["owners"] = c.owner_policy
    if not c.cut:
        pairs.pop("cut")
    checked = parse_layout_keys(",".join(f"{k}={v}" for k, v in pairs.items()), space, label=label)
    return replace(c, cut=checked.cut, owner_policy=checked.owner_policy, label=label,
                   slab_counts=c.slab_counts if c.slab_counts is not None else checked.slab_counts)


def _with_cut(where: str, cut_text: str, schedule, pp: int, space: SearchSpace) -> Candidate:
    num_layers = space.num_layers
    try:
        cut = parse_cut(cut_text)
        validate_schedule(cut, schedule, num_layers)
    except MpipeError as exc:
        raise _fail(where, f"{exc}") from None
    for j, ((start, stop), layout) in enumerate(zip(cut.regions(num_layers), schedule.layouts()), start=1):
        if layout is Layout.SHARDED and stop - start < pp:
            raise _fail(where, f"region {j} holds {stop - start} layer(s), but each of the pp={pp} ranks needs at "
                              f"least one of a Sharded region's layers; move the cut or lower pp")
    return Candidate(str(schedule), cut.boundaries, pp, 1, 1, 1)


def _baseline_layout(where: str, schedule, pp: int, tp: int, dp: int, m: int, space: SearchSpace) -> Candidate:
    """The layout a schedule gets without ``cut`` (see the module docstring)."""
    model = space.problem.model
    skeletons = tuple(s.value for s in schedule.skeletons)
    transpose = skeletons[0] == Skeleton.TRANSPOSE.value
    woven = skeletons[transpose:]
    if not woven or len(set(woven)) > 1 or Skeleton.TRANSPOSE.value in woven:
        raise _fail(where, f"schedule '{schedule}' has no default cut (only [transpose,] and one Sharded skeleton "
                          f"repeated have one); give cut=")
    name = {("1f1b",): "megatron", ("gpipe",): "gpipe", ("transpose", "1f1b"): "mpipe-rr"}.get(skeletons)
    if name is None and not transpose and woven[0] == Skeleton.ONE_F_ONE_B.value:
        name = "vpp"
    start = model.backbone_start if transpose else 0
    c = None
    if name is not None:
        c = baseline(name, model, pp, tp, dp, m, vpp_microbatches=(m,), num_chunks=max(len(woven), 2))
    elif not transpose or start > 0:
        boundaries = space.woven_cut(start, len(woven), pp)
        if boundaries is not None:
            c = Candidate(str(schedule), ((start,) if transpose else ()) + boundaries, pp, tp, dp, m)
    if c is None:
        raise _fail(where, f"schedule '{schedule}' does not fit model '{model.name}' at pp={pp} ({model.num_layers} "
                          f"layers; each Sharded region needs pp layers, a transpose an encoder before the "
                          f"backbone); give cut= or lower pp")
    return c
