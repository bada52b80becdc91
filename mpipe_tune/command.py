"""The base of the ``mpipe-tune`` subcommands, in a module of its own.

Each subcommand module (``cli_plan``, ``cli_run``, ``cli_profile``) subclasses :class:`Command` from
here; ``mpipe_tune.cli`` only collects them. Keeping the base out of ``cli`` means a subcommand
module never imports ``cli`` back (which, under ``python -m mpipe_tune.cli``, would run it twice).
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod


class Command(ABC):
    """One subcommand: its name and help, its arguments, and what it does (returns the exit code)."""

    name = ""
    help = ""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's arguments (none by default)."""

    @abstractmethod
    def take_action(self, args: argparse.Namespace) -> int:
        """Carry the subcommand out; return the exit code."""
