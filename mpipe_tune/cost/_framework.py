"""How the trainer runs what a candidate does not say, as one record, and the one place a candidate
and that record become the cost model's options.

A :class:`~mpipe_tune.algebra._candidate.Candidate` fixes the degrees, the memory policy
(recomputation, ZeRO stage, sequence parallelism) and the dtype; the :class:`Framework` fixes the rest
of what a step costs: the MoE load imbalance and token dispatch, the dtype of the data-parallel gradient reduce, whether
that reduce overlaps the backward, its bucket size and the optimizer's and gradients' bytes per
parameter, and how it launches kernels. :meth:`Framework.from_inputs` builds one from the inputs a user gives (the flags of
``predict`` and ``plan``, plan.json's ``inputs``); :meth:`Framework.options` joins it with a
candidate into the :class:`~mpipe_tune.cost._layers.CostOptions` the cost kernels read.

>>> from mpipe_tune.algebra import Candidate
>>> f = Framework.from_inputs({"moe_imbalance": 1.5})
>>> o = f.options(Candidate("1f1b", (), pp=2, tp=2, dp=4, num_microbatches=8))
>>> (o.degrees.tp, o.degrees.dp, o.moe_imbalance, o.grad_reduce_dtype)
(2, 4, 1.5, 'fp32')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mpipe_tune.algebra import Candidate, Degrees
from mpipe_tune.cost._kernel_model import DEFAULT_KERNEL_MODE
from mpipe_tune.cost._layers import FRAMEWORK_OPTIONS, CostOptions


@dataclass(frozen=True)
class Framework:
    """The trainer's settings a prediction needs beside the candidate (the defaults: Megatron-LM's)."""

    moe_imbalance: float = 1.0
    """Routed rows on the busiest expert-parallel rank over the mean (>= 1; 1: balanced routing)."""
    grad_reduce_dtype: str = "fp32"
    """Dtype the data-parallel gradient reduce moves (``fp32`` or ``bf16``)."""
    overlap_dp_comm: bool = True
    """Data-parallel reduce (and ZeRO-1 all-gather) overlapped with the backward (forward) in buckets."""
    dp_bucket_params: float = 40e6
    """Parameters per data-parallel communication bucket."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state per parameter (Adam with fp32 master weights and two moments)."""
    grad_bytes_per_param: float = 4.0
    """Gradient bytes per parameter (fp32 accumulation)."""
    fused_loss: bool = False
    """Fused loss kernels (Megatron-LM's ``cross_entropy_loss_fusion``; its default, off)."""
    rope: str = "fused"
    """How RoPE runs (Megatron-LM's ``apply_rope_fusion``, its training default: one fused kernel)."""
    kernel_mode: str = DEFAULT_KERNEL_MODE
    """How kernels are launched (:data:`~mpipe_tune.cost._kernel_model.KERNEL_MODES`: ``eager``, ``fused``,
    ``compiled``, ``graphs``): the kernels each pass runs and what the host pays to issue them."""
    grad_accumulation_fusion: bool = True
    """Weight gradients accumulated into the fp32 main gradient by the GEMM (Megatron-LM's default); False: a
    separate add per parameter and microbatch (``--no-gradient-accumulation-fusion``)."""
    selective_recompute: str = "attention_core"
    """What ``selective`` recomputation re-runs (:data:`~mpipe_tune.cost._layers.SELECTIVE_POLICIES`:
    Megatron-LM's attention core, or torchtitan's ``op`` policy)."""
    moe_dispatcher: str = "alltoall"
    """The MoE token dispatcher (:data:`~mpipe_tune.cost._moe.DISPATCHERS`; Megatron-Core's
    ``--moe-token-dispatcher-type``, whose default before core 0.8 was ``allgather``)."""
    moe_capacity_factor: float | None = None
    """Expert capacity over the balanced share (``--moe-expert-capacity-factor``); None: dropless."""
    moe_pad_to_capacity: bool = False
    """Every expert runs its full capacity (``--moe-pad-expert-input-to-capacity``)."""
    flat_buffer_copies: bool = False
    """The data-parallel reduce copies gradients (and a distributed optimizer the weights) through flat buffers
    (:attr:`~mpipe_tune.cost._layers.CostOptions.flat_buffer_copies`: torch DDP, this project's executor); False:
    Megatron-LM's contiguous buffers."""
    defer_gradient_reduce: bool = False
    """ZeRO-2's reduce-scatters asynchronous, one backward's in flight (the Llama 3 paper's FSDP); False: waited at
    each backward's end, as torch FSDP2 does. Not a flag yet: ``bench_published`` sets it from a run's source."""

    @classmethod
    def from_inputs(cls, inputs: Mapping[str, Any] | object) -> Framework:
        """The framework the inputs record (:data:`~mpipe_tune.cost._layers.FRAMEWORK_OPTIONS`: what the
        flags set, as a mapping, and plan.json's ``inputs`` record, as its fields); a key the inputs lack
        takes its default. What :meth:`CostOptions.framework` writes, this reads: the one serialisation."""
        if not isinstance(inputs, Mapping):
            inputs = {key: getattr(inputs, key) for key in FRAMEWORK_OPTIONS if hasattr(inputs, key)}
        return cls(**{key: inputs[key] for key in FRAMEWORK_OPTIONS if key in inputs})

    @classmethod
    def of(cls, options: CostOptions) -> Framework:
        """The framework part of a cost options record."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls)})

    def options(self, candidate: Candidate) -> CostOptions:
        """The cost options of ``candidate`` under this framework: its dtype, degrees and memory policy."""
        c = candidate
        return self.cost_options(c.degrees, dtype=c.dtype, recompute=c.recompute, zero_stage=c.zero_stage,
                                 sequence_parallel=c.sequence_parallel, reshard_after_forward=c.reshards_after_forward)

    def cost_options(self, degrees: Degrees = Degrees(1), *, dtype: str = "bf16", recompute: bool | str = False,
                     zero_stage: int = 1, sequence_parallel: bool = False,
                     reshard_after_forward: bool = True) -> CostOptions:
        """The cost options of these degrees and memory policy under this framework (what
        :meth:`options` reads off a candidate; the defaults: one device, no recomputation)."""
        return CostOptions(
            dtype=dtype, degrees=degrees, moe_imbalance=self.moe_imbalance, sequence_parallel=sequence_parallel,
            optimizer_bytes_per_param=self.optimizer_bytes_per_param, grad_bytes_per_param=self.grad_bytes_per_param,
            shard_optimizer=zero_stage >= 1, shard_gradients=zero_stage == 2, shard_parameters=zero_stage == 3,
            reshard_after_forward=reshard_after_forward, grad_reduce_dtype=self.grad_reduce_dtype,
            overlap_dp_comm=self.overlap_dp_comm, dp_bucket_params=self.dp_bucket_params, recompute=recompute,
            fused_loss=self.fused_loss, rope=self.rope, kernel_mode=self.kernel_mode,
            selective_recompute=self.selective_recompute, grad_accumulation_fusion=self.grad_accumulation_fusion,
            moe_dispatcher=self.moe_dispatcher, moe_capacity_factor=self.moe_capacity_factor,
            moe_pad_to_capacity=self.moe_pad_to_capacity, defer_gradient_reduce=self.defer_gradient_reduce,
            flat_buffer_copies=self.flat_buffer_copies)
