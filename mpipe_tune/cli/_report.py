"""``mpipe-tune report plan.json --html report.html``: a plan file as one self-contained HTML page."""

from __future__ import annotations

import argparse

from mpipe_tune.cli._command import Command


class Report(Command):
    name = "report"
    after_interrupt = "nothing written"
    help = ("a plan file as one self-contained HTML page: the comparison table, every stored plan's timeline on a "
            "shared time axis, memory per rank, the study's trials")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("plan", help="plan.json written by 'mpipe-tune plan'")
        parser.add_argument("--html", required=True, metavar="FILE", help="the page to write (.html)")
        parser.add_argument("--model", default=None, help="the plan's model file, where it moved since planning (default: the path the plan names)")
        parser.add_argument("--profile", default=None, help="the plan's profile file, where it moved since planning (default: the path the plan names)")
        parser.add_argument("--storage", default=None,
                            help="the study's Optuna RDB URL (default: the one the plan records)")

    def take_action(self, args: argparse.Namespace) -> int:
        from mpipe_tune.outputs import write_atomic
        from mpipe_tune.report import HTML_SUFFIXES, build_report, render, validate_html_path

        validate_html_path(args.html)
        from mpipe_tune.search import COLUMNS, comparison_frame, load_trials_study, trials_frame

        def study_trials(storage: str, study: str):
            return trials_frame(load_trials_study(storage, study), storage)

        report = build_report(args.plan, comparison=(COLUMNS, comparison_frame), study_trials=study_trials,
                              model_spec=args.model, profile_spec=args.profile, storage=args.storage)
        write_atomic(args.html, render(report), label="--html", suffixes=HTML_SUFFIXES)
        print(f"report of {len(report.plans)} plans written to {args.html}")
        print(report.trials_note)
        return 0
