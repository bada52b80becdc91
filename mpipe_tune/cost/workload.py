"""Workloads: the per-microbatch token counts that a step's event durations scale with.

A microbatch carries ``image_tokens`` (the tokens its images become after the encoder's merge, the
image stream) and ``text_tokens`` (the backbone's sequence length, the text stream; image tokens that
are spliced into the sequence count here too). ``images`` optionally lists the tokens of each image,
so that encoder attention can be charged per image.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Microbatch:
    """Token counts of one microbatch."""

    image_tokens: int
    """Image-stream tokens (after the encoder's spatial merge); encoder layers scale with these."""
    text_tokens: int
    """Backbone sequence length; every non-encoder layer scales with these."""
    images: tuple[int, ...] = field(default=())
    """Tokens of each image; empty means one image of ``image_tokens`` (or none when that is 0)."""

    def image_sizes(self) -> tuple[int, ...]:
        """Tokens per image, never empty when ``image_tokens > 0``."""
        if self.images:
            return self.images
        return (self.image_tokens,) if self.image_tokens > 0 else ()


@dataclass(frozen=True)
class Workload:
    """An ordered list of microbatches; microbatch ``m`` of a plan reads ``microbatches[m]``."""

    microbatches: tuple[Microbatch, ...]
    name: str = "workload"

    def __len__(self) -> int:
        return len(self.microbatches)
