"""Per-layer, per-microbatch costs: the table every event duration is summed from.

For each layer ``l`` and microbatch ``m`` the table holds seconds for the forward, the input-gradient
(dgrad) and the weight-gradient (wgrad) parts of the backward, the bytes of the layer's output (what a
stage boundary after it sends), the bytes of the activations the forward keeps for the backward, and
the layer's parameter count.

- Explicit-cost layers: ``fwd_s_per_token * tokens`` and ``bwd_s_per_token * tokens`` of the layer's
  stream; the backward splits evenly into dgrad and wgrad (as for a linear layer); no memory figures.
- Architecture layers: FLOPs and bytes from :mod:`mpipe_tune.cost._arch`, timed by the roofline
  ``max(W / (eff * F), D / B)`` with the profile's peak F for the dtype, its memory bandwidth B and its
  efficiency for the layer kind (the forward's, or the backward's for dgrad and wgrad, which differ
  where the profile says so). A layer that has tokens to work on also pays the profile's fixed
  seconds per call for its kind: once per forward, and once per backward it runs (``bwd_overhead_s``,
  charged under the same footprint as the backward), plus, for an image-stream kind, the profile's
  seconds per image beyond the microbatch's first (:func:`estimate_image_calls_s`: the runtime's ViT
  block makes one attention call per image). With ``tp > 1`` the forward and the dgrad
  each pay the layer's tensor-parallel all-reduces over the intra-node link, less the share the
  profile's ``tp_comm_overlap`` hides behind the GEMMs, and a layer with tokens pays the profile's
  fixed seconds per split call at that degree (``tp_overhead_s``: per forward and per backward it
  runs, where the profile measured them) on top of the profile's ``tp_slowdown`` share of all the
  above (the split call's extra seconds per charged second); with ``ep > 1`` a
  MoE layer's forward and dgrad each pay its dispatch and combine all-to-alls
  (:func:`~mpipe_tune.cost._profile.estimate_collective_s`'s ``all_to_all`` over ``ep`` ranks, on the
  inter-node link once the group's ``tp * ep`` devices span more than a node), not overlapped with
  compute, and the profile's ``ep_overhead_s`` and ``ep_slowdown`` for its kind at that degree the same way
  (what its calls with the experts spread took beyond all that, where the profile measured them). With
  ``cp > 1`` a decoder layer's attention core runs as ring attention: ``cp`` steps, each computing ``1/cp`` of the rank's core while the next share of k and v (backward: k,
  v, dk, dv) travels to the next rank over the point-to-point link, so the core pays
  ``(cp-1) * max(0, step transfer - step compute)`` beyond its compute: only what the compute does
  not hide (the overlap ring-attention implementations get by double-buffering the exchange).

The encoder's own tensor-parallel degree (``Degrees.encoder_tp``, a divisor of ``tp``):
the encoder block's layers are timed at ``encoder_tp`` on the busiest of ``tp / encoder_tp`` shares of
the microbatch's images (:func:`encoder_split`), and its last layer also pays the all-gather of the
features over those shares (:func:`feature_gather_s`), forward and, as a reduce-scatter,
backward. Explicit-cost layers, which model no degree, are unchanged.

Recomputation (``CostOptions.recompute``): ``full`` keeps only each layer's input and re-runs its
whole forward before its backward; ``selective`` re-runs only the attention core and drops only what
the core alone kept (see :mod:`mpipe_tune.cost._arch`: with the fused attention modelled there it
frees nothing, so it only costs time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from mpipe_tune.algebra import (
    DTYPE_BYTES, GRAD_REDUCE_DTYPES, normalize_recompute, recompute_granularity, Degrees, ENCODER_BLOCK, ArchCost,
    ExplicitCost, Model,
)
from mpipe_tune.cost import _arch as arch
from mpipe_tune.cost._arch_pieces import maximum
from mpipe_tune.cost._arch_layers import ROPE_FORMS
from mpipe_tune.cost._kernel_model import DEFAULT_KERNEL_MODE, KERNEL_MODES
from mpipe_tune.cost._kernel_passes import host_pass_seconds, shaped_pass_seconds
from mpipe_tune.cost import _moe as moe
from mpipe_tune.cost._moe import MoeSettings
from mpipe_tune.cost._profile import HardwareProfile, estimate_collective_s
from mpipe_tune.cost._roofline import (  # noqa: F401 (compute_seconds, pass_seconds: read from here by callers)
    bound_split, compute_bound, compute_seconds, estimate_image_calls_s, exposed_ring_s, pass_seconds,
)
from mpipe_tune.inputs import Microbatch, Workload
from mpipe_tune.errors import MpipeError

SELECTIVE_POLICIES = ("attention_core", "op")
"""What selective recomputation re-runs (:attr:`CostOptions.selective_recompute`)."""
FRAMEWORK_OPTIONS = ("moe_imbalance", "grad_reduce_dtype", "overlap_dp_comm", "kernel_mode", "moe_dispatcher",
                     "moe_capacity_factor", "moe_pad_to_capacity", "flat_buffer_copies")
"""The framework fields a plan's inputs record beside its candidate (:class:`~mpipe_tune.cost._framework.Framework`)."""


@dataclass(frozen=True)
class CostOptions:
    """Everything the cost kernels read besides the model, the profile and the workload: a candidate's
    dtype, degrees and memory policy joined with the framework's settings
    (:meth:`mpipe_tune.cost._framework.Framework.options` builds it from a candidate, the one place)."""

    dtype: str = "bf16"
    """Compute and activation dtype; the profile's peak for it is used."""
    degrees: Degrees = Degrees(1)
    """The candidate's parallel degrees (its :class:`~mpipe_tune.algebra._degrees.Degrees`, the one record
    of them). The kernels read ``tp`` (inside every slab), ``dp`` (replicas of the pipeline), ``ep``
    (the ranks a MoE layer's routed experts are divided over, carved from the data- and
    context-parallel ranks, see :meth:`validate_degrees`), ``cp`` (the ranks each decoder sequence is
    split over, ring attention; devices are laid out tp innermost, then cp, dp and pp, Megatron-LM's
    order) and ``encoder_tp`` (:attr:`encoder_tp`); ``pp`` is the plan's."""
    moe_imbalance: float = 1.0
    """Load imbalance of expert parallelism: routed rows on the busiest rank over the mean (>= 1;
    1 means perfectly balanced routing). Scales that rank's expert work and all-to-all buffers."""
    moe_dispatcher: str = "alltoall"
    """The trainer's MoE token dispatcher (:data:`~mpipe_tune.cost._moe.DISPATCHERS`, Megatron-Core's
    ``--moe-token-dispatcher-type``): what moves the routed rows to their experts (:mod:`mpipe_tune.cost._moe`)."""
    moe_capacity_factor: float | None = None
    """Expert capacity over the balanced share (``--moe-expert-capacity-factor``); None: dropless routing."""
    moe_pad_to_capacity: bool = False
    """Every expert runs its full capacity (``--moe-pad-expert-input-to-capacity``)."""
    sequence_parallel: bool = False
    """Sequence parallelism with tp: norms, residual adds and the layers' inputs and outputs hold
    ``1/tp`` of the tokens per rank (nothing changes with ``tp == 1``)."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state per parameter (Adam with fp32 master weights and two moments: 12 bytes)."""
    grad_bytes_per_param: float = 4.0
    """Gradient bytes per parameter (fp32 accumulation)."""
    shard_optimizer: bool = True
    """Optimizer state sharded over the data-parallel group (a distributed optimizer, ZeRO-1; the
    experts' state over their own data-parallel group, ``dp / ep`` ranks). Its gradient
    reduce-scatter and parameter all-gather move the bytes of the ring all-reduce charged without it."""
    shard_parameters: bool = False
    """ZeRO stage 3 (torch FSDP2's ``fully_shard`` per layer; needs :attr:`shard_optimizer`): the weights
    and gradients are sharded too, over the same ranks as the optimizer state, and each layer's weights
    are all-gathered before its forward and again before its backward, its gradient reduce-scattered
    after each backward (:mod:`mpipe_tune.cost._sharding_events`)."""
    shard_gradients: bool = False
    """ZeRO stage 2 (needs :attr:`shard_optimizer`; implied by :attr:`shard_parameters`): the gradients are
    sharded too, reduce-scattered after every microbatch's backward, while the weights stay whole through
    the step (gathered once, after the update) (:mod:`mpipe_tune.cost._sharding_events`)."""
    reshard_after_forward: bool = True
    """With :attr:`shard_parameters`, FSDP2's reshard policy: True gathers each layer's weights before every
    forward and backward and reduce-scatters its gradient after every backward; False gathers a stage's
    weights once a step and reduce-scatters its gradients once, after its last backward (the timing and
    peak memory of ZeRO-1; the weights are sharded between steps only)."""
    defer_gradient_reduce: bool = False
    """ZeRO-2: a backward's last reduce-scatter is waited for when the next backward ends (one reduction in flight,
    asynchronous: the Llama 3 paper's FSDP), not at its own end as torch FSDP2's (:mod:`mpipe_tune.cost._sharding_events`)."""
    grad_reduce_dtype: str = "fp32"
    """Dtype the data-parallel gradient reduce moves: ``fp32`` (Megatron-LM's default for bf16 training,
    gradients accumulated and reduced in fp32) or ``bf16`` (NeMo's ``grad_sync_dtype=bf16``, torchtitan's
    FSDP ``reduce_dtype`` bf16). Memory still holds :attr:`grad_bytes_per_param` per gradient."""
    overlap_dp_comm: bool = True
    """The data-parallel reduce (and, with :attr:`shard_optimizer`, the parameter all-gather) overlapped
    with the backward (forward) in buckets, as Megatron-LM's ``overlap_grad_reduce`` /
    ``overlap_param_gather`` and torchtitan's FSDP run it (see :mod:`mpipe_tune.cost._overlap`); False
    serialises each whole reduce after the rank's last backward."""
    dp_bucket_params: float = 40e6
    """Parameters per data-parallel communication bucket (Megatron-LM's default bucket, 40M elements)."""
    flat_buffer_copies: bool = False
    """ZeRO 0 and 1: the data-parallel reduce copies the gradients into flat buffers and the reduced ones
    back out (torch DDP's default, and this project's executor), and a distributed optimizer's update copies
    the weights into the all-gather's flat buffer and back out (the executor): memory traffic at the profile's
    bandwidth, added to the reduce. False: gradients accumulate in, and weights live in, contiguous buffers
    the collectives read and write in place (Megatron-LM's distributed optimizer)."""
    fused_loss: bool = False
    """The trainer's fused loss kernels (Megatron-LM's ``cross_entropy_loss_fusion``, off by default there;
    NeMo's Llama 3.1 configs turn it on): fewer passes over the fp32 logits
    (:func:`~mpipe_tune.cost._arch_layers.vocab_parallel_loss`)."""
    rope: str = "fused"
    """How the trainer runs RoPE (:data:`~mpipe_tune.cost._arch_layers.ROPE_FORMS`): ``fused``, Megatron-LM's
    Transformer Engine kernel (``apply_rope_fusion``, on by default in its training arguments:
    ``--no-rope-fusion`` turns it off); ``unfused``, separate elementwise kernels (MindSpeed's default);
    ``mindspeed_fused``, MindSpeed's NPU kernel (``--use-fused-rotary-pos-emb``); ``none``, the tool's own
    runtime (what ``mpipe-tune profile`` times)
    (:func:`~mpipe_tune.cost._arch_layers.rotary_embedding`)."""
    kernel_mode: str = DEFAULT_KERNEL_MODE
    """How the trainer launches kernels (:data:`~mpipe_tune.cost._kernel_model.KERNEL_MODES`): which kernels run
    and what the host pays to issue them, where the profile has ``host`` costs."""
    grad_accumulation_fusion: bool = True
    """The weight-gradient GEMMs accumulate into the fp32 main gradient (Megatron-LM's ``gradient_accumulation_fusion``,
    on by default with its fused kernel); False (``--no-gradient-accumulation-fusion``, which most MindSpeed-LLM
    scripts pass): a separate add per parameter and microbatch (:func:`with_gradient_accumulation`)."""
    selective_recompute: str = "attention_core"
    """What ``"selective"`` recomputation re-runs (:data:`SELECTIVE_POLICIES`): ``attention_core``, Megatron-LM's
    (the attention core alone); ``op``, torchtitan's ``selective_ac_option = 'op'`` policy (each transformer
    block saves the outputs of every other matmul, counted in order, and of the attention core, and re-runs the
    rest: the other matmuls and every memory-bound kernel, :func:`op_recompute_pieces`)."""
    recompute: bool | str = False
    """Activation recomputation: ``False`` (none), ``"selective"`` (the attention core) or ``True``
    (full: each layer keeps only its input for the backward, which first re-runs the layer's
    forward); ``"none"`` and ``"full"`` are read as ``False`` and ``True``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", normalize_recompute(self.recompute))
        if (self.shard_parameters or self.shard_gradients) and not self.shard_optimizer:
            raise ValueError("shard_parameters (ZeRO-3) and shard_gradients (ZeRO-2) shard the optimizer state too: "
                             "set shard_optimizer")
        if self.rope not in ROPE_FORMS:
            raise ValueError(f"rope {self.rope!r}: use one of {', '.join(ROPE_FORMS)}")
        if self.selective_recompute not in SELECTIVE_POLICIES:
            raise MpipeError(f"selective recomputation {self.selective_recompute!r} is not one the cost model knows; "
                             f"use one of {', '.join(SELECTIVE_POLICIES)}")
        if self.kernel_mode not in KERNEL_MODES:
            raise MpipeError(f"kernel mode {self.kernel_mode!r} is not one the cost model knows; use one of "
                             f"{', '.join(KERNEL_MODES)}")

    def framework(self) -> dict[str, Any]:
        """How the trainer runs what the candidate does not say (:data:`FRAMEWORK_OPTIONS`): the MoE load
        imbalance, the gradient reduce's dtype and whether data-parallel communication overlaps compute.
        What ``plan`` stores in plan.json's inputs and ``predict --json`` prints."""
        return {key: getattr(self, key) for key in FRAMEWORK_OPTIONS}

    @property
    def recompute_granularity(self) -> str:
        """``"none"``, ``"selective"`` or ``"full"``."""
        return recompute_granularity(self.recompute)

    @property
    def encoder_tp(self) -> int:
        """The encoder block's tensor-parallel degree (``tp`` unless the degrees set ``encoder_tp``). It
        divides ``tp``: the encoder's tensor-parallel group is a subgroup of ``encoder_tp`` of the slab's
        ``tp`` ranks, and the ``tp / encoder_tp`` such groups each encode a share of the microbatch's
        images (data parallelism inside the tensor-parallel group), then all-gather the features to the
        whole group before the projector (see :func:`encoder_split`)."""
        return self.degrees.tp if self.degrees.encoder_tp is None else self.degrees.encoder_tp

    @property
    def encoder_replicas(self) -> int:
        """``tp / encoder_tp``: encoder groups inside the tensor-parallel group, each encoding a share
        of a microbatch's images (1 unless :attr:`encoder_tp` is below ``tp``)."""
        return self.degrees.tp // self.encoder_tp

    @property
    def zero_stage(self) -> int:
        """3 with sharded parameters (:attr:`shard_parameters`), 2 with sharded gradients
        (:attr:`shard_gradients`), 1 with a distributed optimizer alone (:attr:`shard_optimizer`), else 0."""
        return 3 if self.shard_parameters else 2 if self.shard_gradients else 1 if self.shard_optimizer else 0

    @property
    def gathers_per_microbatch(self) -> bool:
        """Whether the weights are gathered and the gradients reduce-scattered per microbatch (ZeRO-3 that
        reshards after forward): the stage-3 timing of :mod:`mpipe_tune.cost._sharding_events`."""
        return self.shard_parameters and self.reshard_after_forward

    @property
    def scatters_per_microbatch(self) -> bool:
        """Whether the gradients are reduce-scattered after every microbatch's backward (ZeRO-2, and ZeRO-3
        that reshards after forward)."""
        return self.shard_gradients or self.gathers_per_microbatch

    @property
    def runs_fsdp2(self) -> bool:
        """Whether the plan's layers are torch FSDP2 units: ZeRO 2 or 3 over data- and context-parallel ranks that
        shard (more than one), as the runtime runs them."""
        return self.zero_stage >= 2 and self.degrees.dp * self.degrees.cp > 1

    @property
    def scatter_deferred(self) -> bool:
        """Whether ZeRO-2's reduce-scatters run deferred (:attr:`defer_gradient_reduce`, overlapped with compute)."""
        return self.defer_gradient_reduce and self.zero_stage == 2 and self.overlap_dp_comm

    def validate_degrees(self) -> None:
        """One-line :class:`MpipeError` unless the degrees can be laid out: each >= 1 and the
        expert-parallel group carved from the data- and context-parallel ranks: an ``ep > 1``
        divides ``dp * cp`` and ``cp`` divides it (torchtitan's rule for experts that keep the
        tensor-parallel split, ``etp = tp``; with ``cp = 1``, ``ep`` divides ``dp``, and the experts'
        own data-parallel group, Megatron-LM's, has ``dp * cp / ep`` ranks); a load imbalance >= 1."""
        for name, value in (("tensor-parallel", self.degrees.tp), ("data-parallel", self.degrees.dp),
                            ("expert-parallel", self.degrees.ep), ("context-parallel", self.degrees.cp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MpipeError(f"the {name} degree is {value!r}, but parallel degrees must be integers >= 1")
        encoder_tp = self.encoder_tp
        if isinstance(encoder_tp, bool) or not isinstance(encoder_tp, int) or encoder_tp < 1 \
                or self.degrees.tp % encoder_tp:
            divisors = ", ".join(str(d) for d in range(1, self.degrees.tp + 1) if self.degrees.tp % d == 0)
            raise MpipeError(f"the encoder's tensor-parallel degree is {encoder_tp!r}, but it must divide the "
                             f"tensor-parallel degree {self.degrees.tp} (its group is a subgroup of the tp ranks); "
                             f"use one of {divisors}")
        ranks = self.degrees.dp * self.degrees.cp
        if self.degrees.ep > 1 and (ranks % self.degrees.ep or self.degrees.ep % self.degrees.cp):
            what = f"the data-parallel degree {self.degrees.dp}" + (
                f" times the context-parallel degree {self.degrees.cp}" if self.degrees.cp > 1 else "")
            must = f"divide {what}" + (f" and be a multiple of {self.degrees.cp}" if self.degrees.cp > 1 else "")
            raise MpipeError(f"expert-parallel degree {self.degrees.ep} must {must}: the expert group is carved from "
                             f"those ranks; choose another expert-parallel degree")
        if not self.moe_imbalance >= 1.0 or self.moe_imbalance == float("inf"):
            raise MpipeError(f"MoE load imbalance {self.moe_imbalance!r} must be a finite number >= 1 (the busiest "
                             f"expert-parallel rank's routed tokens over the mean; 1 is balanced)")
        self.moe_settings()

    def moe_settings(self) -> MoeSettings:
        """The MoE dispatch settings (validated: one line naming what is wrong)."""
        return MoeSettings(self.moe_dispatcher, self.moe_capacity_factor, self.moe_pad_to_capacity)

    def dtype_bytes(self) -> int:
        """Bytes per element of the weights, activations and gradients a step keeps and moves: the dtype's,
        except fp8, which frameworks run as mixed precision (Transformer Engine casts the linear layers'
        GEMM inputs to fp8 inside the kernels; every tensor between kernels stays bf16): 2."""
        if self.dtype not in DTYPE_BYTES:
            raise MpipeError(f"dtype {self.dtype!r} is not a known dtype; use one of {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES["bf16"] if self.dtype == "fp8" else DTYPE_BYTES[self.dtype]

    def grad_reduce_bytes(self) -> int:
        """Bytes per gradient element the data-parallel reduce moves (:attr:`grad_reduce_dtype`)."""
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise MpipeError(f"gradient reduce dtype {self.grad_reduce_dtype!r} is not one frameworks reduce in; "
                             f"use {' or '.join(GRAD_REDUCE_DTYPES)}")
        return DTYPE_BYTES[self.grad_reduce_dtype]


@dataclass(frozen=True)
class LayerTable:
    """Arrays of shape (num_layers, num_microbatches) unless noted."""

    fwd_s: np.ndarray
    dgrad_s: np.ndarray
    wgrad_s: np.ndarray
    boundary_bytes: np.ndarray
    saved_bytes: np.ndarray
    param_count: np.ndarray
    """Shape (num_layers,): full-layer parameters (before tensor-parallel splitting)."""
    recompute_s: np.ndarray
    """The forward re-run before a layer's backward under recomputation (zeros without it)."""
    bwd_overhead_s: np.ndarray
    """Fixed seconds of one backward call of the layer, paid whenever its backward runs (zeros where
    the profile gives no per-call overhead)."""
    expert_param_count: np.ndarray | None = None
    """Shape (num_layers,): of ``param_count``, the routed experts' (before expert- and
    tensor-parallel splitting); None means none."""
    layer_tp_degree: np.ndarray | None = None
    """Shape (num_layers,): each layer's tensor-parallel degree where the encoder's differs from the
    plan's (:attr:`CostOptions.encoder_tp`); None means the plan's for every layer."""
    layer_replicas: np.ndarray | None = None
    """Shape (num_layers,): replicas of each layer's weights inside a tensor-parallel group
    (``tp / encoder_tp`` for the encoder's layers, else 1); None means 1 everywhere."""
    wgrad_kept_bytes: np.ndarray | None = None
    """What a split backward (the zero-bubble skeletons) keeps from the input-gradient event to the
    weight-gradient event beyond the saved activations: the output gradients its weight GEMMs read and,
    under recomputation, the activations the backward re-created (an upper bound: the weight GEMMs read
    only their inputs among them). None means zeros (explicit-cost layers model no memory)."""
    param_tensor_count: np.ndarray | None = None
    """Shape (num_layers,): parameter tensors of each full layer (what the optimizer step launches kernels
    over); None means none counted."""
    expert_tensor_count: np.ndarray | None = None
    """Shape (num_layers,): of ``param_tensor_count``, the routed experts' (every expert's); None means none."""
    bound_s: tuple[np.ndarray, ...] | None = None
    """What bounds each layer's passes on each microbatch: its forward, input- and weight-gradient seconds
    split into (compute, memory traffic, host issue, communication) seconds, four arrays of the per-microbatch
    shape (a pass the host's issue bounds counts whole as host; :mod:`mpipe_tune.cost._bound_by` reads them).
    None: not known (explicit-cost layers)."""

    def tp_degrees(self, options: CostOptions) -> np.ndarray:
        """Per layer, the tensor-parallel degree its weights are split over."""
        if self.layer_tp_degree is None:
            return np.full(self.param_count.shape, float(options.degrees.tp))
        return self.layer_tp_degree

    def expert_params(self) -> np.ndarray:
        """Per layer, the routed experts' parameters (zeros where there are none)."""
        return np.zeros_like(self.param_count) if self.expert_param_count is None else self.expert_param_count

    def tensor_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, (the parameter tensors outside the routed experts, the routed experts' tensors): zeros where
        none are counted."""
        tensors = np.zeros_like(self.param_count) if self.param_tensor_count is None else self.param_tensor_count
        experts = np.zeros_like(self.param_count) if self.expert_tensor_count is None else self.expert_tensor_count
        return tensors - experts, experts

    def backward_s(self, model: Model) -> np.ndarray:
        """Backward seconds under the footprint: a layer computes its input gradient iff some layer
        before it is trainable, and its weight gradient iff it is trainable; it runs a backward (and
        pays its per-call overhead and any recomputation) iff it does either."""
        needs_dgrad, trainable, runs = footprint_masks(model.trainable_bits())
        return self.dgrad_s * needs_dgrad + self.wgrad_s * trainable + (self.recompute_s + self.bwd_overhead_s) * runs

    def weight_grad_s(self, model: Model) -> np.ndarray:
        """Of :meth:`backward_s`, the weight-gradient seconds (trainable layers only): what a split
        backward's ``Wgrad`` event runs; its ``Bwd`` runs the rest (input gradients, the per-call
        overhead and any recomputation)."""
        return self.wgrad_s * footprint_masks(model.trainable_bits())[1]


@lru_cache(maxsize=256)
def footprint_masks(trainable_bits: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-layer column masks: computes its input gradient, its weight gradient, runs a backward."""
    trainable = np.array(trainable_bits, dtype=bool)
    needs_dgrad = np.concatenate(([False], np.cumsum(trainable)[:-1] > 0))
    return needs_dgrad[:, None], trainable[:, None], (needs_dgrad | trainable)[:, None]


def build_layer_table(model: Model, workload: Workload, profile: HardwareProfile, options: CostOptions) -> LayerTable:
    unique: dict[tuple, tuple] = {}  # repeated layers share one cost descriptor: compute each once
    arch_options = _arch_options(options)
    microbatches = tuple(workload.microbatches)
    for layer in model.layers:
        key = (layer.cost, layer.block)
        if key not in unique:
            unique[key] = _layer_row(layer.cost, layer.block, microbatches, profile, arch_options)
    replicas = options.encoder_replicas
    encoder = np.array([layer.block == ENCODER_BLOCK and isinstance(layer.cost, ArchCost) for layer in model.layers])
    rows = [unique[(layer.cost, layer.block)] for layer in model.layers]
    if replicas > 1 and encoder.any():  # the encoder's layers: every column but the boundary at its own degree
        encoder_options = replace(arch_options, degrees=replace(arch_options.degrees, tp=options.encoder_tp))
        encoder_rows = {}
        for key in {(u.cost, u.block) for u, e in zip(model.layers, encoder) if e}:
            row = list(unique[key])
            for i, values in zip(_ENCODER_COLUMNS, _encoder_row(key[0], microbatches, profile, encoder_options,
                                                                 replicas)):
                row[i] = values
            encoder_rows[key] = row
        rows = [encoder_rows[(u.cost, u.block)] if e else row for u, e, row in zip(model.layers, encoder, rows)]
    fwd, dgrad, wgrad, boundary, saved, bwd_overhead, core_s, selective_saved, wgrad_grad, *bound = (
        np.array(column) for column in zip(*rows))
    gather = np.zeros_like(fwd)
    if replicas > 1 and encoder.any():
        last = int(np.flatnonzero(encoder)[-1])  # the features are gathered after the encoder's last layer
        # forward; backward, its gradient: a reduce-scatter of the same bytes
        gather[last] = feature_gather_s(model.layers[last].cost, microbatches, profile, options)
    granularity = options.recompute_granularity
    experts = np.array([_expert_param_count(layer.cost) for layer in model.layers], dtype=float)
    kept = {"full": boundary, "selective": selective_saved, "none": saved}[granularity]
    table = LayerTable(
        fwd_s=fwd + gather,
        dgrad_s=dgrad + gather,
        wgrad_s=wgrad,
        boundary_bytes=boundary,
        saved_bytes=kept,
        param_count=np.array([_param_count(layer.cost) for layer in model.layers], dtype=float),
        recompute_s={"full": fwd, "selective": core_s, "none": np.zeros_like(fwd)}[granularity],
        bwd_overhead_s=bwd_overhead,
        expert_param_count=experts if experts.any() else None,
        layer_tp_degree=(np.where(encoder, float(options.encoder_tp), float(options.degrees.tp))
                         if replicas > 1 and encoder.any() else None),
        layer_replicas=np.where(encoder, float(replicas), 1.0) if replicas > 1 and encoder.any() else None,
        wgrad_kept_bytes=wgrad_grad + np.maximum(saved - kept, 0.0),
        bound_s=tuple(bound),
        param_tensor_count=np.array([_param_tensor_count(layer.cost) for layer in model.layers], dtype=float),
        expert_tensor_count=(np.array([_expert_tensor_count(layer.cost) for layer in model.layers], dtype=float)
                             if experts.any() else None),
    )
    return table if options.grad_accumulation_fusion else with_gradient_accumulation(table, profile, options)


def with_gradient_accumulation(table: LayerTable, profile: HardwareProfile, options: CostOptions) -> LayerTable:
    """``table`` with the unfused gradient accumulation charged to each weight-gradient pass: without Megatron-LM's
    ``gradient_accumulation_fusion`` (``--no-gradient-accumulation-fusion``) the weight-gradient GEMM writes a
    gradient in the step's dtype, and a hook adds it into the fp32 main gradient (``param.main_grad.add_(
    param.grad)``, megatron/core/distributed/distributed_data_parallel.py at core_r0.6.0): per microbatch and
    local parameter, a memory-bound pass reading the gradient and reading and writing the main gradient
    (``dtype_bytes + 2 * grad_bytes_per_param``) at the memory bandwidth."""
    local = (table.param_count - table.expert_params() * (1 - 1 / options.degrees.ep)) / table.tp_degrees(options)
    bytes_per_param = options.dtype_bytes() + 2.0 * options.grad_bytes_per_param
    extra = np.where(table.wgrad_s > 0, (local * bytes_per_param / profile.memory_bytes_per_s)[:, None], 0.0)
    compute, memory, host, comm = table.bound_s
    return replace(table, wgrad_s=table.wgrad_s + extra, bound_s=(compute, memory + extra, host, comm))


_PER_MICROBATCH = ("fwd_s", "dgrad_s", "wgrad_s", "boundary_bytes", "saved_bytes", "recompute_s", "bwd_overhead_s",
                   "wgrad_kept_bytes")
_COLUMNS = 13
"""Columns of :func:`arch_seconds`: nine, then the four bound-by columns (:attr:`LayerTable.bound_s`)."""
"""The :class:`LayerTable` fields with a column per microbatch."""


def build_layer_tables(model: Model, workloads: Sequence[Workload], profile: HardwareProfile,
                       options: CostOptions) -> list[LayerTable]:
    """:func:`build_layer_table` of each of ``workloads`` (the same tables), in one pass over all their
    microbatches: each layer is costed on every microbatch of every workload at once."""
    joined = build_layer_table(model, Workload(tuple(mb for w in workloads for mb in w.microbatches), "joined"),
                               profile, options)
    ends = np.cumsum([len(w.microbatches) for w in workloads])[:-1]
    columns = {name: np.split(getattr(joined, name), ends, axis=1) for name in _PER_MICROBATCH}
    bound = [np.split(column, ends, axis=1) for column in joined.bound_s]
    return [replace(joined, bound_s=tuple(np.ascontiguousarray(parts[index]) for parts in bound),
                    **{name: np.ascontiguousarray(parts[index]) for name, parts in columns.items()})
            for index in range(len(workloads))]


def encoder_split(mb: Microbatch, replicas: int) -> Microbatch:
    """The busiest of ``replicas`` shares of ``mb``'s images: whole images dealt largest first to the
    least-loaded share (an image is never split, so a single image gains nothing), as the sub-microbatch
    that share's encoder group works on; every group runs at once, so the busiest sets the time.

    >>> encoder_split(Microbatch(image_tokens=10, text_tokens=8, images=(4, 3, 3)), 2).images
    (3, 3)
    >>> encoder_split(Microbatch(image_tokens=6, text_tokens=8, images=(3, 3)), 2).image_tokens
    3
    """
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for size in sorted(mb.image_sizes(), reverse=True):
        min(shares, key=sum).append(size)
    busiest = tuple(max(shares, key=sum))
    return Microbatch(image_tokens=sum(busiest), text_tokens=mb.text_tokens, images=busiest)


_encoder_split = lru_cache(maxsize=65536)(encoder_split)
""":func:`encoder_split`, kept: the tables of every setting split the same microbatches."""


_ENCODER_COLUMNS = (0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12)
"""The columns of :func:`arch_columns` an encoder layer takes at its own degree: all but the boundary (3)."""


def _encoder_row(cost: ArchCost, microbatches, profile, encoder_options: CostOptions, replicas: int):
    """An encoder layer's columns (all but the boundary) at the encoder's own tensor-parallel degree, on
    the busiest share of each microbatch's images."""
    values = arch_columns(cost, tuple(_encoder_split(mb, replicas) for mb in microbatches), profile, encoder_options)
    return tuple(values[i] for i in _ENCODER_COLUMNS)


@lru_cache(maxsize=1024)
def feature_gather_s(cost: ArchCost, microbatches: tuple[Microbatch, ...], profile: HardwareProfile,
                     options: CostOptions) -> np.ndarray:
    """Per microbatch of ``microbatches``, in one pass, the all-gather of the encoder's output features over
    the ``tp / encoder_tp`` encoder groups: the whole output (the encoder's last layer's, at one rank's
    degree) as the gathered buffer, on the link class the tensor-parallel group spans (one package, one node, or
    more than a node); nothing without images."""
    batch = arch.MicrobatchArray.of(microbatches)
    full = arch.estimate_arch_work(cost.kind, cost.dims_dict(), batch, dtype_bytes=options.dtype_bytes()).boundary_bytes
    link = profile.link_spanning("all_gather", options.degrees.tp)
    gather_s = estimate_collective_s(link, "all_gather", full, options.encoder_replicas)
    return np.where(batch.image_tokens > 0, gather_s, 0.0)


def _arch_options(options: CostOptions) -> CostOptions:
    """``options`` with the fields :func:`arch_seconds` does not read (recomputation, ZeRO, pipeline, data and
    encoder parallelism) at one value, so that its cache serves every setting of them (the layer table's
    recomputation columns are chosen after, from ``options`` itself)."""
    return replace(options, recompute=False, shard_optimizer=True, shard_parameters=False,
                   degrees=replace(options.degrees, pp=1, dp=1, encoder_tp=None))


@lru_cache(maxsize=4096)
def _param_count(cost) -> int:
    return arch.param_count(cost.kind, cost.dims_dict()) if isinstance(cost, ArchCost) else 0


@lru_cache(maxsize=4096)
def _param_tensor_count(cost) -> int:
    return arch.param_tensor_count(cost.kind, cost.dims_dict()) if isinstance(cost, ArchCost) else 0


@lru_cache(maxsize=4096)
def _expert_param_count(cost) -> int:
    return arch.expert_param_count(cost.kind, cost.dims_dict()) if isinstance(cost, ArchCost) else 0


@lru_cache(maxsize=4096)
def _expert_tensor_count(cost) -> int:
    return arch.expert_tensor_count(cost.kind, cost.dims_dict()) if isinstance(cost, ArchCost) else 0


def _layer_row(cost, block: str, microbatches, profile, options):
    if isinstance(cost, ExplicitCost):
        image = block == "encoder"
        tokens = np.array([mb.image_tokens if image else mb.text_tokens for mb in microbatches], dtype=float)
        bwd = cost.bwd_s_per_token * tokens
        zeros = np.zeros_like(tokens)
        fwd = cost.fwd_s_per_token * tokens
        return (fwd, bwd / 2, bwd / 2, cost.boundary_bytes_per_token * tokens, zeros, zeros,
                zeros, zeros, zeros, fwd + bwd, zeros, zeros, zeros)  # an explicit cost: counted as compute
    return tuple(arch_columns(cost, tuple(microbatches), profile, options))


def op_recompute_pieces(pieces) -> tuple:
    """The pieces torchtitan's ``op`` selective checkpointing re-runs before a transformer block's backward
    (torchtitan/parallelisms/parallelize_llama.py at 004b3148, ``_custom_policy``: the outputs of ``aten.mm``
    and of the attention kernels are saved, except every second ``mm`` counted in the block's order, and every
    other operator is recomputed): every second matmul and every memory-bound kernel. Empty for a layer
    without an attention core (torchtitan wraps only the transformer blocks)."""
    if not any(p.family == "attention" for p in pieces):
        return ()
    again, matmuls = [], 0
    for piece in pieces:
        if piece.family == "gemm":
            matmuls += 1
            if matmuls % 2 == 0:
                again.append(piece)
        elif piece.family == "memory":
            again.append(piece)
    return tuple(again)


def op_saved_elems(layer, again) -> float:
    """Elements a transformer block keeps for its backward under torchtitan's ``op`` policy (``again``: the pieces
    it re-runs, :func:`op_recompute_pieces`): its input (the checkpoint's), the outputs of the matmuls it saves
    and the attention core's output; everything else is regenerated by the re-run."""
    rerun = {id(p) for p in again}
    kept = layer.boundary_elems
    for piece in layer.pieces:
        if id(piece) in rerun:
            continue
        if piece.family == "gemm":
            kept = kept + piece.gemm_shape[0] * piece.gemm_shape[1]
        elif piece.family == "attention":
            kept = kept + sum(elems for name, elems in piece.saved if name in piece.outputs)
    return kept


def layer_seconds(cost, block: str, mb: Microbatch, profile: HardwareProfile,
                  options: CostOptions) -> tuple[float, float, float, float]:
    """(forward, dgrad, wgrad, backward per-call) seconds the table charges one layer on ``mb``: what
    the profiler prices its timed points with."""
    row = _layer_row(cost, block, (mb,), profile, options)
    return float(row[0][0]), float(row[1][0]), float(row[2][0]), float(row[5][0])


@lru_cache(maxsize=64)
def _microbatch_array(microbatches: tuple[Microbatch, ...]) -> arch.MicrobatchArray:
    """:meth:`~mpipe_tune.cost._arch.MicrobatchArray.of` ``microbatches``, kept (read-only): a table's every layer
    kind is costed on the same joined batch."""
    batch = arch.MicrobatchArray.of(microbatches)
    for column in (batch.image_tokens, batch.text_tokens, batch.num_images, *batch.image_columns, *batch.text_columns):
        column.flags.writeable = False
    return batch


@lru_cache(maxsize=16384)
def arch_columns(cost: ArchCost, microbatches: tuple[Microbatch, ...], profile: HardwareProfile,
                 options: CostOptions) -> np.ndarray:
    """:func:`arch_seconds` of each of ``microbatches`` as the columns of a (9, microbatches) array, in
    one elementwise pass over a :class:`~mpipe_tune.cost._arch.MicrobatchArray` (the same arithmetic).
    Kept: the tables of settings that differ only in what the kernels do not read (recomputation, ZeRO,
    pp, dp, the encoder's degree) share their rows; 16,384 of them (each the rows of one layer kind over
    one setting's sampled steps, a few kB) serve a 512-device search's few thousand settings."""
    batch = _microbatch_array(microbatches)
    has_tokens = arch.stream_tokens(cost.kind, batch) > 0  # one microbatch without them costs nothing
    return np.array([np.where(has_tokens, value, 0.0) for value in arch_seconds(cost, batch, profile, options)],
                    dtype=float).reshape(_COLUMNS, len(microbatches))


def arch_seconds(cost: ArchCost, mb: Microbatch | arch.MicrobatchArray, profile: HardwareProfile,
                 options: CostOptions) -> tuple:
    """An architecture layer's (forward, dgrad, wgrad, boundary bytes, saved bytes, backward per-call seconds,
    attention-core seconds, selective saved bytes, weight-gradient kept bytes, then the (compute, memory, host,
    communication) split of its passes' seconds, :attr:`LayerTable.bound_s`) on ``mb``: one microbatch, or each
    entry of a :class:`~mpipe_tune.cost._arch.MicrobatchArray` (those without tokens of the layer's stream are
    left to the caller to zero, see :func:`arch_columns`).

    With the profile's ``kernel_efficiency`` the passes are timed kernel by kernel at their shapes'
    efficiencies (:func:`~mpipe_tune.cost._kernel_passes.shaped_pass_seconds`), else by the per-kind roofline
    (:func:`pass_seconds`); a kind the profile calibrated on the runtime's own layers
    (:meth:`~mpipe_tune.cost._profile.HardwareProfile.calibrated`) keeps its calibrated roofline and seconds per
    call, which on an inline host also hold its kernels' issue. With its ``host`` costs each pass takes at least the host's time to issue its
    kernels under the framework's kernel mode (the third roof: the device runs behind an asynchronous queue, so
    the host's issue time bounds the pass rather than adding to it; on an ``inline`` host, a CPU, the two add
    up), and a MoE layer's forward adds its syncs
    (the token counts per expert read back before the dispatch: the queue drains, so the device waits for the
    host's round trip whatever bounds the pass; :mod:`mpipe_tune.cost._moe`)."""
    vector = isinstance(mb, arch.MicrobatchArray)
    work, layer = arch.estimate_layer(
        cost.kind, cost.dims_dict(), mb, dtype_bytes=options.dtype_bytes(), tp_degree=options.degrees.tp,
        ep_degree=options.degrees.ep, moe_imbalance=options.moe_imbalance, cp_degree=options.degrees.cp,
        sequence_parallel=options.sequence_parallel, fused_loss=options.fused_loss, rope=options.rope,
        moe=options.moe_settings(),
    )
    *_, core_fwd_compute_s, core_bwd_compute_s = compute_seconds(work, cost.kind, profile, options.dtype)
    bandwidth = profile.memory_bytes_per_s
    comm_s = 0.0
    if options.degrees.tp > 1 and np.any(work.tp_comm_bytes > 0):
        link = profile.link_spanning("all_reduce", options.degrees.tp)
        comm_s = (estimate_collective_s(link, "all_reduce", work.tp_comm_bytes, options.degrees.tp)
                  * profile.tp_comm_exposed)
        if vector:
            comm_s = np.where(work.tp_comm_bytes > 0, comm_s, 0.0)
    ring_fwd_s = ring_bwd_s = forward_only_s = 0.0
    if options.degrees.ep > 1 or options.degrees.cp > 1 or options.degrees.tp > 1:
        ep = options.degrees.ep
        traffic = arch.estimate_parallel_traffic(
            cost.kind, cost.dims_dict(), mb, dtype_bytes=options.dtype_bytes(), tp_degree=options.degrees.tp,
            ep_degree=ep, moe_imbalance=options.moe_imbalance, cp_degree=options.degrees.cp,
            sequence_parallel=options.sequence_parallel, moe=options.moe_settings())
        if traffic.all_to_all_bytes:  # expert parallelism: dispatch and combine, again for their gradients
            link = profile.link_spanning("all_to_all", options.degrees.tp * ep)
            comm_s += sum(estimate_collective_s(link, "all_to_all", n, ep) for n in traffic.all_to_all_bytes)
        for c in traffic.group_collectives:  # a MoE dispatcher's gathers (their mirrors in the backward), its counts
            seconds = estimate_collective_s(profile.link_spanning(c.kind, c.span), c.kind, c.elems, c.group)
            if c.forward_only:
                forward_only_s += seconds
            else:
                comm_s += seconds
        if traffic.ring_steps:
            link = profile.link_spanning("p2p", options.degrees.tp * options.degrees.cp)
            core_fwd_s = maximum(core_fwd_compute_s, work.attention_core_fwd_bytes / bandwidth)
            core_bwd_s = maximum(core_bwd_compute_s, work.attention_core_dgrad_bytes / bandwidth)
            ring_fwd_s = exposed_ring_s(link, traffic.ring_step_bytes, traffic.ring_steps, core_fwd_s)
            ring_bwd_s = exposed_ring_s(link, 2.0 * traffic.ring_step_bytes, traffic.ring_steps, core_bwd_s)
    has_tokens = vector or arch.stream_tokens(cost.kind, mb) > 0  # an array's entries: zeroed by the caller
    fwd_call_s, bwd_call_s = profile.call_overhead_for(cost.kind) if has_tokens else (0.0, 0.0)
    fwd_images_s, bwd_images_s = estimate_image_calls_s(profile, cost.kind, mb)
    fwd_call_s, bwd_call_s = fwd_call_s + fwd_images_s, bwd_call_s + bwd_images_s
    calibrated = profile.calibrated(cost.kind)  # fitted on the runtime's own layers: the kernel model stands back
    if profile.kernel_efficiency is not None and layer is not None and not calibrated:
        device, compute = shaped_pass_seconds(layer.pieces, cost.kind, profile, options.dtype, options.dtype_bytes(),
                                              options.kernel_mode)
    else:
        device = pass_seconds(work, cost.kind, profile, options.dtype)
        compute = compute_bound(work, cost.kind, profile, options.dtype, device)
    comm = (comm_s + ring_fwd_s + forward_only_s, comm_s + ring_bwd_s, 0.0)
    host = (0.0, 0.0, 0.0)
    syncs_s = 0.0
    inline = profile.host is not None and profile.host.inline
    if profile.host is not None and layer is not None and not (calibrated and inline):
        host = host_pass_seconds(layer.pieces, options.kernel_mode, profile.host.dispatch_s)
        if cost.kind == "moe_block":  # the token counts read back: the device's queue drains, whatever bounds the pass
            syncs_s = (moe.host_syncs_per_forward(cost.dims_dict()["experts"], options.moe_dispatcher)
                       * profile.host.sync_s)
    passes = tuple(profile.host.pass_s(d + c, h) if profile.host is not None else d + c
                   for d, c, h in zip(device, comm, host))
    bound = bound_split(device, compute, comm, host, passes, inline=inline)
    if syncs_s:  # the host's round trips, after whatever bounds the forward
        passes = (passes[0] + syncs_s, *passes[1:])
        bound = (bound[0], bound[1], bound[2] + syncs_s, bound[3])
    fwd, dgrad, wgrad = fwd_call_s + passes[0], passes[1], passes[2]
    tp, ep = options.degrees.tp, options.degrees.ep
    splits = ([(profile.tp_overhead_for(cost.kind, tp), profile.tp_slowdown_for(cost.kind, tp))] if tp > 1 else []) \
        + ([profile.ep_overhead_for(cost.kind, ep)] if ep > 1 else [])
    for (fwd_split_s, bwd_split_s), (fwd_slow, bwd_slow) in splits if has_tokens else ():
        fwd = fwd * (1.0 + fwd_slow) + fwd_split_s  # what the profile measured of split calls beyond all that
        dgrad, wgrad = dgrad * (1.0 + bwd_slow), wgrad * (1.0 + bwd_slow)
        bwd_call_s = bwd_call_s * (1.0 + bwd_slow) + bwd_split_s
    core_s = maximum(core_fwd_compute_s, work.attention_core_fwd_bytes / bandwidth) + ring_fwd_s
    again = op_recompute_pieces(layer.pieces) if options.selective_recompute == "op" and layer is not None else ()
    selective_saved = work.selective_saved_activation_bytes
    if again:  # torchtitan's policy: what it re-runs, not the core, and what it keeps
        selective_saved = options.dtype_bytes() * op_saved_elems(layer, again)
        if profile.kernel_efficiency is not None:
            core_s = shaped_pass_seconds(again, cost.kind, profile, options.dtype, options.dtype_bytes(),
                                         options.kernel_mode)[0][0]
    return (fwd, dgrad, wgrad, work.boundary_bytes, work.saved_activation_bytes, bwd_call_s, core_s,
            selective_saved, work.wgrad_grad_bytes, *bound)
