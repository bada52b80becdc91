"""Published, measured training runs (``published_runs.yaml``) as typed records, and their prediction.

Shared by ``bench_published.py`` (predict every run, print published against predicted) and
``fit_published.py`` (fit the profiles' efficiencies on the runs marked ``fit``). A run is predicted
as a new user would predict it: the model spec, the profile, a workload of ``global_batch / (dp * micro_batch)``
microbatches of ``micro_batch`` sequences of ``seq_len`` text tokens side by side (one forward over all their
tokens, each sequence attending to itself: ``Microbatch.texts``), Megatron-LM's layout of ``pp`` ranks with ``vp`` interleaved
virtual stages (``decoders / (pp * vp)`` decoder layers per virtual stage, the embedding with the
first and the head with the last), and :func:`mpipe_tune.cost._predict.predict`, the function
``mpipe-tune predict`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from mpipe_tune.algebra import Degrees, Model, DTYPE_BYTES, ZERO_STAGES, Candidate, default_reshard_after_forward, Cut
from mpipe_tune.cost import CostOptions, ROPE_FORMS, Prediction, predict, HardwareProfile
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.cost import load_profile, parse_profile
from mpipe_tune.inputs import load_model

ROOT = Path(__file__).resolve().parents[1]
RUNS_FILE = Path(__file__).resolve().parent / "published_runs.yaml"
SPLITS = ("fit", "held_out")


@dataclass(frozen=True)
class PublishedRun:
    """One measured run with its stated configuration (fields as ``published_runs.yaml`` documents)."""

    suite: str
    model: str
    profile: str
    accelerator: str
    dtype: str
    devices: int
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: str
    micro_batch: int
    seq_len: int
    global_batch: int
    grad_reduce_dtype: str
    step_time_s: float
    """Measured seconds per training step."""
    mfu: float | None
    """Published model-FLOPs utilisation (against the dtype's peak); None where the source gives none."""
    split: str
    source: str
    table: str
    note: str = ""
    decoder_layers: int | None = None
    """Decoder layers of a proxy run (None: the model's own)."""
    layer_list: tuple[int, ...] | None = None
    """Decoder layers per pipeline stage where the run set them unevenly (Megatron's ``--num-layer-list``,
    vp 1 only); None: ``decoders / (pp * vp)`` per virtual stage."""
    embedding_in_split: bool = False
    """The embedding and the output layer (with the loss) count as one layer each when the layers are split over
    the virtual stages (Megatron-LM's ``--account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split``): ``(decoders + 2) / (pp * vp)`` model layers per virtual stage, the
    first holding the embedding and the last the output layer in place of a decoder layer each."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state per parameter beyond the parameter itself: Adam's fp32 master copy and two moments (12)
    unless the framework's optimizer keeps fewer (MindFormers' fp32-state AdamW on fp16 parameters: 8)."""
    loss_fusion: bool = False
    """The run's trainer fuses its loss kernels (Megatron-Core's ``cross_entropy_loss_fusion``; off unless the
    run's configuration sets it): :attr:`~mpipe_tune.cost._layers.CostOptions.fused_loss`."""
    rope: str = "fused"
    """How the run's trainer applies RoPE (:attr:`~mpipe_tune.cost._layers.CostOptions.rope`): ``fused``
    (Megatron-LM's ``apply_rope_fusion``, on by default in its training arguments and in NeMo's Llama
    configs), ``unfused`` (MindSpeed without ``--use-fused-rotary-pos-emb``) or ``mindspeed_fused`` (with it)."""
    kernel_mode: str = "fused"
    """How the run's trainer launches kernels (:data:`~mpipe_tune.cost._kernel_model.KERNEL_MODES`): ``fused``
    (Megatron-LM and MindSpeed with their fused kernels, the default), ``eager`` (torchtitan without
    ``torch.compile``), ``compiled`` (with it)."""
    grad_accumulation_fusion: bool = True
    """False where the run's script passes ``--no-gradient-accumulation-fusion``
    (:attr:`~mpipe_tune.cost._layers.CostOptions.grad_accumulation_fusion`)."""
    selective_recompute: str = "attention_core"
    """What the run's ``selective`` recomputation re-runs (:attr:`~mpipe_tune.cost._layers.CostOptions.selective_recompute`):
    ``attention_core`` (Megatron-LM's) or ``op`` (torchtitan's ``selective_ac_option = 'op'``)."""
    zero_stage: int | None = None
    """The ZeRO stage where the run states more than :attr:`distributed_optimizer` says: 3 where its framework
    keeps the parameters themselves as data-parallel slices (:mod:`mpipe_tune.cost._sharding_events`), 2 where only the
    gradients and the optimizer state are; None: 1 with a distributed optimizer, else 0. A stage given needs
    :attr:`zero_source`."""
    reshard_after_forward: bool | None = None
    """At stage 3, whether the run gathers the weights again for every forward and backward (FSDP2's
    ``reshard_after_forward``) or keeps them through the step; None: the default for its pipeline degree."""
    defer_gradient_reduce: bool = False
    """ZeRO-2 whose reduce-scatters run asynchronously, one backward's in flight, where the source says so
    (:attr:`~mpipe_tune.cost._layers.CostOptions.defer_gradient_reduce`)."""
    zero_source: str = ""
    """Where the run's configuration and its framework's documentation say so (file and line, pinned)."""
    moe_dispatcher: str = "alltoall"
    """The MoE token dispatcher (Megatron-Core's ``--moe-token-dispatcher-type``; :mod:`mpipe_tune.cost._moe`)."""
    moe_capacity_factor: float | None = None
    """The expert capacity factor (``--moe-expert-capacity-factor``); None: dropless."""
    moe_pad_to_capacity: bool = False
    """Every expert padded to its capacity (``--moe-pad-expert-input-to-capacity``)."""
    fabric: dict | None = None
    """The cluster's pods and spine where the source states them (``devices_per_pod``, ``pod_oversubscription``
    and ``ref``): the run is predicted on its profile with that :class:`~mpipe_tune.cost._collectives.Fabric`;
    None: the profile's own network."""
    excluded: str = ""
    """Why the run is outside what its profile describes (another code path or machine, a setting the cost model
    cannot express): shown with its prediction, counted in no fit and no held-out figure. Empty: in scope."""

    @property
    def name(self) -> str:
        proxy = f"-L{self.decoder_layers}" if self.decoder_layers else ""
        return f"{self.suite}@{self.devices}{proxy}"

    @property
    def dp(self) -> int:
        return self.devices // (self.tp * self.pp * self.cp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.seq_len * self.global_batch / self.step_time_s / self.devices


def load_runs(path: Path = RUNS_FILE) -> list[PublishedRun]:
    """Every run of every suite, a suite's ``like`` filling in the fields it does not give."""
    data = yaml.safe_load(path.read_text())
    by_id: dict[str, dict] = {}
    runs = []
    known = {f.name for f in fields(PublishedRun)}
    for suite in data["suites"]:
        base = dict(by_id[suite["like"]]) if "like" in suite else {}
        base.update({k: v for k, v in suite.items() if k not in ("runs", "like")})
        by_id[suite["id"]] = base
        for row in suite["runs"]:
            entry = {**base, **row, "suite": base["id"]}
            unknown = set(entry) - known - {"id"}
            if unknown:
                raise MpipeError(f"{path}: suite {base['id']!r} has unknown fields {sorted(unknown)}")
            if "layer_list" in entry:
                entry["layer_list"] = tuple(entry["layer_list"])
            run = PublishedRun(**{k: v for k, v in entry.items() if k in known})
            _validate(run, path)
            runs.append(run)
    return runs


def _validate(run: PublishedRun, path: Path) -> None:
    if run.zero_stage is not None and (run.zero_stage not in ZERO_STAGES or not run.zero_source
                                       or (run.zero_stage >= 1) != run.distributed_optimizer):
        raise MpipeError(f"{path}: run {run.name} has zero_stage {run.zero_stage!r}: give one of "
                         f"{', '.join(map(str, ZERO_STAGES))}, agreeing with distributed_optimizer, and cite the setting "
                         f"in zero_source")
    if run.defer_gradient_reduce and run.zero_stage != 2:
        raise MpipeError(f"{path}: run {run.name} gives defer_gradient_reduce, which only ZeRO stage 2 has; give "
                         f"zero_stage 2 or leave it out")
    if run.reshard_after_forward is not None and run.zero_stage != 3:
        raise MpipeError(f"{path}: run {run.name} gives reshard_after_forward, which only ZeRO stage 3 has; give "
                         f"zero_stage 3 or leave it out")
    if run.rope not in ROPE_FORMS:
        raise MpipeError(f"{path}: run {run.name} has rope {run.rope!r}; use one of {', '.join(ROPE_FORMS)}")
    if run.split not in SPLITS:
        raise MpipeError(f"{path}: run {run.name} has split {run.split!r}; use one of {', '.join(SPLITS)}")
    if run.micro_batch != 1 and run.pp != 1:
        raise MpipeError(f"{path}: run {run.name} has micro_batch {run.micro_batch} at pp {run.pp}; a microbatch here "
                         f"is one sequence, and splitting a micro batch into sequences changes a pipeline's bubble, "
                         f"so only pp 1 runs may have micro_batch above 1: leave the run out")
    if run.layer_list is not None and (run.vp != 1 or len(run.layer_list) != run.pp):
        raise MpipeError(f"{path}: run {run.name} has layer_list {list(run.layer_list)}: give one decoder-layer count per "
                         f"pipeline stage ({run.pp}), at vp 1 (--num-layer-list)")
    if run.devices % (run.tp * run.pp * run.cp) or run.global_batch % (run.dp * run.micro_batch):
        raise MpipeError(f"{path}: run {run.name}: devices {run.devices} must be a multiple of tp*pp*cp and the "
                         f"global batch {run.global_batch} a multiple of dp*micro_batch; correct the row")


def run_model(run: PublishedRun) -> Model:
    """The run's model spec; a proxy run keeps the first ``decoder_layers`` decoder layers."""
    spec = run.model if not run.model.endswith(".yaml") else str(ROOT / run.model)
    model = load_model(spec)
    if run.decoder_layers is None:
        return model
    first, *decoders, last = model.layers
    return replace(model, name=f"{model.name}-L{run.decoder_layers}",
                   layers=(first, *decoders[:run.decoder_layers], last))


def run_options(run: PublishedRun) -> CostOptions:
    """The run's cost options. The gradient buffer is kept in the dtype the framework reduces it in
    (NeMo's ``grad_sync_dtype``, Megatron-Core's ``grad_reduce_in_fp32``): 2 bytes per gradient for a bf16
    reduce, 4 for fp32; the optimizer state as the run records it."""
    return CostOptions(grad_bytes_per_param=float(DTYPE_BYTES[run.grad_reduce_dtype]),
                       optimizer_bytes_per_param=run.optimizer_bytes_per_param, dtype=run.dtype,
                       degrees=Degrees(run.pp, tp=run.tp, dp=run.dp, cp=run.cp, ep=run.ep),
                       sequence_parallel=run.sequence_parallel, shard_optimizer=run.distributed_optimizer,
                       shard_gradients=run.zero_stage == 2, shard_parameters=run.zero_stage == 3,
                       reshard_after_forward=run_candidate_reshards(run),
                       defer_gradient_reduce=run.defer_gradient_reduce,
                       recompute=run.recompute, grad_reduce_dtype=run.grad_reduce_dtype, fused_loss=run.loss_fusion,
                       rope=run.rope, kernel_mode=run.kernel_mode, selective_recompute=run.selective_recompute,
                       grad_accumulation_fusion=run.grad_accumulation_fusion,
                       moe_dispatcher=run.moe_dispatcher,
                       moe_capacity_factor=run.moe_capacity_factor, moe_pad_to_capacity=run.moe_pad_to_capacity)


def run_candidate_reshards(run: PublishedRun) -> bool:
    """Whether the run's stage 3 gathers per microbatch (its policy, or the default for its pipeline degree)."""
    if run.reshard_after_forward is not None:
        return run.reshard_after_forward
    return default_reshard_after_forward(run.pp)


def megatron_layout(model: Model, pp: int, vp: int, layer_list: tuple[int, ...] | None = None,
                    embedding_in_split: bool = False) -> tuple[Cut, str, tuple[tuple[int, ...], ...]]:
    """Cut, schedule text and slab counts of Megatron-LM's layout: ``vp`` woven regions, each rank's
    virtual stage ``decoders / (pp * vp)`` decoder layers (at vp 1, ``layer_list``'s counts where given:
    ``--num-layer-list``), the embedding first and the head last; with ``embedding_in_split`` the embedding
    and the head count as layers of the split (:attr:`PublishedRun.embedding_in_split`).

    >>> from mpipe_tune.inputs import load_model
    >>> cut, schedule, slabs = megatron_layout(load_model("llama3-8b"), 2, 2)
    >>> cut.boundaries, schedule, slabs
    ((17,), '1f1b,1f1b', ((9, 8), (8, 9)))
    >>> megatron_layout(load_model("llama3-8b"), 2, 2, embedding_in_split=True)[2]  # 34 layers in 4 stages
    Traceback (most recent call last):
    ...
    mpipe_tune.errors.MpipeError: 34 layers (the embedding and the output layer counted) do not split into pp 2 x vp 2 equal virtual stages
    >>> megatron_layout(load_model("llama3-8b"), 2, 1, embedding_in_split=True)[2]
    ((17, 17),)
    """
    if embedding_in_split:
        if layer_list is not None or model.num_layers % (pp * vp):
            raise MpipeError(f"{model.num_layers} layers (the embedding and the output layer counted) do not split "
                             f"into pp {pp} x vp {vp} equal virtual stages")
        per_stage = model.num_layers // (pp * vp)
        boundaries = tuple(per_stage * pp * k for k in range(1, vp))
        return Cut(boundaries), ",".join(["1f1b"] * vp), ((per_stage,) * pp,) * vp
    decoders = model.num_layers - 2
    if layer_list is not None:
        if vp != 1 or len(layer_list) != pp or sum(layer_list) != decoders:
            raise MpipeError(f"layer list {list(layer_list)} does not give pp {pp} stages (vp 1) the {decoders} decoder "
                             f"layers")
        counts = [*layer_list]
        counts[0] += 1
        counts[-1] += 1
        return Cut(()), "1f1b", (tuple(counts),)
    if decoders % (pp * vp):
        raise MpipeError(f"{decoders} decoder layers do not split into pp {pp} x vp {vp} equal virtual stages")
    per_stage = decoders // (pp * vp)
    slabs = []
    for region in range(vp):
        counts = [per_stage] * pp
        if region == 0:
            counts[0] += 1
        if region == vp - 1:
            counts[-1] += 1
        slabs.append(tuple(counts))
    boundaries = tuple(1 + per_stage * pp * k for k in range(1, vp))
    return Cut(boundaries), ",".join(["1f1b"] * vp), tuple(slabs)


def run_profile(run: PublishedRun, profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with the run's stated :attr:`PublishedRun.fabric` in place of its own network, if it states one."""
    if run.fabric is None:
        return profile
    data = profile.to_dict()
    data["fabric"] = {key: {"value": run.fabric[key], "source": "datasheet", "ref": run.fabric["ref"]}
                      for key in ("devices_per_pod", "pod_oversubscription")}
    return parse_profile(data, where=f"{profile.name} with {run.name}'s fabric")


def predict_run(run: PublishedRun, profile: HardwareProfile | None = None) -> Prediction:
    """The cost model's prediction of ``run`` on ``profile`` (default: the run's named profile)."""
    model = run_model(run)
    profile = run_profile(run, load_profile(run.profile) if profile is None else profile)
    texts = (run.seq_len,) * run.micro_batch if run.micro_batch > 1 else ()
    workload = Workload(tuple(Microbatch(0, run.seq_len * run.micro_batch, texts=texts)
                              for _ in range(run.num_microbatches)),
                        f"{run.name}: {run.num_microbatches} x {run.micro_batch} x {run.seq_len} tokens")
    cut, schedule, slabs = megatron_layout(model, run.pp, run.vp, run.layer_list, run.embedding_in_split)
    options = run_options(run)
    candidate = Candidate(schedule, cut.boundaries, pp=run.pp, tp=options.degrees.tp, dp=options.degrees.dp,
                          num_microbatches=run.num_microbatches, slab_counts=slabs, recompute=options.recompute,
                          ep=options.degrees.ep, cp=options.degrees.cp, zero_stage=options.zero_stage,
                          reshard_after_forward=run.reshard_after_forward,
                          sequence_parallel=options.sequence_parallel, dtype=options.dtype)
    return predict(candidate, model, workload, profile, options)
