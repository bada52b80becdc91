"""``mpipe-tune predict``: the step time of one candidate (makespan, bubbles, spill, memory)."""

from __future__ import annotations

import json

from mpipe_tune.cli._arguments import add_candidate_arguments, load_candidate
from mpipe_tune.cli._command import Command


class Predict(Command):
    name = "predict"
    after_interrupt = "nothing written"
    help = "predict the step time of one schedule (makespan, bubbles, spill, memory)"

    def add_arguments(self, parser):
        add_candidate_arguments(parser)
        parser.add_argument("--gantt", default=None, help="write the per-rank timeline picture to this PNG")

    def take_action(self, args):
        from mpipe_tune.report import prediction_record, print_prediction

        if args.gantt:  # before any work
            from mpipe_tune.report import validate_picture_path

            validate_picture_path(args.gantt, label="--gantt")
        prediction, model, workload, profile = load_candidate(args)
        if args.gantt:
            from mpipe_tune.report import action_spans, draw_gantt, zero_of

            t = prediction.timeline
            draw_gantt(prediction.plan, t.start_s, t.durations_s, args.gantt,
                       title=f"{model.name} <{prediction.plan.schedule}> on {profile.name}: P={prediction.plan.num_ranks} "
                             f"M={prediction.plan.num_microbatches}, step {t.makespan_s * 1e3:.4g} ms",
                       zero=zero_of(prediction.options), actions=action_spans(prediction.plan, t))
        record = prediction_record(prediction, model, workload, profile)
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            print_prediction(record)
            if args.gantt:
                print(f"\nGantt picture written to {args.gantt}")
        return 0
