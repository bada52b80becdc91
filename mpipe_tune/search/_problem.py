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

from dataclasses import dataclass, field
from functools import cached_property

from mpipe_tune.algebra import MAX_DEVICES, Degrees, Model
from mpipe_tune.cost import Framework, CostOptions, HardwareProfile
from mpipe_tune.inputs import Dataset, DatasetDraw, MIXES, Microbatch, MixDraw, Workload, pack, sample_workload
from mpipe_tune.errors import MpipeError

MAX_GLOBAL_BATCH = 1 << 18
"""The most sequences per step (262144: four per device at :data:`MAX_DEVICES`); a mix's sequence is
thousands of tokens, so this is a billion tokens a step, far above any training run's batch."""
MAX_SAMPLES = 64
"""The most sampled steps the objective averages over: the mean of 64 steps is within an eighth of
the step-to-step spread, and each sampled step multiplies the cost of every trial."""
MAX_SAMPLED_SEQUENCES = 1 << 19
"""The most sequences a search may draw over all sampled steps (sampled steps x the largest share of
one replica): about a minute of sampling on one core."""


def _limit(value: int, what: str, lower: int, upper: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lower:
        raise MpipeError(f"the {what} is {value!r}, but it must be an integer >= {lower}; {fix}")
    if value > upper:
        raise MpipeError(f"the {what} {value} is above {upper}, a limit no real plan reaches; {fix}")


@dataclass(frozen=True)
class Problem:
    """What a search plans for: a model on a hardware profile, a device count, the global batch of
    sequences one step trains, where the steps' sequences come from (a mix sampled ``num_samples``
    times, or one fixed workload), and the framework and dtype every candidate is predicted under."""

    model: Model
    profile: HardwareProfile
    devices: int
    global_batch: int
    """Sequences per step over all data-parallel replicas."""
    mix: str | None = None
    """A built-in mix name; exactly one of ``mix``, ``workload`` and ``dataset`` is given."""
    workload: Workload | None = None
    """A fixed workload (from a file): the global batch's sequences, in order."""
    dataset: Dataset | None = None
    """A dataset whose records each sampled step draws, as it draws a mix's samples."""
    num_samples: int = 4
    """Sampled steps the objective averages over (1 for a workload file)."""
    seed: int = 0
    options: CostOptions = field(default_factory=CostOptions)
    """Cost options other than those a candidate sets (degrees, recompute, ZeRO stage, sequence
    parallelism): dtype, optimizer bytes, MoE load imbalance, ..."""
    _drawn: dict[int, tuple[Microbatch, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per sampled step, the longest prefix of its sequences drawn so far."""
    _replicas: dict[tuple[int, int, int], Workload] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)
    """:meth:`replica_workload` per (sample, dp, microbatches): every setting of those degrees packs the same."""

    def __post_init__(self) -> None:
        assert [self.mix, self.workload, self.dataset].count(None) == 2, "give a mix, a workload or a dataset"
        if self.mix is not None and self.mix not in MIXES:
            raise MpipeError(f"unknown workload mix {self.mix!r}; mixes: {', '.join(MIXES)}")
        _limit(self.devices, "device count", 1, MAX_DEVICES, f"plan for 1 to {MAX_DEVICES} devices")
        _limit(self.global_batch, "global batch (sequences per step over all replicas)", 1, MAX_GLOBAL_BATCH,
               f"give 1 to {MAX_GLOBAL_BATCH} sequences")
        if self.workload is not None and len(self.workload) != self.global_batch:
            raise MpipeError(
                f"the workload file '{self.workload.name}' holds {len(self.workload)} sequences but the global batch is "
                f"{self.global_batch}; a file is one step's global batch: leave the global batch out or make them equal"
            )
        _limit(self.num_samples, "number of sampled steps", 1, MAX_SAMPLES, f"average over 1 to {MAX_SAMPLES} steps")

    @property
    def samples(self) -> int:
        return 1 if self.workload is not None else self.num_samples

    @cached_property
    def framework(self) -> Framework:
        """How the trainer runs (the framework part of :attr:`options`)."""
        return Framework.of(self.options)

    @property
    def dtype(self) -> str:
        """The compute dtype every candidate of the problem is predicted in."""
        return self.options.dtype

    def options_for(self, tp: int, dp: int, recompute: bool | str = False, *, ep: int = 1, cp: int = 1,
                    zero_stage: int = 1, sequence_parallel: bool = False,
                    encoder_tp: int | None = None) -> CostOptions:
        """The cost options of a candidate with these degrees and memory policy (the rest the problem's)."""
        return self.framework.cost_options(Degrees(1, tp=tp, dp=dp, ep=ep, cp=cp, encoder_tp=encoder_tp),
                                           dtype=self.dtype, recompute=recompute, zero_stage=zero_stage,
                                           sequence_parallel=sequence_parallel)

    @cached_property
    def source_name(self) -> str:
        if self.dataset is not None:
            return self.dataset.name
        return self.mix if self.mix is not None else self.workload.name

    def sequences(self, sample: int, count: int) -> tuple[Microbatch, ...]:
        """The first ``count`` sequences of sampled step ``sample``."""
        if self.workload is not None:
            return self.workload.microbatches[:count]
        drawn = self._drawn.get(sample, ())
        if len(drawn) < count:  # a prefix is the same draw, whatever its length: draw only what is asked
            count_now = min(self.global_batch, max(count, 4 * len(drawn)))  # (or a few times more: fewer redraws)
            if self.dataset is not None:
                drawn = self.dataset.sequences(count_now, self.seed + sample)
            else:
                drawn = sample_workload(self.mix, count_now, self.seed + sample).microbatches
            self._drawn[sample] = drawn
        return drawn[:count]

    def validate_sampling(self, min_dp: int) -> None:
        """Refuse a search whose sampled steps would draw more than :data:`MAX_SAMPLED_SEQUENCES`
        sequences, when its smallest data-parallel degree is ``min_dp`` (the largest replica share)."""
        if self.workload is not None:
            return
        share = self.global_batch // min_dp
        if share * self.num_samples > MAX_SAMPLED_SEQUENCES:
            raise MpipeError(
                f"{self.num_samples} sampled steps of up to {share} sequences per replica (global batch "
                f"{self.global_batch}, dp {min_dp}) draw {share * self.num_samples} sequences, above "
                f"{MAX_SAMPLED_SEQUENCES}, a limit no real plan reaches; sample fewer steps, give a smaller global "
                f"batch, or plan for more devices"
            )

    def replica_workload(self, sample: int, dp: int, num_microbatches: int) -> Workload:
        """Step ``sample``'s share of one replica, packed into ``num_microbatches`` microbatches (kept: the
        tables of every setting with these degrees read it)."""
        key = (sample, dp, num_microbatches)
        if key not in self._replicas:
            self._replicas[key] = self._packed_replica(sample, dp, num_microbatches)
        return self._replicas[key]

    def _packed_replica(self, sample: int, dp: int, num_microbatches: int) -> Workload:
        per_replica = self.global_batch // dp
        assert per_replica * dp == self.global_batch and per_replica % num_microbatches == 0
        sequences = self.sequences(sample, per_replica)
        s = per_replica // num_microbatches
        microbatches = tuple(pack(sequences[i * s:(i + 1) * s]) for i in range(num_microbatches))
        name = f"{self.source_name}" + (f"@seed{self.seed + sample}" if self.workload is None else "")
        draw = MixDraw(self.mix, self.seed + sample, s) if self.mix is not None else None
        if self.dataset is not None:
            draw = DatasetDraw(self.dataset.spec, self.seed + sample, s)
        return Workload(microbatches, f"{name}/dp{dp}/M{num_microbatches}", draw)

