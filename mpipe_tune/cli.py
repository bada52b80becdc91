"""The ``mpipe-tune`` command: one class per subcommand, user errors exit 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys

from mpipe_tune.cli_bench import Bench
from mpipe_tune.cli_export import Export
from mpipe_tune.cli_plan import Plan, Show
from mpipe_tune.cli_profile import Profile
from mpipe_tune.cli_report import Report
from mpipe_tune.cli_run import Run
from mpipe_tune.cli_trials import Trials
from mpipe_tune.cli_workload import Workload, add_dataset_arguments, dataset_options, print_notes
from mpipe_tune import __version__
from mpipe_tune.command import Command, add_framework_arguments, framework_options
from mpipe_tune.errors import MpipeError


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise MpipeError(f"{flag} '{text}': expected integers separated by commas, e.g. {flag} 0,1,2,3") from None


def add_candidate_arguments(parser: argparse.ArgumentParser) -> None:
    """The inputs of one planning candidate, shared by ``predict`` and ``derive``."""
    parser.add_argument("--model", default="example-mllm", help="built-in model name or YAML file (default: example-mllm)")
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
    parser.add_argument("--owner", default="round-robin", help="'round-robin' or the rank of microbatch 0, 1, ... (0-based)")
    parser.add_argument("--frozen", default="", help="comma-separated blocks to freeze, e.g. encoder")
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
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1),
                        help="ZeRO stage: 1 shards the optimizer state over the data-parallel ranks (default), 0 does not")
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

    from mpipe_tune.algebra.candidate import Candidate, default_cut
    from mpipe_tune.algebra.candidate_text import parse_recompute
    from mpipe_tune.algebra.schedule import normalize, parse_cut, parse_schedule

    schedule = parse_schedule(args.schedule)
    cut = parse_cut(args.cut) if args.cut is not None else default_cut(model, len(schedule))
    if len(schedule) == cut.num_regions:
        cut, schedule = normalize(cut, schedule)
    frozen = tuple(b.strip() for b in args.frozen.split(",") if b.strip())
    owner_map = None if args.owner == "round-robin" else _int_list(args.owner, "--owner")
    candidate = Candidate(
        str(schedule), cut.boundaries, pp=args.pp, tp=args.tp, dp=args.dp, num_microbatches=num_microbatches,
        owner_policy="round-robin" if owner_map is None and "transpose" in str(schedule).split(",") else None,
        recompute=parse_recompute(args.recompute, "--recompute"), ep=args.ep, cp=args.cp, zero_stage=args.zero, sequence_parallel=args.sequence_parallel,
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
    from mpipe_tune.cost.predict import predict, predict_fastest_placement
    from mpipe_tune.inputs.workload import DEFAULT_NUM_MICROBATCHES
    from mpipe_tune.inputs.specs import load_model, load_profile, load_workload

    from mpipe_tune.workload_spec import is_dataset, load_dataset_workload

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


class Predict(Command):
    name = "predict"
    help = "predict the step time of one schedule (makespan, bubbles, spill, memory)"

    def add_arguments(self, parser):
        add_candidate_arguments(parser)
        parser.add_argument("--gantt", default=None, help="write the per-rank timeline picture to this PNG")

    def take_action(self, args):
        from mpipe_tune.report.tables import prediction_record, print_prediction

        if args.gantt:  # before any work
            from mpipe_tune.report.gantt import validate_picture_path

            validate_picture_path(args.gantt, label="--gantt")
        prediction, model, workload, profile = load_candidate(args)
        if args.gantt:
            from mpipe_tune.report.gantt import draw_gantt

            t = prediction.timeline
            draw_gantt(prediction.plan, t.start_s, t.durations_s, args.gantt,
                       title=f"{model.name} <{prediction.plan.schedule}> on {profile.name}: P={prediction.plan.num_ranks} "
                             f"M={prediction.plan.num_microbatches}, step {t.makespan_s * 1e3:.4g} ms")
        record = prediction_record(prediction, model, workload, profile)
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            print_prediction(record)
            if args.gantt:
                print(f"\nGantt picture written to {args.gantt}")
        return 0


class Derive(Command):
    name = "derive"
    help = "derive placement, collectives and per-rank orders of one schedule"

    def add_arguments(self, parser):
        add_candidate_arguments(parser)

    def take_action(self, args):
        from mpipe_tune.plan_file import derivation_record
        from mpipe_tune.report.tables import print_derivation

        prediction, *_ = load_candidate(args)
        record = derivation_record(prediction.plan)
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            print_derivation(record)
        return 0


class Models(Command):
    name = "models"
    help = "list the built-in model specs"

    def take_action(self, args):
        from mpipe_tune.inputs.specs import builtin_models, load_model

        for name in builtin_models():
            model = load_model(name)
            print(f"{name:28s} {model.num_layers:4d} layers  blocks: {', '.join(model.blocks())}")
        return 0


class Profiles(Command):
    name = "profiles"
    help = "list the built-in hardware profiles"

    def take_action(self, args):
        from mpipe_tune.inputs.specs import builtin_profiles, load_profile

        for name in builtin_profiles():
            p = load_profile(name)
            peaks = ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in sorted(p.peak_flops_per_s.items()))
            print(f"{name:20s} {p.device}: {peaks}; {p.memory_bytes_per_s / 1e9:.4g} GB/s, "
                  f"{p.memory_capacity_bytes / 2**30:.4g} GiB")
        return 0


COMMANDS: list[Command] = [Predict(), Derive(), Models(), Profiles(), Profile(), Run(), Bench(), Plan(), Show(), Export(), Trials(),
                         Workload(), Report()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpipe-tune", description="Plan, predict and run pipeline-parallel MLLM training.")
    parser.add_argument("--version", action="version", version=f"mpipe-tune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(handler=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler.take_action(args)
    except MpipeError as exc:
        print(f"mpipe-tune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        hint = args.handler.after_interrupt
        print(f"mpipe-tune {args.command}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
