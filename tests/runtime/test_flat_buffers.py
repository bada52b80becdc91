"""ZeRO-1's flat buffers are kept from step to step (a buffer allocated anew each step pays its page faults
again): the same tensor each call, holding the tensors in order and zeros past them."""

import torch

from mpipe_tune.runtime._compute import FlatBuffers


def test_a_buffer_is_kept_and_refilled() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    buffers = FlatBuffers()
    first = buffers.padded("gradients", params, [torch.ones(3), torch.full((2, 2), 2.0)], 4)
    assert first.tolist() == [1, 1, 1, 2, 2, 2, 2, 0]  # 7 elements padded to a multiple of 4
    first.fill_(9.0)  # what a collective leaves in it
    again = buffers.padded("gradients", params, [torch.full((3,), 3.0), torch.zeros(2, 2)], 4)
    assert again.data_ptr() == first.data_ptr()
    assert again.tolist() == [3, 3, 3, 0, 0, 0, 0, 0]
    # another use, or other parameters, get a buffer of their own
    assert buffers.padded("weights", params, [torch.ones(3), torch.ones(2, 2)], 4).data_ptr() != first.data_ptr()
    assert buffers.padded("gradients", params[:1], [torch.ones(3)], 4).data_ptr() != first.data_ptr()


def test_a_buffer_follows_the_dtype() -> None:
    params = [torch.nn.Parameter(torch.zeros(4))]
    buffers = FlatBuffers()
    single = buffers.padded("gradients", params, [torch.ones(4)], 2)
    double = buffers.padded("gradients", params, [torch.ones(4, dtype=torch.float64)], 2)
    assert (single.dtype, double.dtype) == (torch.float32, torch.float64)
