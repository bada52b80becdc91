"""The search space: a tree of choices whose every leaf is a valid, derivable candidate.

Choices, each one's options computed from the earlier ones, so that no invalid point exists:

1. ``degrees``: ``(pp, tp, dp)`` with ``pp * tp * dp`` = the device count, ``tp`` dividing the
   devices of one node, ``dp`` dividing the global batch, any ``pp`` (``pp = 1`` is the data-, tensor- and
   fully-sharded layouts without a pipeline); with context parallelism searched, ``(pp, tp, dp, cp)`` with
   ``pp * tp * cp * dp`` = the device count;
2. ``schedule``: a skeleton list in normal form from the grammar ``[transpose,] S{v} [,transpose]``
   with ``S`` one Sharded skeleton and ``v`` woven regions (``v > 1`` is interleaving; ``zbv`` only
   with ``v = 2``, its V), kept only when some cut gives every Sharded region at least ``pp`` layers
   and some microbatch count fits it (at ``pp = 1`` one schedule only, :meth:`SearchSpace.schedules`: every
   skeleton list runs the same work in sequence on the one rank); the trailing (sink) transpose only for a model with a head after
   its backbone (a generator head, :attr:`~mpipe_tune.algebra._model.Model.head_start`); with
   :attr:`SpaceOptions.interior_transpose`, also ``S,transpose,S [,transpose]``, an interior transpose
   of the projector between a Sharded encoder and a Sharded backbone (two woven regions);
3. ``cut``: for a transpose, its boundary at the encoder/backbone seam or up to ``cut_window``
   layers either side; the boundaries between woven Sharded regions balance their expected cost; a
   sink transpose holds the head; an interior transpose holds the projector, its cut the seam's two
   ends (the first backbone layer after it);
4. ``microbatch_size``: sequences per microbatch ``s``, so that ``M = sequences per replica / s`` is
   at least ``pp`` (when possible), at most ``max_microbatches``, in equal rounds of ``M // pp`` for
   interleaved 1F1B and zb1p (a size, rather than ``M``, keeps its meaning when the degrees change);
5. ``owners``: the transposed region's owner policy (``optimal`` only for small ``M``);
6. ``recompute``: the recomputation granularity (none, selective, full), when several are searched;
7. ``ep``: the expert-parallel degree, when several are searched: those that divide ``dp * cp``, are
   multiples of ``cp`` and divide every MoE layer's experts (:meth:`CostOptions.validate_degrees`);
8. ``zero``: the ZeRO stage (0 to 3), then at stage 3 ``reshard``: its reshard policy (FSDP2's
   ``reshard_after_forward`` on or off), and ``sequence_parallel`` (with ``tp > 1``), when searched;
9. ``encoder_tp[4|2|1]``: the encoder's own tensor-parallel degree, a divisor of ``tp``, when searched
   and ``tp > 1`` (a space without it, or with ``tp = 1`` only, has the parameter names it had before);
10. ``encoder_backward``: where the owned encoder backwards run (``cooldown``, ``earliest``,
    ``optimised``; :mod:`mpipe_tune.algebra._encoder_backward`), when several are searched and the
    transposed region has a trainable layer.

:meth:`SearchSpace.build` walks the tree with a ``choose(name, options)`` callback: Optuna's
``suggest_categorical`` for sampling, an odometer for exhaustive enumeration. A choice whose options
depend on earlier choices gets a parameter name that carries them (``microbatch_size[1|2|4]``), so
Optuna never sees one name with two option sets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mpipe_tune.algebra import COOLDOWN, is_interleavable, balanced_counts, Skeleton
from mpipe_tune.cost import expert_parallel_fits, tensor_parallel_fits
from mpipe_tune.errors import MpipeError
from mpipe_tune.algebra import Candidate, Degrees
from mpipe_tune.search._owners import POLICIES
from mpipe_tune.search._problem import Problem

Choose = Callable[[str, Sequence[Any]], Any]


@dataclass(frozen=True)
class SpaceOptions:
    skeletons: tuple[str, ...] = ("1f1b", "gpipe")
    """Sharded skeletons the wavefront may use."""
    max_chunks: int = 2
    """Most Sharded regions woven into one wavefront (2: plain and interleaved with two chunks)."""
    transpose: bool = True
    """Also search schedules that transpose the encoder."""
    head_transpose: bool = True
    """Also search schedules that transpose the model's head as a sink region (``1f1b,transpose``,
    ``transpose,1f1b,transpose``), where the model has one (layers after its last backbone layer)."""
    interior_transpose: bool = False
    """Also search schedules that transpose the model's projector as an interior region (``S,transpose,S``,
    and ``S,transpose,S,transpose`` with a sink): the encoder is then a Sharded region of its own, woven
    with the backbone's, and each microbatch's projector runs on its owner. Only where the model has
    projector layers between its encoder and its backbone, each side at least ``pp`` layers."""
    cut_window: int = 1
    """Layers either side of the encoder/backbone seam the transpose boundary may move."""
    owner_policies: tuple[str, ...] = POLICIES
    optimal_max_microbatches: int = 12
    """``optimal`` owners (exact branch and bound) only up to this many microbatches ..."""
    optimal_max_ranks: int = 16
    """... and this many pipeline ranks."""
    max_microbatches: int = 64
    recompute: tuple[bool | str, ...] = (False,)
    """Activation recomputation settings to try: ``(False,)``, ``(True,)``, ``(False, True)``, or any of
    ``False``, ``"selective"``, ``True``."""
    ep: tuple[int, ...] | None = (1,)
    """Allowed expert-parallel degrees; None: every one the degrees and the model's experts allow."""
    cp: tuple[int, ...] = (1,)
    """Allowed context-parallel degrees."""
    zero: tuple[int, ...] = (1,)
    """ZeRO stages to try: ``(1,)`` (a distributed optimizer), ``(0,)``, ``(0, 1)``, ... up to ``(0, 1, 2, 3)``."""
    reshard: tuple[bool | None, ...] = (None,)
    """The reshard policies tried at stage-3 points (:attr:`~mpipe_tune.algebra._candidate.Candidate.reshard_after_forward`:
    ``True`` gathers the weights for every forward and backward, ``False`` keeps them through the step; ``(None,)``:
    the default for each pipeline degree); a search dimension of its own where it has several."""
    sequence_parallel: tuple[bool, ...] = (False,)
    """Sequence-parallel settings to try where ``tp > 1``."""
    encoder_tp: bool = False
    """Also search the encoder's own tensor-parallel degree over the divisors of ``tp`` (where
    ``tp > 1``; see :attr:`~mpipe_tune.cost._layers.CostOptions.encoder_tp`)."""
    encoder_backward: tuple[str, ...] = (COOLDOWN,)
    """Encoder backward placements to try where the transposed region is trainable (the first is used alone)."""
    min_pp: int = 1
    """The smallest pipeline degree searched (1: the layouts without a pipeline too)."""
    pp: tuple[int, ...] | None = None
    """Allowed pipeline degrees (None: any)."""
    tp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class SearchSpace:
    """The candidates a search may emit for one problem: the tree of choices (degrees, schedule,
    cut, microbatches, owners, memory settings, ...) whose every leaf is a valid candidate, walked by
    a sampler (:meth:`build`) or exhaustively (:meth:`enumerate`)."""

    def __init__(self, problem: Problem, weights: Sequence[float], options: SpaceOptions = SpaceOptions()) -> None:
        """``weights``: expected seconds per layer, used to balance the cuts between woven regions."""
        if isinstance(options.cut_window, bool) or not isinstance(options.cut_window, int) or options.cut_window < 0:
            raise MpipeError(f"the cut window is {options.cut_window!r} layers, but it must be an integer >= 0 (how far "
                             f"either side of the encoder/backbone seam a transpose cut may move; 0 keeps it there)")
        self.problem = problem
        self.options = options
        self.weights = tuple(weights)
        model = problem.model
        self.num_layers = model.num_layers
        self.encoder_end = model.encoder_end
        self.backbone_start = model.backbone_start
        self.head_start = model.head_start
        self.family = self._family()
        self.cut_window = tuple(range(max(1, self.encoder_end - options.cut_window),
                                      min(self.num_layers - 1, self.backbone_start + options.cut_window) + 1))
        self._schedules: dict[tuple[int, int], list[str]] = {}
        self._cuts: dict[tuple, object] = {}  # woven_cut and transpose_cuts, which the tree walk repeats
        self._experts: dict[tuple[int, int], list[int]] = {}
        self.layouts = self._layouts()
        """``(pp, tp, dp, cp)`` of every device layout the space holds."""
        self.layout_names = [layout_name(layout) for layout in self.layouts]
        """Each of :attr:`layouts` as the ``degrees`` choice names it (named once: the tree walk builds every point)."""
        self._layout_of = dict(zip(self.layout_names, self.layouts))
        self.degrees = [(pp, tp, dp) for pp, tp, dp, _ in self.layouts]
        """``(pp, tp, dp)`` of each of :attr:`layouts` (its ``cp`` left out)."""
        problem.validate_sampling(min(dp for _, _, dp in self.degrees))

    # ------------------------------------------------------------------------------- pieces

    def _family(self) -> list[str]:
        firsts = [()]
        if self.options.transpose and self.encoder_end > 0:
            firsts.append((Skeleton.TRANSPOSE.value,))
        lasts = [()]
        if self.options.transpose and self.options.head_transpose and self.head_start < self.num_layers:
            lasts.append((Skeleton.TRANSPOSE.value,))
        out = []
        for first in firsts:
            for last in lasts:
                for skeleton in self.options.skeletons:
                    counts = Skeleton(skeleton).chunk_counts or range(1, self.options.max_chunks + 1)
                    for v in counts:
                        if v <= self.options.max_chunks:
                            out.append(",".join(first + (skeleton,) * v + last))
        if self.options.interior_transpose and 0 < self.encoder_end < self.backbone_start:
            for last in lasts:
                for skeleton in self.options.skeletons:
                    if 2 in (Skeleton(skeleton).chunk_counts or (2,)) and self.options.max_chunks >= 2:
                        out.append(",".join((skeleton, Skeleton.TRANSPOSE.value, skeleton) + last))
        return out

    def shape(self, schedule: str) -> tuple[bool, int, bool]:
        """A family schedule's (source transpose, woven Sharded regions, sink transpose)."""
        skeletons = schedule.split(",")
        transpose = skeletons[0] == Skeleton.TRANSPOSE.value
        sink = len(skeletons) > 1 and skeletons[-1] == Skeleton.TRANSPOSE.value
        return transpose, sum(s != Skeleton.TRANSPOSE.value for s in skeletons), sink

    @staticmethod
    def interior(schedule: str) -> bool:
        """Whether a family schedule transposes an interior region (the projector: ``S,transpose,S``)."""
        return Skeleton.TRANSPOSE.value in schedule.split(",")[1:-1]

    def interior_cut(self, pp: int, stop: int | None = None) -> tuple[int, int] | None:
        """The cut of an interior transpose of the projector (its two ends), None when the encoder or
        the backbone (up to ``stop``) has fewer than ``pp`` layers."""
        stop = self.num_layers if stop is None else stop
        if self.encoder_end < pp or stop - self.backbone_start < pp:
            return None
        return self.encoder_end, self.backbone_start

    def woven_cut(self, start: int, chunks: int, pp: int, stop: int | None = None) -> tuple[int, ...] | None:
        """Boundaries splitting layers ``[start, stop)`` (default: to the last layer) into ``chunks``
        Sharded regions of balanced expected cost (equal layer counts if that leaves a region under
        ``pp`` layers); None when no split gives every region ``pp`` layers."""
        stop = self.num_layers if stop is None else stop
        key = ("woven", start, chunks, pp, stop)
        if key not in self._cuts:
            self._cuts[key] = self._woven_cut(start, chunks, pp, stop)
        return self._cuts[key]

    def _woven_cut(self, start: int, chunks: int, pp: int, stop: int) -> tuple[int, ...] | None:
        n = stop - start
        if n < chunks * pp:
            return None
        counts = balanced_counts(self.weights[start:stop], chunks) if chunks > 1 else (n,)
        if min(counts) < pp:
            counts = tuple(n // chunks + (1 if i < n % chunks else 0) for i in range(chunks))
        boundaries, at = [], start
        for count in counts[:-1]:
            at += count
            boundaries.append(at)
        return tuple(boundaries)

    def transpose_cuts(self, pp: int, chunks: int, stop: int | None = None) -> list[int]:
        key = ("transpose", pp, chunks, stop)
        if key not in self._cuts:
            self._cuts[key] = [b for b in self.cut_window if self.woven_cut(b, chunks, pp, stop) is not None]
        return self._cuts[key]

    def cut_of(self, schedule: str, pp: int, boundary: int | None) -> tuple[int, ...]:
        """The cut of a family schedule at ``pp``: the source transpose's ``boundary`` (None without
        one), the woven regions' balanced boundaries, and the head's start for a sink transpose."""
        _, chunks, sink = self.shape(schedule)
        stop = self.head_start if sink else None
        if self.interior(schedule):
            woven = self.interior_cut(pp, stop)
        else:
            woven = self.woven_cut(0 if boundary is None else boundary, chunks, pp, stop)
        return ((boundary,) if boundary is not None else ()) + woven + ((self.head_start,) if sink else ())

    def microbatch_choices(self, pp: int, dp: int, schedule: str) -> list[int]:
        """Microbatch counts dividing a replica's sequences, at most ``max_microbatches``, at least
        ``pp`` when some is (else the largest); for interleaved 1F1B only those that split into its
        equal rounds (:func:`~mpipe_tune.algebra._order.is_interleavable`, torch's rule)."""
        woven = [Skeleton(s) for s in schedule.split(",") if s != Skeleton.TRANSPOSE.value]
        interleaved = len(woven) > 1 and woven[0].runs_in_rounds
        options = [
            d for d in divisors(self.problem.global_batch // dp)
            if d <= self.options.max_microbatches and (not interleaved or is_interleavable(pp, d))
        ]
        full = [d for d in options if d >= pp]
        return full or options[-1:]

    def owner_choices(self, pp: int, num_microbatches: int) -> list[str]:
        small = num_microbatches <= self.options.optimal_max_microbatches and pp <= self.options.optimal_max_ranks
        return [p for p in self.options.owner_policies if p != "optimal" or small]

    def schedules(self, pp: int, dp: int) -> list[str]:
        """The family's schedules that some cut and microbatch count fit at ``pp`` and ``dp``; at ``pp = 1``
        only the first of them with one Sharded region and no transpose, ``1f1b`` where the space has it
        (:meth:`unpipelined`)."""
        key = (pp, dp)
        if key not in self._schedules:
            out = []
            for schedule in self.unpipelined() if pp == 1 else self.family:
                transpose, chunks, sink = self.shape(schedule)
                stop = self.head_start if sink else None
                if self.interior(schedule):
                    cut_ok = self.interior_cut(pp, stop) is not None
                elif transpose:
                    cut_ok = bool(self.transpose_cuts(pp, chunks, stop))
                else:
                    cut_ok = self.woven_cut(0, chunks, pp, stop) is not None
                if cut_ok and self.microbatch_choices(pp, dp, schedule):
                    out.append(schedule)
            self._schedules[key] = out
        return self._schedules[key]

    def unpipelined(self) -> list[str]:
        """The one schedule searched at ``pp = 1`` (none where the family has no plain one, e.g. ``zbv`` alone).

        On one pipeline rank every skeleton list is gradient accumulation over the microbatches: the same
        events on one rank, one at a time, with nothing to overlap. ``1f1b`` frees each microbatch's
        activations before the next forward; ``gpipe`` and a transpose keep every microbatch's until the
        backwards (as much time, more memory), and interleaving only adds seams (and, at ZeRO 3, gathers).
        So the others are duplicates of it, or worse, and are not searched.
        """
        plain = [s for s in self.family if self.shape(s) == (False, 1, False)]
        return sorted(plain, key=lambda s: s != "1f1b")[:1]

    def expert_choices(self, dp: int, cp: int) -> list[int]:
        """The expert-parallel degrees allowed at ``dp`` and ``cp`` (always 1 among them)."""
        key = (dp, cp)
        if key not in self._experts:
            allowed = self.options.ep or divisors(dp * cp)
            self._experts[key] = [e for e in allowed if e == 1 or (
                (dp * cp) % e == 0 and e % cp == 0 and expert_parallel_fits(self.problem.model, e))]
        return self._experts[key]

    def _layouts(self) -> list[tuple[int, int, int, int]]:
        o, N, G = self.options, self.problem.devices, self.problem.global_batch
        per_node = self.problem.profile.devices_per_node
        out = []
        for tp in divisors(per_node):
            if N % tp or (o.tp is not None and tp not in o.tp) or not tensor_parallel_fits(self.problem.model, tp):
                continue
            for cp in sorted(set(o.cp)):
                if cp < 1 or (N // tp) % cp:
                    continue
                for pp in divisors(N // (tp * cp)):
                    dp = N // (tp * cp * pp)
                    if pp < o.min_pp or (o.pp is not None and pp not in o.pp) or (o.dp is not None and dp not in o.dp):
                        continue
                    if G % dp == 0 and self.schedules(pp, dp) and self.expert_choices(dp, cp):
                        out.append((pp, tp, dp, cp))
        if not out:
            pinned = (("pp", o.pp), ("tp", o.tp), ("dp", o.dp), ("cp", o.cp if o.cp != (1,) else None), ("ep", o.ep))
            for axis, values in pinned[:3]:
                if values and all(v < 1 or N % v for v in values):
                    raise MpipeError(
                        f"--{axis} {','.join(map(str, values))} does not divide the {N} devices (pp*tp*dp = {N}): "
                        f"pin a divisor of {N} ({', '.join(map(str, divisors(N)))}) or change --devices")
            given = [f"{k} pinned to {','.join(map(str, v))}" for k, v in pinned if v]
            pins = f" ({', '.join(given)})" if given else ""
            lowest = f">= {o.min_pp} and " if o.min_pp > 1 else ""
            single = "" if self.unpipelined() else " (pp 1 also needs a one-region skeleton: 1f1b, gpipe or zb1p)"
            raise MpipeError(
                f"no (pp, tp, dp) with pp*tp*dp = {N} devices gives a plan{pins}: pp must be {lowest}at most the layer "
                f"count (model '{self.problem.model.name}' has {self.num_layers} layers){single}, tp must divide the "
                f"{per_node} devices per node of profile '{self.problem.profile.name}' and the model's heads and split "
                f"widths, dp must divide the global batch {G}; change the device count or the global batch"
            )
        return sorted(out, key=lambda layout: (layout[3], layout[:3]))  # cp = 1 first, as before cp existed

    # ------------------------------------------------------------------------------ the tree

    def param_name(self, name: str, options: Sequence[Any], full: Sequence[Any] | None) -> str:
        if full is not None and list(options) == list(full):
            return name
        return f"{name}[{'|'.join(map(str, options))}]"

    def build(self, choose: Choose) -> Candidate:
        """Walk the choices with ``choose(param_name, options) -> option``; return the leaf."""
        pp, tp, dp, cp = self._layout_of[choose("degrees", self.layout_names)]
        schedules = self.schedules(pp, dp)
        schedule = choose(self.param_name("schedule", schedules, self.family), schedules)
        transpose, chunks, sink = self.shape(schedule)
        boundary = None
        if transpose:
            cuts = self.transpose_cuts(pp, chunks, self.head_start if sink else None)
            boundary = choose(self.param_name("cut", cuts, self.cut_window), cuts)
        cut = self.cut_of(schedule, pp, boundary)
        per_replica = self.problem.global_batch // dp
        sizes = [per_replica // m for m in reversed(self.microbatch_choices(pp, dp, schedule))]
        num_microbatches = per_replica // choose(self.param_name("microbatch_size", sizes, None), sizes)
        policy = None
        if transpose or sink or self.interior(schedule):
            policies = self.owner_choices(pp, num_microbatches)
            policy = choose(self.param_name("owners", policies, self.options.owner_policies), policies)
        settings = list(self.options.recompute)
        recompute = choose("recompute", settings) if len(settings) > 1 else settings[0]
        experts = self.expert_choices(dp, cp)
        ep = choose(self.param_name("ep", experts, self.options.ep), experts) if len(experts) > 1 else experts[0]
        stages = list(self.options.zero)
        zero = choose("zero", stages) if len(stages) > 1 else stages[0]
        policies = list(self.reshard_choices(zero))
        reshard = choose("reshard", policies) if len(policies) > 1 else policies[0]
        sequence = list(self.options.sequence_parallel) if tp > 1 else [False]
        sp = choose("sequence_parallel", sequence) if len(sequence) > 1 else sequence[0]
        encoders = self.encoder_tp_choices(tp)
        encoder_tp = choose(self.param_name("encoder_tp", encoders, None), encoders) if len(encoders) > 1 else tp
        placements = self.encoder_backward_choices(cut[0]) if transpose else [COOLDOWN]
        placement = choose("encoder_backward", placements) if len(placements) > 1 else placements[0]
        return Candidate(schedule, cut, pp, tp, dp, num_microbatches, policy, recompute=recompute, ep=ep, cp=cp,
                         zero_stage=zero, sequence_parallel=sp, encoder_tp=encoder_tp, encoder_backward=placement,
                         reshard_after_forward=reshard)

    def reshard_choices(self, zero_stage: int) -> tuple[bool | None, ...]:
        """The reshard policies searched at ``zero_stage``: the space's at stage 3, none (``None``) below it."""
        return self.options.reshard if zero_stage == 3 else (None,)

    def encoder_backward_choices(self, boundary: int) -> list[str]:
        """The encoder backward placements searched for a transpose of layers ``[0, boundary)``: the
        space's, where one of those layers is trainable (else there is no encoder backward to place)."""
        if not any(self.problem.model.trainable_bits()[:boundary]):
            return [COOLDOWN]
        return list(self.options.encoder_backward)

    def encoder_tp_choices(self, tp: int) -> list[int]:
        """The encoder's tensor-parallel degrees searched at ``tp``: ``tp`` first, then its smaller divisors
        (only ``tp`` unless :attr:`SpaceOptions.encoder_tp` and the model has encoder layers)."""
        if not self.options.encoder_tp or self.encoder_end == 0:
            return [tp]
        return sorted(divisors(tp), reverse=True)

    def memory_settings(self, dp: int, cp: int, tp: int) -> list[dict[str, Any]]:
        """Every combination of the choices after the schedule's at these degrees (recompute, ep, ZeRO
        stage, sequence parallelism), as Candidate fields: what a baseline's family ranges over."""
        sequence = list(self.options.sequence_parallel) if tp > 1 else [False]
        return [{"recompute": r, "ep": e, "zero_stage": z, "reshard_after_forward": policy, "sequence_parallel": sp,
                 "encoder_tp": et}
                for r in self.options.recompute for e in self.expert_choices(dp, cp)
                for z in self.options.zero for policy in self.reshard_choices(z) for sp in sequence
                for et in self.encoder_tp_choices(tp)]

    def enumerate(self) -> Iterator[tuple[dict[str, Any], Candidate]]:
        """Every leaf once, with the parameters that select it."""
        for _, params, candidate in self.walk():
            yield params, candidate

    def walk(self, fixed: dict[str, Any] | None = None) -> Iterator[tuple[tuple[int, ...], dict[str, Any], Candidate]]:
        """Every leaf once in tree order, as (key, parameters, candidate); ``key`` is the leaf's path of
        option indices, so that keys sort as the leaves come. ``fixed``: a value per choice's base name
        (``microbatch_size``, ``ep``): only the leaves that take it where the choice is made."""
        path: list[int] = []
        while True:
            sizes: list[int] = []
            key: list[int] = []
            params: dict[str, Any] = {}

            def choose(name: str, options: Sequence[Any]) -> Any:
                depth = len(sizes)
                base = _base(name) if fixed is not None else None
                if base is not None and base in fixed:
                    # the options that are the fixed value, of its type (False is not 0: recomputation and the
                    # ZeRO stage are different choices)
                    value, kind = fixed[base], type(fixed[base])
                    indices: Sequence[int] = [i for i, option in enumerate(options)
                                              if type(option) is kind and option == value]
                else:
                    indices = range(len(options))
                sizes.append(len(indices))
                if not indices:
                    raise _NoLeaf
                if depth == len(path):
                    path.append(0)
                key.append(indices[path[depth]])
                params[name] = options[key[-1]]
                return params[name]

            try:
                candidate = self.build(choose)
            except _NoLeaf:  # the fixed values leave this branch empty
                candidate = None
            if candidate is not None:
                yield tuple(key), params, candidate
            del path[len(sizes):]
            while path and path[-1] + 1 >= sizes[len(path) - 1]:
                path.pop()
            if not path:
                return
            path[-1] += 1

    def groups(self) -> Iterator[Group]:
        """The space's points in groups that share their bounds' layer tables: per layout, microbatch count
        and memory setting (recompute, ep, ZeRO stage and reshard policy, sequence parallelism, encoder tp), those of every
        schedule, cut, owner policy and encoder backward placement (empty groups left out)."""
        for layout in self.layouts:
            pp, tp, dp, cp = layout
            counts = sorted({m for s in self.schedules(pp, dp) for m in self.microbatch_choices(pp, dp, s)})
            for m in counts:
                size = self._group_size(pp, dp, m)
                if size:
                    for setting in self.memory_settings(dp, cp, tp):
                        yield Group(layout, m, tuple(setting[_SETTING_FIELDS.get(k, k)] for k in GROUP_SETTING), size)

    def _group_size(self, pp: int, dp: int, num_microbatches: int) -> int:
        """Points per memory setting of a layout and microbatch count (they do not depend on the setting)."""
        size = 0
        for schedule in self.schedules(pp, dp):
            if num_microbatches not in self.microbatch_choices(pp, dp, schedule):
                continue
            transpose, chunks, sink = self.shape(schedule)
            owners = len(self.owner_choices(pp, num_microbatches)) if transpose or sink or self.interior(schedule) else 1
            if not transpose:
                size += owners
                continue
            for boundary in self.transpose_cuts(pp, chunks, self.head_start if sink else None):
                size += owners * len(self.encoder_backward_choices(boundary))
        return size

    def group_points(self, group: Group) -> Iterator[tuple[tuple[int, ...], dict[str, Any], Candidate]]:
        """The points of ``group`` in tree order, as :meth:`walk` gives them (with their keys)."""
        per_replica = self.problem.global_batch // group.layout[2]
        fixed = {"degrees": layout_name(group.layout), "microbatch_size": per_replica // group.num_microbatches,
                 **dict(zip(GROUP_SETTING, group.setting))}
        return self.walk(fixed)

    def size(self) -> int:
        return sum(1 for _ in self.enumerate())

    def neighbors(self, params: dict[str, Any]) -> list[tuple[dict[str, Any], Candidate]]:
        """The points that differ from ``params``'s point in one choice, deepest choice first.

        Choices below the changed one keep their value where it is still an option (by the choice's
        base name: ``microbatch_size[1|2]`` and ``microbatch_size[2|4]`` are one choice), else take the
        nearest number or the first option.
        """
        path: list[tuple[str, list[Any]]] = []

        def follow(name: str, options: Sequence[Any]) -> Any:
            path.append((name, list(options)))
            return params[name] if params.get(name) in options else options[0]

        self.build(follow)
        by_base = {_base(name): value for name, value in params.items()}
        out = []
        for depth in reversed(range(len(path))):
            name, options = path[depth]
            for alternative in options:
                if alternative == params.get(name):
                    continue
                new: dict[str, Any] = {}

                def choose(n: str, opts: Sequence[Any]) -> Any:
                    level = len(new)
                    if level < depth:
                        value = params[n]
                    elif level == depth:
                        value = alternative
                    else:
                        value = _nearest(by_base.get(_base(n)), list(opts))
                    new[n] = value
                    return value

                out.append((new, self.build(choose)))
        return out


GROUP_SETTING = ("recompute", "ep", "zero", "reshard", "sequence_parallel", "encoder_tp")
"""The memory setting of a :class:`Group`: the choices' base names (:meth:`SearchSpace.build`)."""
_SETTING_FIELDS = {"zero": "zero_stage", "reshard": "reshard_after_forward"}
"""Where a :data:`GROUP_SETTING` name differs from its Candidate field (:meth:`SearchSpace.memory_settings`)."""


@dataclass(frozen=True)
class Group:
    """Points of the space that share their layout, microbatch count and memory setting: what a layer table
    and the static memory floor depend on, so that one bound holds for them all (see :meth:`SearchSpace.groups`)."""

    layout: tuple[int, int, int, int]
    """``(pp, tp, dp, cp)``."""
    num_microbatches: int
    setting: tuple
    """Values of :data:`GROUP_SETTING`, in its order."""
    size: int
    """How many points the group holds."""


def layout_name(layout: tuple[int, int, int, int]) -> str:
    """A layout as the ``degrees`` choice names it: the degrees' text form with hyphens for spaces (an Optuna
    parameter value: ``pp4-tp2-dp2``, with ``-cp2`` where ``cp > 1``)."""
    pp, tp, dp, cp = layout
    return str(Degrees(pp, tp, dp, cp=cp)).replace(" ", "-")


class _NoLeaf(Exception):
    """A walk with fixed values reached a choice none of whose options takes them."""


@functools.lru_cache(maxsize=1024)
def _base(name: str) -> str:
    """A choice's base name: ``microbatch_size[1|2]`` -> ``microbatch_size`` (kept: the tree walk asks for every
    choice of every point)."""
    return name.split("[", 1)[0]


def _nearest(value: Any, options: list[Any]) -> Any:
    if value in options:
        return value
    if isinstance(value, int) and all(isinstance(o, int) for o in options):
        return min(options, key=lambda o: (abs(o - value), o))
    return options[0]


def twin_bounds(space: SearchSpace) -> bool:
    """Whether ``space`` searches ZeRO-1 beside ZeRO-2 or 3: then a stage-2 or stage-3 plan's stage-1 twin is a
    point of it, predicted where its own bound lets it, and its step bounds the plan's
    (:attr:`~mpipe_tune.search._evaluate.Evaluator.twin_bounds`)."""
    return 1 in space.options.zero and any(z >= 2 for z in space.options.zero)
