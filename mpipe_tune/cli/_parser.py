"""The ``mpipe-tune`` parser and the run of one command (what :func:`mpipe_tune.cli.main` imports and calls,
so that a Ctrl-C during these imports is handled there).

An error ends a command with its class's exit code (:mod:`mpipe_tune.errors`: 2 for bad input, a plan that does
not fit, a damaged or stale plan file; 1 for a failed run; 130 after Ctrl-C), in one line of at most
:data:`MAX_ERROR_CHARS` characters.
"""

from __future__ import annotations

import argparse
import re
import sys

from mpipe_tune import __version__
from mpipe_tune.cli._bench import Bench
from mpipe_tune.cli._command import Command
from mpipe_tune.cli._derive import Derive
from mpipe_tune.cli._errors import error_line
from mpipe_tune.cli._export import Export
from mpipe_tune.cli._models import Models
from mpipe_tune.cli._plan import Plan
from mpipe_tune.cli._predict import Predict
from mpipe_tune.cli._profile import Profile
from mpipe_tune.cli._profiles import Profiles
from mpipe_tune.cli._report import Report
from mpipe_tune.cli._run import Run
from mpipe_tune.cli._show import Show
from mpipe_tune.cli._trials import Trials
from mpipe_tune.cli._workload import Workload
from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import command_interrupts, mark

mark("imports")  # the commands' modules are imported above: a test's Ctrl-C lands among the imports

COMMANDS: list[Command] = [Plan(), Show(), Trials(), Run(), Bench(), Export(), Predict(), Derive(), Profile(), Report(),
                           Workload(), Models(), Profiles()]
"""In the order of README.md's command table, which ``mpipe-tune --help`` lists them in: the plan's chain first."""
MAX_ERROR_CHARS = 399
"""The longest error line printed (under 400 characters: room for a message with two full paths): messages show a
long list's first items and its count; a line that still runs longer gives up its middle (:func:`_cut`)."""


class Parser(argparse.ArgumentParser):
    """argparse whose own errors (an unknown flag or choice, a missing one) are one line, as the domain's:
    what is wrong and where to read on, exit code 2."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> Parser:
    parser = Parser(prog="mpipe-tune", description="Plan, predict and run pipeline-parallel MLLM training.")
    parser.add_argument("--version", action="version", version=f"mpipe-tune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.commands = {}
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(handler=command, cli_flags=frozenset(p._option_string_actions))
        parser.commands[command.name] = p
    return parser


def run_command(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run its command: its exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command they were given to
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    stop = None
    try:
        with command_interrupts(args.command) as stop:
            code = args.handler.take_action(args)
        if stop.requested and not stop.consumed and code != 130:  # after the command's last safe point (130: it said so)
            print(f"mpipe-tune {args.command}: interrupted too late to stop: the command finished"
                  + "".join(f"; {kept}" for kept in stop.kept), file=sys.stderr)
            return 130
        return code
    except MpipeError as exc:
        print(_cut(f"mpipe-tune {args.command}: error: {error_line(exc, args.command, args.cli_flags)}"),
              file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        said = "; ".join(stop.kept) if stop is not None and stop.kept else args.handler.after_interrupt
        print(f"mpipe-tune {args.command}: interrupted" + (f"; {said}" if said else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0



def _cut(line: str) -> str:
    """``line`` within :data:`MAX_ERROR_CHARS` characters, one line (a newline in a quoted value is shown escaped).

    A message says what is wrong first and how to fix it last, after its last ``"; "``: a line over the cap keeps
    that fix (up to half the cap, from a word) and as much of its start as fits, cut at a space, and gives up the
    middle between them (`` ... ``)."""
    line = line.replace("\n", "\\n")
    if len(line) <= MAX_ERROR_CHARS:
        return line
    gap = " ... "
    budget = MAX_ERROR_CHARS - len(gap)
    fix = line.rfind("; ")
    tail_start = len(line) if fix < 0 else max(fix + 2, len(line) - budget // 2)
    if fix >= 0 and tail_start > fix + 2:  # a long fix: its end, from a word
        space = line.find(" ", tail_start, tail_start + 20)
        tail_start = space + 1 if space >= 0 else tail_start
    head = budget - (len(line) - tail_start)
    space = line.rfind(" ", head // 2, head)
    return line[:space if space > 0 else head] + gap + line[tail_start:]
