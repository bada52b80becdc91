"""The ``mpipe-tune`` command: one module per subcommand, user errors exit with one line.

Each command module holds one :class:`~mpipe_tune.cli._command.Command`: it parses its flags, calls one
domain function and prints; the flags several commands share are :mod:`._arguments`'s groups; the parser
and the run of a command are :mod:`._parser`'s. This package is the tool's only face: nothing in
``mpipe_tune`` imports it.

It imports nothing at first: :func:`main` imports the commands inside its handling of Ctrl-C, so that a
Ctrl-C from the first line of the entry point on (the imports take most of a second) exits 130 with one
line, not a traceback (the interpreter's own start-up, before this package, is Python's).
"""

from __future__ import annotations

import sys

__all__ = ["COMMANDS", "Parser", "build_parser", "main"]
"""The tool's only face: :func:`main` (the ``mpipe-tune`` script, ``python -m mpipe_tune.cli``), and the
parser its commands build (for documentation and tests)."""


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: the process's arguments); the exit code."""
    try:
        from mpipe_tune.interrupt import mark

        mark("entry")
        from mpipe_tune.cli._parser import run_command

        return run_command(argv)
    except KeyboardInterrupt:  # before a command started (while importing or parsing): nothing was done
        print("mpipe-tune: interrupted before the command started; nothing was written", file=sys.stderr)
        return 130


def __getattr__(name: str):
    """``build_parser``, ``COMMANDS`` and ``Parser``, imported when first asked for (see the module docstring)."""
    if name in ("build_parser", "COMMANDS", "Parser"):
        from mpipe_tune.cli import _parser as parser

        return getattr(parser, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
