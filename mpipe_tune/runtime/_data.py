"""Synthetic image-text microbatches, generated where they are needed.

Microbatch ``m`` of a plan's stored workload becomes random pixel patches (``image_tokens *
merge_factor`` patches per microbatch, split per image as the workload lists them), random text token
ids and random next-token targets. Each tensor is drawn from its own generator seeded by (seed,
microbatch index, what it is), so any rank, and the single-process reference, builds exactly the same
tensors for a microbatch without shipping raw data around and in whatever order it asks for them.
"""

from __future__ import annotations

import hashlib

import torch

from mpipe_tune.inputs import Microbatch


def seed_of(*parts: object) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MicrobatchInputs:
    """The synthetic inputs of one microbatch, drawn lazily and cached."""

    def __init__(self, mb: Microbatch, index: int, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        self.mb = mb
        self.index = index
        self.seed = seed
        self.dtype = dtype
        self.device = device
        self._cache: dict[tuple, torch.Tensor] = {}

    @property
    def image_sizes(self) -> tuple[int, ...]:
        """Tokens of each image (after the merge)."""
        return self.mb.image_sizes()

    def _draw(self, key: tuple, make) -> torch.Tensor:
        if key not in self._cache:
            generator = torch.Generator().manual_seed(seed_of(self.seed, self.index, *key))
            self._cache[key] = make(generator).to(self.device)
        return self._cache[key]

    def pixels(self, patch_elems: int, merge_factor: int) -> torch.Tensor:
        """Flattened pixel patches, ``[image_tokens * merge_factor, patch_elems]``."""
        rows = self.mb.image_tokens * merge_factor
        return self._draw(("pixels", patch_elems, merge_factor),
                          lambda g: torch.randn(rows, patch_elems, generator=g, dtype=torch.float64).to(self.dtype))

    def token_ids(self, vocab: int) -> torch.Tensor:
        return self._draw(("ids", vocab), lambda g: torch.randint(vocab, (self.mb.text_tokens,), generator=g))

    def targets(self, vocab: int) -> torch.Tensor:
        return self._draw(("targets", vocab), lambda g: torch.randint(vocab, (self.mb.text_tokens,), generator=g))


class ImageSubset:
    """The inputs of some of a microbatch's images (``images``: their numbers, in order), as the encoder
    layers read them: their sizes and their rows of the microbatch's pixel patches. An encoder group
    under its own tensor-parallel degree encodes the images dealt to it
    (:mod:`~mpipe_tune.runtime._encoder_groups`)."""

    def __init__(self, inputs: MicrobatchInputs, images: tuple[int, ...]) -> None:
        self.inputs = inputs
        self.images = images
        self.image_sizes = tuple(inputs.image_sizes[i] for i in images)

    def pixels(self, patch_elems: int, merge_factor: int) -> torch.Tensor:
        whole = self.inputs.pixels(patch_elems, merge_factor)
        rows = [n * merge_factor for n in self.inputs.image_sizes]
        parts = torch.split(whole, rows)
        return torch.cat([parts[i] for i in self.images]) if self.images else whole[:0]
