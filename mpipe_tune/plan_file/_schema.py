"""plan.json as typed, frozen records: :class:`PlanFile` and the records it is made of.

Every record reads from its stored form with :func:`~mpipe_tune.plan_file._check.read_value`, which
checks each field by its type and range (a damaged file is one line naming the field), and writes
back with :func:`~mpipe_tune.plan_file._check.write_value`. No record holds a ``dict``: what the file
stores as an object keyed by name (a search's families, its speedups) reads into a tuple of records.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from mpipe_tune.algebra import (
    DEFAULT_KERNEL_MODE, GRAD_REDUCE_DTYPES, KERNEL_MODES, MOE_DISPATCHERS, Candidate, Comm, EdgeKind, Group,
    parse_event, Layout,
)
from mpipe_tune.errors import MpipeError
from mpipe_tune.inputs import draw_from_dict, Workload, parse_workload, workload_to_dict
from mpipe_tune.plan_file._names import BEST
from mpipe_tune.plan_file._check import damaged, read_record, read_value, spec, write_value



# ------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelInput:
    """The model a plan was made for: the spec it was loaded from, its name, its frozen blocks, its content hash."""

    spec: str
    """A built-in model's name or the path of its file (resolved when the plan was made)."""
    name: str
    hash: str
    """sha256 of the model with its frozen blocks frozen (``Model.content_hash``)."""
    frozen: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProfileInput:
    """The hardware profile a plan was predicted on."""

    spec: str
    name: str
    hash: str
    """sha256 of the profile (``HardwareProfile.content_hash``)."""


@dataclass(frozen=True)
class StoredWorkload:
    """A plan's microbatches, stored in full so that a plan runs and re-predicts without its source file."""

    hash: str
    """``workload_hash`` of :attr:`workload` when the plan was made."""
    workload: Workload
    """The microbatches, named, with the draw they came from (a named mix's
    :class:`~mpipe_tune.inputs._workload.MixDraw` or a dataset's ``DatasetDraw``; ``None`` for a workload file)."""

    @classmethod
    def read_stored(cls, data: Any, *, where: str, path: str) -> StoredWorkload:
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("name", "hash")):
            raise damaged(where, f"field {path!r} must hold its 'name' and 'hash' as text, and its microbatches")
        try:
            workload = parse_workload({"microbatches": data.get("microbatches"), "name": data["name"]}, where=where)
        except MpipeError as exc:
            raise damaged(where, f"field '{path}.microbatches': {exc}") from None
        if "draw" in data:
            workload = replace(workload, draw=draw_from_dict(data["draw"], where=where))
        return cls(data["hash"], workload)

    def to_stored(self) -> dict[str, Any]:
        w = self.workload
        return {"name": w.name, "hash": self.hash, "microbatches": workload_to_dict(w)["microbatches"],
                **({"draw": w.draw.to_dict()} if w.draw is not None else {})}


@dataclass(frozen=True)
class Inputs:
    """What every plan of a file was made from (each plan's workload is its section's)."""

    model: ModelInput
    profile: ProfileInput
    moe_imbalance: float = spec(lower=1.0, default=1.0)
    """How the trainer runs what the candidate does not say (``CostOptions.framework``): the MoE load
    imbalance, the gradient reduce's dtype, whether data-parallel communication overlaps compute."""
    grad_reduce_dtype: str = spec(choices=GRAD_REDUCE_DTYPES, default="fp32")
    overlap_dp_comm: bool = True
    kernel_mode: str = spec(choices=KERNEL_MODES, default=DEFAULT_KERNEL_MODE)
    """How the trainer launches kernels (``Framework.kernel_mode``; absent from older files: the default)."""
    moe_dispatcher: str = spec(choices=MOE_DISPATCHERS, default="alltoall")
    """The MoE token dispatcher (:mod:`mpipe_tune.cost._moe`); absent from files written before it: alltoall."""
    moe_capacity_factor: float | None = spec(lower=0.0, default=None)
    moe_pad_to_capacity: bool = False
    flat_buffer_copies: bool = False
    """Gradients and weights copied through flat buffers around the data-parallel reduce
    (``Framework.flat_buffer_copies``); absent from files written before it: False, Megatron-LM's buffers."""


# ------------------------------------------------------------------------------------- a plan's fields


@dataclass(frozen=True)
class StoredPlacement:
    """One region's placement: a Sharded region's slab per rank, or a Replicated region's owner per microbatch."""

    region: int
    layers: tuple[int, int]
    layout: str = spec(choices=tuple(x.value for x in Layout))
    slabs: tuple[tuple[int, int], ...] | None = spec(omit_none=True, default=None)
    owners: tuple[int, ...] | None = spec(omit_none=True, default=None)


@dataclass(frozen=True)
class StoredSeam:
    seam: tuple[int, int]
    """(source region, destination region)."""
    fwd: str = spec(choices=tuple(c.value for c in Comm))
    bwd: str | None = spec(choices=tuple(c.value for c in Comm), default=None)


@dataclass(frozen=True)
class StoredReduce:
    region: int
    group: str = spec(choices=tuple(g.value for g in Group))


@dataclass(frozen=True)
class StoredCollectives:
    seams: tuple[StoredSeam, ...]
    reduces: tuple[StoredReduce, ...]


@dataclass(frozen=True)
class StoredOrder:
    """The event graph: events in their text form, edges (source, target, kind), each rank's event indices."""

    events: tuple[str, ...]
    edges: tuple[tuple[int, int, str], ...]
    nodes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankMemory:
    static_bytes: float
    activation_peak_bytes: float
    peak_bytes: float = spec(lower=0.0)
    over_capacity: bool


@dataclass(frozen=True)
class RankFigures:
    """One pipeline rank's predicted figures."""

    rank: int
    busy_s: float
    bubble_s: float
    spill_s: float
    encoder_s: float
    warmup_slack_s: float
    memory: RankMemory


@dataclass(frozen=True)
class Predicted:
    """The prediction stored with a plan."""

    makespan_s: float = spec(lower=0.0)
    bubble_share: float
    ranks: tuple[RankFigures, ...]
    durations_s: tuple[float, ...] = spec(lower=0.0)
    """Predicted seconds per event, in the order's event order, with the ZeRO-2 and ZeRO-3 sharding actions placed at
    it (:meth:`~mpipe_tune.cost._timing.Timeline.charged_s`: FSDP2 runs them in the event's own hooks)."""


@dataclass(frozen=True)
class Section:
    """One runnable plan of a file: what the runtime, ``show``, ``bench`` and ``export`` read."""

    name: str
    """``best``, a baseline's name or an alternative's."""
    candidate: Candidate
    placement: tuple[StoredPlacement, ...]
    collectives: StoredCollectives
    order: StoredOrder
    predicted: Predicted
    stored_workload: StoredWorkload

    FIELDS: ClassVar[tuple[str, ...]] = ("candidate", "placement", "collectives", "order", "predicted")
    """The stored fields of a section; a baseline's section holds them and its own ``workload``."""

    @property
    def workload(self) -> Workload:
        return self.stored_workload.workload

    @property
    def predicted_step_s(self) -> float:
        return self.predicted.makespan_s

    @property
    def peak_bytes(self) -> tuple[float, ...]:
        """Predicted peak memory of each pipeline rank."""
        return tuple(r.memory.peak_bytes for r in self.predicted.ranks)

    @property
    def where(self) -> str:
        """``, plan 'megatron'`` (nothing for the best): appended to the file's name in messages."""
        return "" if self.name == BEST else f", plan '{self.name}'"

    @classmethod
    def read(cls, name: str, data: Any, workload: Any, *, where: str, label: str) -> Section:
        """A section from its stored object and its stored workload; ``label`` (``baseline 'gpipe': ``)
        names it inside the file."""
        at = f"{where}, {label[:-2]}" if label else where
        for key in cls.FIELDS:
            if not isinstance(data.get(key), (dict, list)):
                raise damaged(where, f"{label}field '{key}' is missing or malformed")
        candidate = read_value(Candidate, data["candidate"], where=at, path="candidate")
        section = cls(
            name=name, candidate=candidate,
            placement=read_value(tuple[StoredPlacement, ...], data["placement"], where=at, path="placement"),
            collectives=read_record(StoredCollectives, data["collectives"], where=at, path="collectives"),
            order=read_record(StoredOrder, data["order"], where=at, path="order"),
            predicted=read_record(Predicted, data["predicted"], where=f"{at} predicted", path=""),
            stored_workload=read_value(StoredWorkload, workload, where=at, path="inputs._workload" if not label
                                       else "workload"))
        section._validate_graph(where, label)
        return section

    def _validate_graph(self, where: str, label: str) -> None:
        """The order graph against its event list, and the lengths that must agree with the candidate."""
        at = f"{where}, {label[:-2]}" if label else where
        order, c = self.order, self.candidate
        try:
            for text in order.events:
                parse_event(text)
            num = len(order.events)
            for s, t, kind in order.edges:
                EdgeKind(kind)
                assert 0 <= s < num and 0 <= t < num
            assert len(order.nodes) == c.pp
            assert all(0 <= i < num for rank_nodes in order.nodes for i in rank_nodes)
        except (ValueError, AssertionError) as exc:
            detail = str(exc) if isinstance(exc, MpipeError) else type(exc).__name__
            raise MpipeError(f"{where}: {label}the order section is corrupt ({detail}); re-create the plan") from None
        if len(self.predicted.durations_s) != num:
            raise damaged(at, f"field 'predicted.durations_s' must list one duration per event ({num})")
        if len(self.predicted.ranks) != c.pp:
            raise damaged(at, f"field 'predicted.ranks' must hold one object per pipeline rank ({c.pp})")
        if len(self.workload.microbatches) != c.num_microbatches:
            raise damaged(at, f"the stored workload holds {len(self.workload.microbatches)} microbatches but the "
                              f"candidate has {c.num_microbatches}")

    def to_stored(self) -> dict[str, Any]:
        """The section's stored fields and its ``workload`` (the best's moves to the file's inputs)."""
        return {**{key: write_value(getattr(self, key)) for key in self.FIELDS},
                "workload": write_value(self.stored_workload)}


# -------------------------------------------------------------------------------------- search summary


@dataclass(frozen=True)
class ComparisonRow:
    """One plan's row of the comparison table (``search.compare.row``), in seconds and bytes."""

    plan: str
    schedule: str
    cut: tuple[int, ...]
    owners: str | None
    slabs: tuple[tuple[int, ...], ...]
    pp: int
    tp: int
    dp: int
    ep: int
    cp: int
    encoder_tp: int
    encoder_dp: int
    microbatches: int
    recompute: bool | str
    zero_stage: int
    sequence_parallel: bool
    step_s: float
    p90_s: float
    step_samples_s: tuple[float, ...]
    speedup: float | None
    best_speedup: float | None
    bubble_share: float
    spill_s: float
    peak_bytes: float
    fits_memory: bool
    bound_by: str | None = spec(omit_none=True, default=None)
    """What bounds each rank of the plan (``r0 compute 80%, r1 host 60%``); absent from older files."""


@dataclass(frozen=True)
class FamilyCoverage:
    """What the search of one baseline family's own layouts covered."""

    STORED_KEY: ClassVar[str] = "name"
    name: str
    candidates: int
    evaluated: int
    bounded: int


@dataclass(frozen=True)
class Speedup:
    """The best plan's speedup over one plan (``None`` where that plan does not exist or none fits)."""

    STORED_KEY: ClassVar[str] = "name"
    STORED_VALUE: ClassVar[str] = "speedup"
    name: str
    speedup: float | None


@dataclass(frozen=True)
class Speedups:
    at_best_degrees: tuple[Speedup, ...]
    at_own_best: tuple[Speedup, ...]
    over_current: float | None


@dataclass(frozen=True)
class SearchSummary:
    """What ``plan`` found and how (its ``--json`` output): the study, the space, and the comparison table."""

    objective: str
    candidate: Candidate
    global_batch: int = spec(lower=1)
    samples: int = spec(lower=1)
    seed: int
    workload_source: str
    devices: int = spec(lower=1)
    study: str
    storage: str | None
    mode: str
    trials: int = spec(lower=0)
    new_trials: int
    evaluated: int
    space_size: int | None
    wall_s: float
    interrupted: bool
    comparison: tuple[ComparisonRow, ...]
    own_best: tuple[ComparisonRow, ...] = ()
    families: tuple[FamilyCoverage, ...] = ()
    current: ComparisonRow | None = None
    speedups: Speedups | None = None
    ending: str | None = None
    """Why the search stopped (files from before it lack it, as they lack the two below)."""
    best_from: str | None = None
    """Where the winner came from: ``search``, a baseline, its family (``vpp@own``) or ``current``."""
    widened: tuple[str, ...] | None = None
    """The memory knobs widened because nothing in the requested space fit."""
    settled_by_bound: int | None = None
    """Points this run settled by their lower bound, without a prediction."""
    gap: float | None = None
    """The bound search: the share of the best's step time by which a plan left unvisited could still beat it
    (absent for a sampler or an exhaustive search)."""
    tolerance: float | None = None
    """The bound search's tolerance (0 for a sampler or an exhaustive search)."""

    def to_stored(self) -> dict[str, Any]:
        """The stored form, in the order ``plan --json`` prints it."""
        out = {}
        for key in STORED_ORDER:
            value = getattr(self, key)
            if value is not None or key not in OPTIONAL:
                out[key] = write_value(value) if key != "families" or value else {}
        return out


STORED_ORDER = ("objective", "candidate", "best_from", "widened", "global_batch", "samples", "seed", "workload_source", "devices", "study",
                "storage", "mode", "ending", "trials", "new_trials", "evaluated", "space_size", "settled_by_bound",
                "gap", "tolerance", "wall_s",
                "interrupted", "comparison", "own_best", "families", "current", "speedups")
"""The search summary's keys in the order ``plan`` writes them."""
OPTIONAL = ("ending", "speedups", "best_from", "widened", "settled_by_bound", "gap", "tolerance")
"""Keys files from before them lack: left out when absent."""
