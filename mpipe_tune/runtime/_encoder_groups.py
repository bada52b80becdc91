"""The encoder under its own tensor-parallel degree (``encoder_tp`` below the plan's ``tp``).

A tensor-parallel group of ``tp`` ranks holds ``G = tp / encoder_tp`` encoder groups of ``encoder_tp``
consecutive ranks (the tp dimension of the mesh unflattened into ``("etg", "etp")``). Each group
encodes the images dealt to it, image ``i`` of a microbatch to group ``i mod G``, with the encoder's
layers split over its own ``encoder_tp`` ranks; the groups' features are then all-gathered over the
whole tp group and put back in image order before the projector, which with the rest of the model
runs at ``tp``, as the cost model charges it (:attr:`~mpipe_tune.cost._layers.CostOptions.encoder_replicas`).

In the backward every rank of the tp group holds the same gradient of the gathered features (the
layers after it compute replicated input gradients), so the gather's backward keeps the rows of its
own group's images. An encoder weight is then replicated over the ``G`` groups, each holding the
gradient of its own images: the reduce sums it over the ranks at the same place in the other groups
(the mesh's ``etg`` dimension) as well as over its data-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpipe_tune.runtime._data import ImageSubset, MicrobatchInputs
from mpipe_tune.runtime._mesh import ALL_GATHER_INTO


def dealt_images(num_images: int, group: int, num_groups: int) -> tuple[int, ...]:
    """The images of a microbatch that encoder group ``group`` encodes.

    >>> dealt_images(5, 1, 2)
    (1, 3)
    """
    return tuple(range(group, num_images, num_groups))


def subset_inputs(inputs: MicrobatchInputs, group: int, num_groups: int) -> ImageSubset:
    return ImageSubset(inputs, dealt_images(len(inputs.image_sizes), group, num_groups))


def gather_features(features: torch.Tensor, inputs: MicrobatchInputs, group: int, num_groups: int,
                    merge_rows: int, tp_group: dist.ProcessGroup, tp_rank: int, encoder_tp: int) -> torch.Tensor:
    """Every image's features in image order, from each encoder group's ``features`` (the rows of its
    images, ``merge_rows`` per image token): an all-gather over the tp group (the first rank of each
    encoder group is read)."""
    return _Gather.apply(features, inputs.image_sizes, group, num_groups, merge_rows, tp_group, tp_rank, encoder_tp)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, sizes, group, num_groups, rows_per_token, tp_group, tp_rank, encoder_tp):
        rows = [n * rows_per_token for n in sizes]
        mine = dealt_images(len(sizes), group, num_groups)
        counts = [sum(rows[i] for i in dealt_images(len(sizes), g, num_groups)) for g in range(num_groups)]
        width = features.shape[1]
        longest = max(counts)
        padded = features.new_zeros((longest, width))
        padded[:features.shape[0]] = features
        tp_size = num_groups * encoder_tp
        gathered = features.new_empty((tp_size * longest, width))
        ALL_GATHER_INTO(gathered, padded.contiguous(), group=tp_group)
        per_group = [gathered[g * encoder_tp * longest: g * encoder_tp * longest + counts[g]] for g in range(num_groups)]
        pieces: list[torch.Tensor] = [features[:0]] * len(sizes)
        for g in range(num_groups):
            offset = 0
            for i in dealt_images(len(sizes), g, num_groups):
                pieces[i] = per_group[g][offset:offset + rows[i]]
                offset += rows[i]
        ctx.rows, ctx.mine = rows, mine
        return torch.cat(pieces) if pieces else features[:0]

    @staticmethod
    def backward(ctx, grad):
        parts = torch.split(grad, ctx.rows)
        own = [parts[i] for i in ctx.mine]
        return (torch.cat(own) if own else grad[:0]), None, None, None, None, None, None, None
