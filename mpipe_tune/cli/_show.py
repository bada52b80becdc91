"""``mpipe-tune show``: reload a plan file, check its inputs and re-predict it."""

from __future__ import annotations

import json

from mpipe_tune.cli._arguments import add_csv_argument, validate_csv_path
from mpipe_tune.cli._command import Command
from mpipe_tune.errors import MpipeError


class Show(Command):
    name = "show"
    after_interrupt = "nothing written"
    help = "reload a plan file, check its inputs and re-predict it"

    def add_arguments(self, parser):
        parser.add_argument("plan", help="plan.json written by 'mpipe-tune plan'")
        parser.add_argument("--model", default=None,
                            help="the plan's model file, where it moved to (default: the path the plan names)")
        parser.add_argument("--profile", default=None,
                            help="the plan's profile file, where it moved to (default: the path the plan names)")
        parser.add_argument("--gantt", default=None, help="draw the plan's timeline to this PNG")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        add_csv_argument(parser, "the plan's comparison table", "plan")

    def take_action(self, args):
        from mpipe_tune.plan_file import read_plan
        from mpipe_tune.report import repredict

        validate_csv_path(args)
        if args.gantt:
            from mpipe_tune.report import validate_picture_path

            validate_picture_path(args.gantt, label="--gantt")
        file = read_plan(args.plan)
        search = None if file.search is None else file.search.to_stored()
        if args.csv is not None and not search:
            raise MpipeError(f"--csv {args.csv}: {args.plan} holds no comparison table (no 'search' section); "
                             f"make the plan with 'mpipe-tune plan' to get one")
        shown = repredict(file, model=args.model, profile=args.profile)
        _write(shown, search, args)
        _print(shown, search, args)
        return 0


def _write(shown, search: dict | None, args) -> None:
    """The picture and the table asked for, written together: both files, or neither."""
    from mpipe_tune.outputs import write_together, to_csv_text

    outputs = []
    if args.gantt:
        from mpipe_tune.report import action_spans, draw_gantt, zero_of

        resolved, t = shown.resolved, shown.prediction.timeline
        title = (f"{resolved.model.name} <{resolved.section.candidate.schedule}> on {resolved.profile.name}: "
                 f"step {shown.now_s * 1e3:.4g} ms")
        outputs.append((args.gantt, lambda tmp: draw_gantt(shown.prediction.plan, t.start_s, t.durations_s, tmp,
                                                           title=title, zero=zero_of(shown.prediction.options),
                                                           actions=action_spans(shown.prediction.plan, t))))
    if args.csv is not None:
        from mpipe_tune.search import comparison_frame

        outputs.append((args.csv, lambda tmp: tmp.write_text(to_csv_text(comparison_frame(search)))))
    write_together(outputs)


def _print(shown, search: dict | None, args) -> None:
    from mpipe_tune.report import prediction_record, print_prediction

    resolved = shown.resolved
    out = prediction_record(shown.prediction, resolved.model, resolved.section.workload, resolved.profile)
    if args.json:
        print(json.dumps({**out, "recorded_makespan_s": shown.recorded_s, "search": search}, indent=2))
        return
    print_prediction(out)
    print(f"\nrecorded step time {shown.recorded_s * 1e3:.3f} ms; re-predicted {shown.now_s * 1e3:.3f} ms"
          + ("" if shown.unchanged else "  (differs: the cost model changed since the plan was made)"))
    if search and search["samples"] > 1:
        print(f"(the plan file's one stored step: the first of the search's {search['samples']} sampled steps; "
              f"the table below shows each plan's mean over them)")
    if search:
        from mpipe_tune.search import format_comparison

        print(f"\nsearch: study '{search['study']}', {search['trials']} trials, mean over {search['samples']} "
              f"sampled step(s) of {search['global_batch']} sequences\n")
        print(format_comparison(search))
    if args.csv is not None:
        print(f"\ntable written to {args.csv}")
    if args.gantt:
        print(f"\nGantt picture written to {args.gantt}")
