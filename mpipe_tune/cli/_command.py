"""The base of the ``mpipe-tune`` subcommands: each command module of :mod:`mpipe_tune.cli` subclasses
:class:`Command`, and the package's ``__init__`` collects them."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod


class Command(ABC):
    """One subcommand: its name and help, its arguments, and what it does (returns the exit code)."""

    name = ""
    help = ""
    after_interrupt = ""
    """What a Ctrl-C that stopped the command at once left behind and how to go on (printed after
    "interrupted"; empty: nothing to add)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's arguments (none by default)."""

    @abstractmethod
    def take_action(self, args: argparse.Namespace) -> int:
        """Carry the subcommand out; return the exit code."""


MODEL_HELP = "built-in model name, YAML file, or Hugging Face config.json or its folder"
"""What ``--model`` takes, in every command's help."""
