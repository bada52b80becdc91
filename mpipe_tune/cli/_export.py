"""``mpipe-tune export``: write one plan of a plan file in another trainer's format.

The targets and what each can express are :mod:`mpipe_tune.report.exports`'; this command parses the
flags, prints single-file formats to standard output unless ``--out`` is given, and writes its files
together and atomically (all of them or none) after checking every output path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpipe_tune.cli._command import Command
from mpipe_tune.errors import MpipeError


class Export(Command):
    """The ``export`` subcommand."""

    name = "export"
    after_interrupt = "nothing written"
    help = "write a plan in torch pipelining CSV, torchtitan TOML, Megatron-LM, hyper-parallel or MindSpeed-MM form"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # the targets are report.exports'; it is imported only when the command runs, to keep startup light
        parser.add_argument("plan", help="plan.json written by 'mpipe-tune plan'")
        parser.add_argument("--to", required=True, metavar="FORMAT",
                            help="torch-csv (torch.distributed.pipelining schedule CSV), torchtitan (0.2.x TOML job "
                                 "config and its CSV), torchtitan-0.3 (its --module/--config arguments and the CSV), "
                                 "megatron (Megatron-LM arguments), hyper-parallel (trainer YAML) or mindspeed-mm "
                                 "(model.json layout and launch arguments)")
        parser.add_argument("--out", default=None,
                            help="file to write (default: standard output; torchtitan, torchtitan-0.3 and mindspeed-mm "
                                 "need it, their second file goes beside it)")
        parser.add_argument("--plan", dest="plan_name", default=None, metavar="NAME",
                            help="a plan stored in the file (megatron, vpp, mpipe-rr, ...; default: the best)")

    def take_action(self, args: argparse.Namespace) -> int:
        from mpipe_tune.report.exports import export_outputs, read_export_plan
        from mpipe_tune.outputs import validate_out_path, write_together

        if args.out:
            validate_out_path(args.out, label="--out")  # before the plan is read
        plan = read_export_plan(args.plan, args.plan_name)
        outputs = export_outputs(plan, args.to, Path(args.out) if args.out else None)
        files = [o for o in outputs if o.path is not None]
        for output in files:
            beside = str(output.path) != args.out
            if beside and output.path.is_dir():  # its name follows --out's: no path "in it" to give
                raise MpipeError(f"the file beside --out, {output.path}, is a folder; move it aside or give --out "
                                 f"another name")
            validate_out_path(output.path, label="the file beside --out" if beside else "--out")
        write_together([(o.path, lambda tmp, text=o.text: tmp.write_text(text, encoding="utf-8")) for o in files])
        for output in outputs:
            if output.path is None:
                sys.stdout.write(output.text)
            else:
                print(f"{args.to} export of {plan.describe()} written to {output.path}")
        return 0
