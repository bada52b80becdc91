"""The argument groups several ``mpipe-tune`` commands share, and what they parse into.

- :func:`add_candidate_arguments` (``predict``, ``derive``): one candidate and its inputs;
  :func:`parse_candidate` and :func:`load_candidate` read them.
- :func:`add_framework_arguments` (``predict``, ``plan``): how the trainer runs;
  :func:`framework_options` reads them.
- :func:`add_dataset_arguments` (every command taking ``--workload``, and ``workload``): how a dataset
  is read; :func:`dataset_options` reads them.
"""

from __future__ import annotations

import argparse
import sys

from mpipe_tune.errors import MpipeError


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise MpipeError(f"{flag} '{text}': expected integers separated by commas, e.g. {flag} 0,1,2,3") from None


def add_candidate_arguments(parser: argparse.ArgumentParser) -> None:
    """The inputs of one planning candidate, shared by ``predict`` and ``derive``."""
    from mpipe_tune.algebra import ZERO_SETTINGS

    parser.add_argument("--model", default="example-mllm",
                        help="built-in model name, YAML file, or Hugging Face config.json or its folder (default: example-mllm)")
    parser.add_argument("--profile", default="ideal", help="built-in hardware profile name or JSON file (default: ideal)")
    parser.add_argument("--workload", default="balanced",
                        help="workload YAML/JSON file, a built-in mix name or a dataset (LLaVA/ShareGPT JSON/JSONL, "
                             "CSV/Parquet/JSONL manifest), sampled with --seed (default: balanced)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling a named mix or a dataset (default 0)")
    add_dataset_arguments(parser)
    parser.add_argument("--pp", type=int, default=4, help="pipeline degree P (default 4)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatch count M (default: the workload file's length, or 8 for a mix)")
    parser.add_argument("--schedule", default="transpose,1f1b", help="skeleton per region, e.g. 'transpose,1f1b' (default)")
    parser.add_argument("--cut", default=None,
                        help="interior boundaries in layers, e.g. 32 or 32,48 (default for two regions: before the first backbone layer)")
    parser.add_argument("--slabs", default=None, help="layer count of each slab, P per Sharded region, in layer order "
                                                        "(rank 0's first; zbv's second region: rank P-1's first)")
    parser.add_argument("--owner", default="round-robin",
                        help="'round-robin' (default) or the rank of microbatch 0, 1, ... (0-based)")
    parser.add_argument("--frozen", default="", help="comma-separated blocks to freeze, e.g. encoder (default: none, every block trains)")
    parser.add_argument("--encoder-backward", default="cooldown", choices=("cooldown", "earliest", "optimised", "search"),
                        help="where each rank runs the trainable encoder's backwards it owns: cooldown (default, after "
                             "its last backbone event), earliest (first idle step after the gradient arrives), "
                             "optimised (slots chosen with the cost model) or search (the fastest of the three)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    parser.add_argument("--dtype", default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree, carved from the data-parallel ranks (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree (ring attention; default 1)")
    parser.add_argument("--encoder-tp", type=int, default=None, metavar="T",
                        help="the encoder block's own tensor-parallel degree, a divisor of --tp (the other tp/T "
                             "ranks of each group encode other images; default: --tp)")
    parser.add_argument("--zero", default="1", choices=tuple(ZERO_SETTINGS),
                        help="ZeRO stage: 1 shards the optimizer state over the data-parallel ranks (default), 2 the "
                             "gradients too, 3 the weights too (FSDP; 3-reshard gathers them for every forward and "
                             "backward, 3-keep once a step; 3: keep under pipeline parallelism, reshard at pp 1), 0 "
                             "nothing")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism with --tp")
    add_framework_arguments(parser)
    parser.add_argument("--recompute", nargs="?", const="full", default="none",
                        choices=("none", "off", "selective", "full", "on"),
                        help="activation recomputation: none (default; or off), selective (the attention core) or full "
                             "(or on; --recompute alone), the words plan's --recompute takes too")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def parse_candidate(args: argparse.Namespace, model, num_microbatches: int):
    """The candidate the flags describe, parsed and nothing more (``predict`` checks it); ``model``
    gives the default cut (before the first backbone layer) when ``--cut`` is left out, and
    ``num_microbatches`` is M (``--microbatches``, or the workload's length without it)."""
    from dataclasses import replace

    from mpipe_tune.algebra import (
        ZERO_SETTINGS, Candidate, default_cut, parse_recompute, normalize, parse_cut, parse_schedule,
    )

    schedule = parse_schedule(args.schedule)
    cut = parse_cut(args.cut) if args.cut is not None else default_cut(model, len(schedule))
    if len(schedule) == cut.num_regions:
        cut, schedule = normalize(cut, schedule)
    frozen = tuple(b.strip() for b in args.frozen.split(",") if b.strip())
    owner_map = None if args.owner == "round-robin" else _int_list(args.owner, "--owner")
    candidate = Candidate(
        str(schedule), cut.boundaries, pp=args.pp, tp=args.tp, dp=args.dp, num_microbatches=num_microbatches,
        owner_policy="round-robin" if owner_map is None and "transpose" in str(schedule).split(",") else None,
        recompute=parse_recompute(args.recompute, "--recompute"), ep=args.ep, cp=args.cp, zero_stage=ZERO_SETTINGS[args.zero][0],
        reshard_after_forward=ZERO_SETTINGS[args.zero][1], sequence_parallel=args.sequence_parallel,
        encoder_tp=args.encoder_tp, owner_map=owner_map, dtype=args.dtype, frozen=frozen,
        encoder_backward="cooldown" if args.encoder_backward == "search" else args.encoder_backward)
    if not args.slabs:
        return candidate
    candidate.validate()  # P >= 1 before --slabs is split into P counts per region
    flat = _int_list(args.slabs, "--slabs")
    if len(flat) % args.pp:
        raise MpipeError(f"--slabs lists {len(flat)} counts, which is not a multiple of --pp {args.pp}; give P counts per Sharded region")
    return replace(candidate, slab_counts=tuple(flat[i:i + args.pp] for i in range(0, len(flat), args.pp)))


def load_candidate(args: argparse.Namespace):
    """Load the inputs the arguments name, parse the candidate and predict it: returns (Prediction,
    model, workload, profile)."""
    from mpipe_tune.cost import predict, predict_fastest_placement
    from mpipe_tune.inputs import DEFAULT_NUM_MICROBATCHES
    from mpipe_tune.cost import load_profile
    from mpipe_tune.inputs import load_model, load_workload

    from mpipe_tune.inputs import is_dataset, load_dataset_workload, validate_dataset_options

    validate_dataset_options(args.workload, dataset_options(args))
    model = load_model(args.model)
    profile = load_profile(args.profile)
    if is_dataset(args.workload):
        workload, notes = load_dataset_workload(args.workload, args.model, model, dataset_options(args),
                                                num_microbatches=args.microbatches or DEFAULT_NUM_MICROBATCHES,
                                                seed=args.seed)
        print_notes(args.command, notes)
    else:
        workload = load_workload(args.workload, num_microbatches=args.microbatches, seed=args.seed)
    candidate = parse_candidate(args, model, len(workload) if args.microbatches is None else args.microbatches)
    run = predict_fastest_placement if args.encoder_backward == "search" else predict
    prediction = run(candidate, model, workload, profile, framework_options(args))
    return prediction, candidate.model_of(model), workload, profile


def add_framework_arguments(parser) -> None:
    """The flags of how the trainer runs, shared by ``predict`` and ``plan`` (a parser or a group):
    see :class:`mpipe_tune.cost._framework.Framework`."""
    parser.add_argument("--moe-imbalance", type=float, default=1.0,
                        help="routed tokens on the busiest expert-parallel rank over the mean (default 1: balanced)")
    from mpipe_tune.algebra import GRAD_REDUCE_DTYPES

    parser.add_argument("--grad-reduce-dtype", default="fp32", choices=GRAD_REDUCE_DTYPES,
                        help="dtype of the data-parallel gradient reduce: fp32 (default, Megatron-LM's) or bf16 "
                             "(NeMo's grad_sync_dtype=bf16)")
    parser.add_argument("--dp-overlap", default="on", choices=("on", "off"),
                        help="data-parallel reduce (and ZeRO-1 all-gather) overlapped with the backward (forward) "
                             "in buckets: on (default, as Megatron-LM and torchtitan run it) or off (after the "
                             "last backward)")
    from mpipe_tune.algebra import MOE_DISPATCHERS

    parser.add_argument("--moe-dispatcher", default=MOE_DISPATCHERS[0], choices=MOE_DISPATCHERS,
                        help="MoE token dispatcher, Megatron-Core's --moe-token-dispatcher-type: alltoall (default) "
                             "or allgather (Megatron-Core's default before 0.8)")
    parser.add_argument("--moe-capacity-factor", type=float, default=None, metavar="C",
                        help="MoE expert capacity over the balanced share (--moe-expert-capacity-factor; default: "
                             "none, dropless routing)")
    parser.add_argument("--moe-pad-to-capacity", action="store_true",
                        help="every expert runs its full capacity (--moe-pad-expert-input-to-capacity; needs "
                             "--moe-capacity-factor)")
    from mpipe_tune.algebra import DEFAULT_KERNEL_MODE, KERNEL_MODES

    parser.add_argument("--kernel-mode", default=DEFAULT_KERNEL_MODE, choices=KERNEL_MODES,
                        help="how the trainer launches kernels, where the profile gives host costs: eager (one per "
                             "operator), fused (default, Megatron-LM with Transformer Engine), compiled (a compiler "
                             "fuses the elementwise kernels), graphs (CUDA graphs: one host launch per layer pass)")


def framework_options(args: argparse.Namespace, **fields):
    """The cost options those flags give (plus ``fields``: the dtype), through
    :meth:`mpipe_tune.cost._framework.Framework.from_inputs`."""
    from mpipe_tune.cost import Framework

    framework = Framework.from_inputs({"moe_imbalance": args.moe_imbalance, "grad_reduce_dtype": args.grad_reduce_dtype,
                                       "overlap_dp_comm": args.dp_overlap == "on", "kernel_mode": args.kernel_mode,
                                       "moe_dispatcher": args.moe_dispatcher, "moe_capacity_factor": args.moe_capacity_factor,
                                       "moe_pad_to_capacity": args.moe_pad_to_capacity})
    return framework.cost_options(**fields)


def add_csv_argument(parser, what: str, row: str) -> None:
    """``--csv FILE``: write ``what`` (a table, one row per ``row``) to a CSV file, in seconds and bytes."""
    parser.add_argument("--csv", default=None, metavar="FILE",
                        help=f"write {what} to this CSV file, one row per {row}, in seconds and bytes")


def validate_csv_path(args) -> None:
    """Before any work: ``--csv``, when given, names a .csv file that can be written."""
    from mpipe_tune.outputs import validate_out_path

    if args.csv is not None:
        validate_out_path(args.csv, label="--csv", suffixes=(".csv",))


def add_dataset_arguments(parser) -> None:
    """How a dataset given as ``--workload`` (or DATA) is read: packing, text and image rules."""
    parser.add_argument("--seq-len", type=int, default=None, metavar="TOKENS",
                        help="dataset: pack samples into sequences of this many tokens, as the trainer does "
                             "(default: one sample per sequence)")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="dataset: the tokenizer.json to count text tokens with (default: the model folder's)")
    parser.add_argument("--chars-per-token", type=float, default=None, metavar="C",
                        help="dataset: characters per text token where there is no tokenizer (default 4)")
    parser.add_argument("--image-folder", default=None, metavar="DIR",
                        help="dataset: where a conversation file's image paths start (default: the file's folder)")


def dataset_options(args: argparse.Namespace):
    from mpipe_tune.inputs import DatasetOptions

    return DatasetOptions(seq_len=args.seq_len, chars_per_token=args.chars_per_token, tokenizer=args.tokenizer,
                          image_folder=args.image_folder)


def print_notes(command: str, notes: list[str]) -> None:
    for note in notes:
        print(f"mpipe-tune {command}: note: {note}", file=sys.stderr)
