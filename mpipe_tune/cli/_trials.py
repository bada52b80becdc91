"""``mpipe-tune trials``: a study's trials, each with its candidate and predicted figures.

The table is :mod:`mpipe_tune.search._trials`'s (Optuna is imported there, not here): ``--csv FILE``
writes every trial, one row per trial in seconds and bytes, atomically after checking the folder;
without it the fastest trials are printed with a summary line.
"""

from __future__ import annotations

import argparse

from mpipe_tune.cli._arguments import add_csv_argument, validate_csv_path
from mpipe_tune.cli._command import Command
from mpipe_tune.errors import MpipeError

DEFAULT_ROWS = 10


class Trials(Command):
    """The ``trials`` subcommand."""

    name = "trials"
    after_interrupt = "nothing written"
    help = "list or export a plan study's trials: each candidate and its predicted step time and memory"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--storage", default=None,
                            help="the Optuna RDB URL 'mpipe-tune plan' used (default sqlite:///mpipe-tune.db in this folder)")
        parser.add_argument("--study", default=None, help="study name (default: the storage's only study)")
        add_csv_argument(parser, "every trial", "trial")
        parser.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                            help=f"trials to print, fastest first (default {DEFAULT_ROWS}; ignored with --csv)")

    def take_action(self, args: argparse.Namespace) -> int:
        from mpipe_tune.outputs import to_csv_text, write_atomic
        from mpipe_tune.search import DEFAULT_STORAGE, format_trials, load_trials_study, summary_line, trials_frame

        if args.rows < 1:
            raise MpipeError(f"row count (--rows) is {args.rows}, but it must be an integer >= 1")
        validate_csv_path(args)
        storage = args.storage or DEFAULT_STORAGE
        study = load_trials_study(storage, args.study)
        frame = trials_frame(study, storage)
        print(summary_line(frame, storage, study.study_name))
        if args.csv is not None:
            write_atomic(args.csv, to_csv_text(frame), label="--csv", suffixes=(".csv",))
            print(f"{len(frame)} trials written to {args.csv}")
        elif len(frame):
            print(f"\n{min(args.rows, len(frame))} fastest, predicted trials first (--csv FILE for all of them):\n")
            print(format_trials(frame, args.rows))
        return 0
