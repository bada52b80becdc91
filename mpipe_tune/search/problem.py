"""A planning problem: model, hardware, workload source, device count and global batch.

**Global batch.** A step trains a fixed global batch of ``global_batch`` *sequences*, the mix's
microbatch unit (``samples_per_microbatch`` samples packed into ``seq_len`` tokens), whatever the
degrees: so step times of different (pp, tp, dp) and microbatch counts compare the same work. Each
of the ``dp`` pipeline replicas trains ``global_batch / dp`` sequences per step, as ``M``
microbatches of ``s = global_batch / (dp * M)`` sequences each. A microbatch of ``s > 1`` sequences
is modelled as one packed sequence holding all of them (their images, their tokens): the cost model
charges causal attention over the whole packed length, so larger microbatches pay for longer
sequences. The same samples are used for every ``M``, so only the schedule changes between choices.

**Sampled workloads.** The objective averages the step time over ``num_samples`` independent steps:
step ``k`` draws its sequences from the mix with seed ``seed + k``; the replica modelled is the one
that gets the first ``global_batch / dp`` of them (replicas are statistically alike; the straggler
effect of their differences is not modelled). A workload *file* is one fixed step: its entries are
the global batch's sequences, and there is one sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

from mpipe_tune.algebra.model import Model
from mpipe_tune.cost.layers import CostOptions
from mpipe_tune.cost.profile import HardwareProfile
from mpipe_tune.cost.workload import MIXES, Microbatch, Workload, sample_workload
from mpipe_tune.errors import MpipeError


@dataclass(frozen=True)
class Problem:
    model: Model
    profile: HardwareProfile
    devices: int
    global_batch: int
    """Sequences per step over all data-parallel replicas."""
    mix: str | None = None
    """A built-in mix name; exactly one of ``mix`` and ``workload`` is given."""
    workload: Workload | None = None
    """A fixed workload (from a file): the global batch's sequences, in order."""
    num_samples: int = 4
    """Sampled steps the objective averages over (1 for a workload file)."""
    seed: int = 0
    options: CostOptions = field(default_factory=CostOptions)
    """Cost options other than those a candidate sets (tp, dp, recompute): dtype, optimizer bytes, ..."""

    def __post_init__(self) -> None:
        assert (self.mix is None) != (self.workload is None), "give a mix or a workload"
        if self.mix is not None and self.mix not in MIXES:
            raise MpipeError(f"unknown workload mix {self.mix!r}; mixes: {', '.join(MIXES)}")
        if self.devices < 1:
            raise MpipeError(f"--devices is {self.devices}, but the device count must be an integer >= 1")
        if self.global_batch < 1:
            raise MpipeError(f"--global-batch is {self.global_batch}, but it must be an integer >= 1 (sequences per step)")
        if self.workload is not None and len(self.workload) != self.global_batch:
            raise MpipeError(
                f"the workload file '{self.workload.name}' holds {len(self.workload)} sequences but --global-batch is "
                f"{self.global_batch}; a file is one step's global batch: drop --global-batch or make them equal"
            )
        if self.num_samples < 1:
            raise MpipeError(f"--samples is {self.num_samples}, but at least one sampled step is needed")

    @property
    def samples(self) -> int:
        return 1 if self.workload is not None else self.num_samples

    def options_for(self, tp: int, dp: int, recompute: bool = False) -> CostOptions:
        return replace(self.options, tp_degree=tp, dp_degree=dp, recompute=recompute)

    @cached_property
    def source_name(self) -> str:
        return self.mix if self.mix is not None else self.workload.name

    def sequences(self, sample: int, count: int) -> tuple[Microbatch, ...]:
        """The first ``count`` sequences of sampled step ``sample``."""
        if self.workload is not None:
            return self.workload.microbatches[:count]
        return self._step_sequences(sample)[:count]

    @lru_cache(maxsize=64)  # noqa: B019 - problems are few and long-lived
    def _step_sequences(self, sample: int) -> tuple[Microbatch, ...]:
        """All ``global_batch`` sequences of step ``sample`` (a prefix is the same draw, whatever its length)."""
        return sample_workload(self.mix, self.global_batch, self.seed + sample).microbatches

    def replica_workload(self, sample: int, dp: int, num_microbatches: int) -> Workload:
        """Step ``sample``'s share of one replica, packed into ``num_microbatches`` microbatches."""
        per_replica = self.global_batch // dp
        assert per_replica * dp == self.global_batch and per_replica % num_microbatches == 0
        sequences = self.sequences(sample, per_replica)
        s = per_replica // num_microbatches
        microbatches = tuple(pack(sequences[i * s:(i + 1) * s]) for i in range(num_microbatches))
        name = f"{self.source_name}" + (f"@seed{self.seed + sample}" if self.mix is not None else "")
        return Workload(microbatches, f"{name}/dp{dp}/M{num_microbatches}")


def pack(sequences: tuple[Microbatch, ...]) -> Microbatch:
    """One microbatch holding the given sequences back to back (their images and their tokens)."""
    if len(sequences) == 1:
        return sequences[0]
    images = tuple(size for mb in sequences for size in mb.image_sizes())
    return Microbatch(sum(mb.image_tokens for mb in sequences), sum(mb.text_tokens for mb in sequences), images)
