"""``mpipe-tune plan``: search for the best static plan, beside the baselines.

Everything heavy (the cost model, Optuna) is imported inside ``take_action``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpipe_tune.cli._arguments import (
    add_csv_argument, add_dataset_arguments, add_framework_arguments, dataset_options, framework_options,
    print_notes, validate_csv_path,
)
from mpipe_tune.cli._command import Command
from mpipe_tune.cli._errors import with_flags
from mpipe_tune.errors import MpipeError

EXAMPLE_DEVICES = 4


def _problem(args: argparse.Namespace):
    """The model (frozen blocks applied), profile, and the search Problem the arguments describe."""
    from mpipe_tune.inputs import MIXES
    from mpipe_tune.search import build_problem
    from mpipe_tune.cost import load_profile
    from mpipe_tune.inputs import (
        load_model, load_workload, is_dataset, load_dataset, validate_dataset_options, is_model_json,
        read_mindspeed_layout,
    )

    validate_dataset_options(args.workload, dataset_options(args))
    model = load_model(args.model)
    frozen = tuple(b.strip() for b in args.frozen.split(",") if b.strip())
    if frozen:
        model = model.with_frozen(frozen)
    elif args.current is not None and is_model_json(args.current):
        frozen_modules = read_mindspeed_layout(args.current, args.current_args).frozen_modules
        if frozen_modules:
            print(f"mpipe-tune plan: note: --current {args.current} freezes {', '.join(frozen_modules)}, and --frozen is "
                  f"not given, so the plan and every row train all of model '{model.name}'; give --frozen with its "
                  f"blocks to freeze ({', '.join(model.blocks())}) to plan the run as it trains", file=sys.stderr)
    profile = load_profile(args.profile)
    options = framework_options(args, dtype=args.dtype)
    options.validate_degrees()
    options.dtype_bytes()
    note = profile.slow_dtype_note(args.dtype)
    if note:
        print(f"mpipe-tune plan: note: {note}", file=sys.stderr)
    dataset = mix = workload = None
    if is_dataset(args.workload):
        dataset, notes = load_dataset(args.workload, args.model, model, dataset_options(args))
        print_notes("plan", notes)
    elif args.workload in MIXES:
        mix = args.workload
    else:
        workload = load_workload(args.workload)
    problem = build_problem(model, profile, args.devices, workload=workload, mix=mix, dataset=dataset,
                            global_batch=args.global_batch, samples=args.samples, seed=args.seed, options=options)
    return problem, frozen


def _space_request(args: argparse.Namespace):
    """The space flags as given (None where a widenable knob was not given)."""
    from mpipe_tune.search import SpaceRequest

    return SpaceRequest(skeletons=args.skeletons, max_chunks=args.max_chunks, cut_window=args.cut_window,
                        interior_transpose=args.interior_transpose, owners=args.owners,
                        max_microbatches=args.max_microbatches, encoder_backward=args.encoder_backward,
                        encoder_tp=args.encoder_tp, cp=args.cp, pp=args.pp, tp=args.tp, dp=args.dp,
                        recompute=args.recompute, ep=args.ep, zero=args.zero, sequence_parallel=args.sequence_parallel)


def _interrupted() -> int:
    """Exit status 130 after a Ctrl-C that stopped the search. A further Ctrl-C while the interpreter exits
    (the plan is written, the trial writer done) changes nothing: it is ignored from then on, rather than
    killing the interpreter on its way out (in-process callers keep their handler until they exit)."""
    import atexit
    import signal

    atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)  # runs first: before multiprocessing's joins
    return 130


def _validate_outputs(args: argparse.Namespace) -> None:
    """Every file ``plan`` writes, checked before the search (one line naming the flag), and distinct."""
    from mpipe_tune.outputs import validate_out_path
    from mpipe_tune.report import validate_picture_path

    validate_out_path(args.out, label="--out", suffixes=(".json",))
    paths = {"--out": args.out, "--csv": args.csv}
    for flag, path in (("--gantt", args.gantt), ("--gantt-baseline", args.gantt_baseline)):
        if path is not None:
            validate_picture_path(path, label=flag)
            paths[flag] = path
    seen: dict = {}
    for flag, path in paths.items():
        if path is None:
            continue
        other = seen.setdefault(Path(path).resolve(), flag)
        if other != flag:
            raise MpipeError(f"{flag} {path}: {other} names the same file; give each output a path of its own")


class Plan(Command):
    name = "plan"
    help = "search for the fastest static plan that fits memory and compare it with the baselines"
    after_interrupt = "the study keeps every finished trial: rerun the same command to continue it"

    def add_arguments(self, parser):
        g = parser.add_argument_group("problem")
        g.add_argument("--model", default="example-mllm",
                       help="built-in model name, YAML file, or Hugging Face config.json or its folder (default: example-mllm)")
        g.add_argument("--profile", default="ideal", help="built-in hardware profile or JSON file (default: ideal)")
        g.add_argument("--workload", default="balanced",
                       help="built-in mix name or a dataset (LLaVA/ShareGPT JSON/JSONL, CSV/Parquet/JSONL manifest), "
                            "sampled per step; or a workload file holding one step's sequences (default: balanced)")
        add_dataset_arguments(g)
        g.add_argument("--devices", type=int, default=EXAMPLE_DEVICES, help=f"device count (default {EXAMPLE_DEVICES})")
        g.add_argument("--global-batch", type=int, default=None,
                       help="sequences per step over all replicas, fixed for every plan (omit it for the default: "
                            "4 x devices, or the file's length)")
        g.add_argument("--samples", type=int, default=4, help="sampled steps the objective averages over (default 4)")
        g.add_argument("--seed", type=int, default=0, help="seed of the sampled steps and of the sampler (default 0)")
        g.add_argument("--frozen", default="", help="comma-separated blocks to freeze, e.g. encoder (default: none, every block trains)")
        g.add_argument("--dtype", default="bf16", help="compute dtype (default bf16)")
        g.add_argument("--recompute", default=None, choices=("off", "none", "on", "full", "selective", "search", "all"),
                       help="activation recomputation: off (default; or none), on (full recomputation; or full), selective (the "
                            "attention core), search (off and on) or all (off, selective and on)")
        add_framework_arguments(g)
        g.add_argument("--current", default=None, metavar="LAYOUT",
                       help="the layout you run today, shown as a row beside the best plan, e.g. "
                            "'pp=8,tp=1,dp=1,schedule=1f1b,M=16,recompute=on' (keys pp, tp, dp, schedule, M, recompute, "
                            "cut, owners; without cut, 1f1b is the Megatron-style layout), or a MindSpeed-MM "
                            "model.json (its pipeline_num_layers)")
        g.add_argument("--current-args", default=None, metavar="ARGS",
                       help="with a --current model.json: the MindSpeed-MM run's launch script, or its flags in "
                            "quotes ('--tensor-model-parallel-size 2 --micro-batch-size 1 ...')")
        s = parser.add_argument_group("search space")
        s.add_argument("--pp", default=None, help="allowed pipeline degrees, e.g. 4,8 (default: any)")
        s.add_argument("--tp", default=None, help="allowed tensor-parallel degrees (default: divisors of a node)")
        s.add_argument("--dp", default=None, help="allowed data-parallel degrees (default: any)")
        s.add_argument("--ep", default=None,
                       help="allowed expert-parallel degrees, e.g. 1,8, or 'search': every degree that divides dp "
                            "and the MoE layers' experts (default: search for a MoE model, else 1)")
        s.add_argument("--cp", default="1", help="allowed context-parallel degrees, e.g. 1,2 (default 1)")
        s.add_argument("--zero", default=None, choices=("0", "1", "2", "3", "3-reshard", "3-keep", "search", "all"),
                       help="ZeRO stage: 1 (default, optimizer state sharded over the data-parallel ranks), 2 (gradients "
                            "too), 3 (weights too, FSDP, both reshard policies searched: 3-reshard gathers them for every "
                            "forward and backward, 3-keep once a step), 0, search (0 and 1) or all (0 to 3, both "
                            "policies)")
        s.add_argument("--sequence-parallel", default=None, choices=("off", "on", "search"),
                       help="sequence parallelism with tp > 1: off (default), on, or search")
        s.add_argument("--encoder-tp", default="off", choices=("off", "search"),
                       help="the encoder's own tensor-parallel degree: off (default: the plan's tp) or search over "
                            "the divisors of tp (where tp > 1)")
        s.add_argument("--skeletons", default="1f1b,gpipe",
                       help="Sharded skeletons to use, of 1f1b, gpipe, zb1p, zbv (default 1f1b,gpipe)")
        s.add_argument("--max-chunks", type=int, default=2, help="most interleaved Sharded regions per rank (default 2)")
        s.add_argument("--cut-window", type=int, default=1,
                       help="layers either side of the encoder/backbone seam a transpose cut may move (default 1)")
        s.add_argument("--interior-transpose", action="store_true",
                       help="also search schedules that transpose the projector between a Sharded encoder and a "
                            "Sharded backbone (1f1b,transpose,1f1b and the like; off by default)")
        s.add_argument("--owners", default="round-robin,greedy,optimal",
                       help="owner policies to search, of round-robin, greedy, optimal (default: all three)")
        s.add_argument("--encoder-backward", default="cooldown", choices=("cooldown", "earliest", "optimised", "search"),
                       help="where ranks run the trainable transposed encoder's backwards: cooldown (default), "
                            "earliest, optimised, or search (try all three)")
        s.add_argument("--max-microbatches", type=int, default=64, help="largest microbatch count (default 64)")
        d = parser.add_argument_group("search")
        d.add_argument("--trials", type=int, default=None,
                       help="finished trials the study should hold; a rerun continues up to it (default: 5%% of the "
                            "space's points, from 2000 to 5000, for the bound search, which stops earlier once --tolerance "
                            "is met; 100 for a sampler)")
        d.add_argument("--timeout", type=float, default=None,
                       help="stop searching after this many seconds (default: no limit)")
        d.add_argument("--tolerance", type=float, default=0.01,
                       help="bound search: stop once no plan left can beat the best by more than this share of its "
                            "step time (default 0.01: within 1%%)")
        d.add_argument("--storage", default=None, help="Optuna RDB URL (default sqlite:///mpipe-tune.db in this folder)")
        d.add_argument("--study", default=None, help="study name (default: derived from the problem)")
        d.add_argument("--sampler", default="bound",
                       help="bound (default: every plan's step-time lower bound, then plans in increasing bound order "
                            "until --tolerance), or a sampler: tpe, nsga2 or random")
        d.add_argument("--exhaustive", action="store_true", help="evaluate every point of the space")
        d.add_argument("--no-progress", action="store_true", help="no progress bar")
        o = parser.add_argument_group("output")
        o.add_argument("--out", default="plan.json", help="plan file to write (default plan.json)")
        o.add_argument("--gantt", default=None, help="draw the best plan's timeline to this PNG")
        o.add_argument("--gantt-baseline", default=None, help="draw the Megatron-style baseline's timeline to this PNG")
        o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
        add_csv_argument(o, "the comparison table", "plan")

    def take_action(self, args):
        from mpipe_tune.outputs import to_csv_text, write_together
        from mpipe_tune.plan_file import PlanInputs, dump_plan
        from mpipe_tune.report import draw_prediction  # matplotlib: only when a picture is asked for
        from mpipe_tune.search import (
            outcome_record, DEFAULT_STORAGE, REFERENCE, comparison_frame, KNOBS, SearchOptions, plan,
        )
        from mpipe_tune.inputs import resolve_spec

        validate_csv_path(args)
        _validate_outputs(args)
        if args.timeout is not None and not args.timeout > 0:
            raise MpipeError(f"search time limit is {args.timeout} s, but it must be a positive number of seconds, "
                             f"e.g. 60", quantities=("search time limit",))
        if args.current_args is not None and args.current is None:
            raise MpipeError("--current-args gives the launch arguments of a --current MindSpeed-MM model.json; give "
                             "--current model.json with it")
        problem, frozen = _problem(args)
        storage = args.storage or DEFAULT_STORAGE
        search = SearchOptions(trials=args.trials, timeout_s=args.timeout, storage=storage, study=args.study,
                               seed=args.seed, sampler=args.sampler, exhaustive=args.exhaustive, tolerance=args.tolerance,
                               progress=not args.no_progress, current=args.current,
                               current_args=args.current_args)
        outcome = plan(problem, _space_request(args), search)
        if args.interior_transpose and not any(outcome.space.interior(s) for s in outcome.space.family):
            print(f"mpipe-tune plan: note: model '{problem.model.name}' has no projector layers between its encoder "
                  f"and its backbone, so --interior-transpose adds no schedule", file=sys.stderr)
        result, best, evaluator = outcome.result, outcome.best, outcome.evaluator
        if outcome.widened_line and best is not None:
            print(f"mpipe-tune plan: {with_flags(outcome.widened_line, tuple(KNOBS.values()), 'plan')}", file=sys.stderr)
        if best is None:
            if result.interrupted:
                print(f"interrupted after {result.num_trials} trials, before any plan that fits was found; rerun the "
                      f"same command to continue the study", file=sys.stderr)
                return _interrupted()
            if outcome.least_memory is None:
                raise MpipeError(f"no trial finished within --timeout {args.timeout} s; raise --timeout")
            raise outcome.no_fit_error()
        reference = dict(outcome.baselines).get(REFERENCE)
        if args.gantt_baseline and reference is None:
            raise MpipeError(f"--gantt-baseline: the {REFERENCE} baseline does not exist at {best.candidate.degrees}; "
                             f"nothing was written")
        record = outcome_record(outcome, PlanInputs(resolve_spec(args.model, "model"), frozen,
                                                    resolve_spec(args.profile, "profile")))
        summary = record["search"]
        outputs = [(args.out, lambda tmp: dump_plan(record, tmp))]  # all of them, or none (a picture can fail)
        if args.csv is not None:
            outputs.append((args.csv, lambda tmp: tmp.write_text(to_csv_text(comparison_frame(summary)))))
        if args.gantt:
            outputs.append((args.gantt, lambda tmp: draw_prediction(evaluator.prediction(best.candidate)[0], tmp,
                                                                    f"best <{best.candidate.schedule}>")))
        if args.gantt_baseline:
            outputs.append((args.gantt_baseline, lambda tmp: draw_prediction(
                evaluator.prediction(reference.candidate)[0], tmp, "Megatron-style <1f1b>")))
        write_together(outputs)  # its first step is the last safe point for Ctrl-C; says what it wrote after one
        if args.json:
            print(json.dumps({**summary, "plan_file": args.out}, indent=2))
        else:
            _print(outcome, summary, storage, args)
        if result.interrupted:
            print(f"interrupted after {result.num_trials} trials; rerun the same command to continue the study",
                  file=sys.stderr)
            return _interrupted()
        return 0


def _print(outcome, summary: dict, storage: str, args: argparse.Namespace) -> None:
    """The problem, the study, the comparison table and where the files went."""
    from mpipe_tune.search import format_comparison

    p, result, best = outcome.problem, outcome.result, outcome.best
    print(f"planning {p.model.name} on {p.devices} x {p.profile.name}, workload {p.source_name}: "
          f"{p.global_batch} sequences per step, mean over {p.samples} sampled step(s)")
    repeats = result.num_new - result.num_evaluated - result.num_bounded
    print(f"study '{result.study_name}' in {storage}: {result.num_trials} trials in {result.wall_s:.1f} s "
          f"({result.how(args.sampler)}; this run: {result.num_evaluated} plans predicted, {result.num_bounded} "
          f"settled by their lower bound" + (f", {repeats} repeats" if repeats > 0 else "") + ")\n")
    print(format_comparison(summary))
    print(f"\nbest: {best.candidate}" + ("" if outcome.best_from == "search" else
                                         f"  (the {outcome.best_from} row: faster than the search's own best)"))
    print(f"plan written to {args.out}" + (f", table to {args.csv}" if args.csv else "")
          + (f", timeline to {args.gantt}" if args.gantt else "")
          + (f", baseline timeline to {args.gantt_baseline}" if args.gantt_baseline else ""))
