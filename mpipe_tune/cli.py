"""The ``mpipe-tune`` command: one class per subcommand, user errors exit 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys

from mpipe_tune.cli_bench import Bench
from mpipe_tune.cli_export import Export
from mpipe_tune.cli_plan import Plan, Show
from mpipe_tune.cli_profile import Profile
from mpipe_tune.cli_run import Run
from mpipe_tune.cli_trials import Trials
from mpipe_tune import __version__
from mpipe_tune.command import Command
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
                        help="workload YAML/JSON file, or a built-in mix name sampled with --seed (default: balanced)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling a named mix (default 0)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline degree P (default 4)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatch count M (default: the workload file's length, or 8 for a mix)")
    parser.add_argument("--schedule", default="transpose,1f1b", help="skeleton per region, e.g. 'transpose,1f1b' (default)")
    parser.add_argument("--cut", default=None,
                        help="interior boundaries in layers, e.g. 32 or 32,48 (default for two regions: before the first backbone layer)")
    parser.add_argument("--slabs", default=None, help="layer count of each rank's slab, P per Sharded region, in order")
    parser.add_argument("--owner", default="round-robin", help="'round-robin' or the rank of microbatch 0, 1, ... (0-based)")
    parser.add_argument("--frozen", default="", help="comma-separated blocks to freeze, e.g. encoder")
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
    parser.add_argument("--moe-imbalance", type=float, default=1.0,
                        help="routed tokens on the busiest expert-parallel rank over the mean (default 1: balanced)")
    parser.add_argument("--recompute", nargs="?", const="full", default="none", choices=("none", "selective", "full"),
                        help="activation recomputation: none (default), selective (the attention core) or full "
                             "(--recompute alone)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def load_candidate(args: argparse.Namespace):
    """Resolve the candidate arguments and predict it: returns (Prediction, model, workload, profile, options)."""
    from mpipe_tune.algebra.schedule import Skeleton, normalize, parse_cut, parse_schedule
    from mpipe_tune.cost.layers import CostOptions
    from mpipe_tune.cost.predict import predict
    from mpipe_tune.specs import load_model, load_profile, load_workload

    model = load_model(args.model)
    if args.frozen:
        model = model.with_frozen(tuple(b.strip() for b in args.frozen.split(",") if b.strip()))
    profile = load_profile(args.profile)
    workload = load_workload(args.workload, num_microbatches=args.microbatches, seed=args.seed)
    schedule = parse_schedule(args.schedule)
    cut = parse_cut(args.cut) if args.cut is not None else default_cut(model, len(schedule))
    if len(schedule) == cut.num_regions:
        cut, schedule = normalize(cut, schedule)
    if args.pp < 1:  # before --slabs is split into P counts per region
        raise MpipeError(f"--pp is {args.pp}, but the pipeline degree P must be an integer >= 1")
    for flag, value in (("--tp", args.tp), ("--dp", args.dp)):
        if value < 1:
            raise MpipeError(f"{flag} is {value}, but parallel degrees must be integers >= 1")
    options = CostOptions(dtype=args.dtype, tp_degree=args.tp, dp_degree=args.dp, recompute=args.recompute,
                          ep_degree=args.ep, cp_degree=args.cp, shard_optimizer=args.zero == 1,
                          sequence_parallel=args.sequence_parallel, moe_imbalance=args.moe_imbalance,
                          encoder_tp_degree=args.encoder_tp)
    options.dtype_bytes()
    profile.peak(args.dtype)
    slab_counts = None
    if args.slabs:
        flat = _int_list(args.slabs, "--slabs")
        if len(flat) % args.pp:
            raise MpipeError(f"--slabs lists {len(flat)} counts, which is not a multiple of --pp {args.pp}; give P counts per Sharded region")
        slab_counts = tuple(flat[i:i + args.pp] for i in range(0, len(flat), args.pp))
    owners = None if args.owner == "round-robin" else _int_list(args.owner, "--owner")
    if owners is not None and Skeleton.TRANSPOSE not in schedule.skeletons:
        raise MpipeError(f"--owner {args.owner}: schedule <{args.schedule}> has no transpose region, so no microbatch has "
                         f"an owner; drop --owner or use a schedule with transpose")
    prediction = predict(cut, schedule, model, workload, profile, args.pp, num_microbatches=args.microbatches,
                         slab_counts=slab_counts, microbatch_owners=owners, options=options)
    return prediction, model, workload, profile, options


def default_cut(model, num_regions: int):
    """One region: no cut. Two regions: the boundary before the first backbone ('llm') layer."""
    from mpipe_tune.algebra.schedule import Cut

    if num_regions == 1:
        return Cut(())
    first_llm = next((i for i, u in enumerate(model.layers) if u.block == "llm"), None)
    if num_regions == 2 and first_llm:
        return Cut((first_llm,))
    raise MpipeError(f"a schedule of {num_regions} regions needs --cut with {num_regions - 1} boundaries "
                     f"(model '{model.name}' has {model.num_layers} layers)")


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
        prediction, model, workload, profile, options = load_candidate(args)
        if args.gantt:
            from mpipe_tune.report.gantt import draw_gantt

            t = prediction.timeline
            draw_gantt(prediction.plan, t.start_s, t.durations_s, args.gantt,
                       title=f"{model.name} <{prediction.plan.schedule}> on {profile.name}: P={prediction.plan.num_ranks} "
                             f"M={prediction.plan.num_microbatches}, step {t.makespan_s * 1e3:.4g} ms")
        record = prediction_record(prediction, model, workload, profile, options)
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
        from mpipe_tune.report.tables import derivation_record, print_derivation

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
        from mpipe_tune.specs import builtin_models, load_model

        for name in builtin_models():
            model = load_model(name)
            print(f"{name:28s} {model.num_layers:4d} layers  blocks: {', '.join(model.blocks())}")
        return 0


class Profiles(Command):
    name = "profiles"
    help = "list the built-in hardware profiles"

    def take_action(self, args):
        from mpipe_tune.specs import builtin_profiles, load_profile

        for name in builtin_profiles():
            p = load_profile(name)
            peaks = ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in sorted(p.peak_flops_per_s.items()))
            print(f"{name:20s} {p.device}: {peaks}; {p.memory_bytes_per_s / 1e9:.4g} GB/s, "
                  f"{p.memory_capacity_bytes / 2**30:.4g} GiB")
        return 0


COMMANDS: list[Command] = [Predict(), Derive(), Models(), Profiles(), Profile(), Run(), Bench(), Plan(), Show(), Export(), Trials()]


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
        return 2
    except KeyboardInterrupt:
        print(f"mpipe-tune {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
