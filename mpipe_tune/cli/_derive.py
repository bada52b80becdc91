"""``mpipe-tune derive``: the placement, collectives and per-rank orders of one candidate."""

from __future__ import annotations

import json

from mpipe_tune.cli._arguments import add_candidate_arguments, load_candidate
from mpipe_tune.cli._command import Command


class Derive(Command):
    name = "derive"
    help = "derive placement, collectives and per-rank orders of one schedule"

    def add_arguments(self, parser):
        add_candidate_arguments(parser)

    def take_action(self, args):
        from mpipe_tune.plan_file import derivation_record
        from mpipe_tune.report import print_derivation

        prediction, *_ = load_candidate(args)
        record = derivation_record(prediction.plan)
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            print_derivation(record)
        return 0
