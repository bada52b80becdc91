"""The optimizer update: its seconds per pipeline rank, and the event each rank's update is charged to.

After its last gradient reduce a rank updates the weights it holds: for every trainable parameter of
its slabs (and of a Replicated region, held whole by every rank) it reads the weight, the gradient
and the optimizer state and writes the weight and the state back. That is memory traffic, timed at
the profile's update rate (:attr:`~mpipe_tune.cost._profile.HardwareProfile.update_bytes_per_s`: the
profiler's measurement of the runtime's own update, else the memory bandwidth):

    bytes = local trainable parameters * (2 * dtype_bytes + grad_bytes_per_param + 2 * optimizer_bytes_per_param)

with a rank's parameters split over its tensor-parallel group (the encoder's over ``encoder_tp``) and
a MoE layer's routed experts over the expert-parallel group, and, with a distributed optimizer
(ZeRO-1, and ZeRO-3), ``1 / (dp * cp)`` of them updated per rank (each rank updates its shard; the
all-gather of the weights is charged with the reduce). Plain SGD (the runtime's) has no state:
``optimizer_bytes_per_param = 0`` gives its 3 reads and writes per weight in fp32.

Where the profile has host costs (:mod:`~mpipe_tune.cost._kernel_model`) the update also takes at least the
host's time to issue its kernels (:func:`~mpipe_tune.cost._kernel_model.optimizer_kernels` over the rank's
trainable parameter tensors, under the framework's kernel mode: torch's ``foreach`` AdamW when eager, a fused
Adam otherwise; on an ``inline`` host, a CPU, that time adds to the update's), and each rank pays one host sync per step (``sync_s``: the gradient-norm check reads the
norm back, which drains the queue).

The update runs after the rank's last event of the step, so it is charged there: the event before
the step barrier in ``nodes(r)``. When that event is shared by several ranks (a ReplicaGroup reduce
of a transposed encoder whose backbone is frozen), it is charged the largest of their updates, which
is when the last of them is done.
"""

from __future__ import annotations

import numpy as np

from mpipe_tune.algebra import BARRIER, Plan, Model
from mpipe_tune.cost._kernel_model import optimizer_kernels
from mpipe_tune.cost._layers import CostOptions, LayerTable
from mpipe_tune.cost._memory import local_params, per_rank_sum, rank_layers
from mpipe_tune.cost._profile import HardwareProfile


def update_bytes_per_param(options: CostOptions) -> float:
    """Bytes one parameter's update reads and writes: weight (read, write), gradient (read), state
    (read, write).

    >>> update_bytes_per_param(CostOptions(dtype="fp32", optimizer_bytes_per_param=0.0))  # SGD in fp32
    12.0
    """
    return 2.0 * options.dtype_bytes() + options.grad_bytes_per_param + 2.0 * options.optimizer_bytes_per_param


def estimate_update_s(plan: Plan, model: Model, table: LayerTable, profile: HardwareProfile,
                      options: CostOptions) -> np.ndarray:
    """Seconds of each pipeline rank's optimizer update (see the module docstring)."""
    trainable = np.array(model.trainable_bits(), dtype=bool)
    shards = options.degrees.dp * options.degrees.cp if options.shard_optimizer else 1
    per_layer = local_params(table, options) * trainable * update_bytes_per_param(options) / shards
    layers = rank_layers(plan)
    update_s = np.array(per_rank_sum(layers, per_layer)) / profile.update_bytes_per_s
    if profile.host is None or table.param_tensor_count is None:
        return update_s
    tensors = per_rank_sum(layers, table.param_tensor_count * trainable)
    issue_s = np.array([optimizer_kernels(t, options.kernel_mode) for t in tensors]) * profile.host.dispatch_s
    return profile.host.pass_s(update_s, issue_s) + profile.host.sync_s


def update_charges(plan: Plan, update_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(event indices, seconds): each rank's update on its last event before the step barrier, the
    largest of the updates where ranks share that event."""
    charge: dict[int, float] = {}
    kind = plan.order.columns.kind
    for rank, nodes in enumerate(plan.order.nodes):
        last = next((i for i in reversed(nodes) if kind[i] != BARRIER), None)
        if last is not None:
            charge[last] = max(charge.get(last, 0.0), float(update_s[rank]))
    return np.array(list(charge), dtype=np.int64), np.array(list(charge.values()))
