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
    after_interrupt = ""
    """What a Ctrl-C that stopped the command at once left behind and how to go on (printed after
    "interrupted"; empty: nothing to add)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's arguments (none by default)."""

    @abstractmethod
    def take_action(self, args: argparse.Namespace) -> int:
        """Carry the subcommand out; return the exit code."""


def add_framework_arguments(parser) -> None:
    """The flags of how the trainer runs, shared by ``predict`` and ``plan`` (a parser or a group):
    see :class:`mpipe_tune.cost.framework.Framework`."""
    parser.add_argument("--moe-imbalance", type=float, default=1.0,
                        help="routed tokens on the busiest expert-parallel rank over the mean (default 1: balanced)")
    from mpipe_tune.algebra.candidate import GRAD_REDUCE_DTYPES

    parser.add_argument("--grad-reduce-dtype", default="fp32", choices=GRAD_REDUCE_DTYPES,
                        help="dtype of the data-parallel gradient reduce: fp32 (default, Megatron-LM's) or bf16 "
                             "(NeMo's grad_sync_dtype=bf16)")
    parser.add_argument("--dp-overlap", default="on", choices=("on", "off"),
                        help="data-parallel reduce (and ZeRO-1 all-gather) overlapped with the backward (forward) "
                             "in buckets: on (default, as Megatron-LM and torchtitan run it) or off (after the "
                             "last backward)")


def framework_options(args: argparse.Namespace, **fields):
    """The cost options those flags give (plus ``fields``: the dtype), through
    :meth:`mpipe_tune.cost.framework.Framework.from_inputs`."""
    from mpipe_tune.cost.framework import Framework

    framework = Framework.from_inputs({"moe_imbalance": args.moe_imbalance, "grad_reduce_dtype": args.grad_reduce_dtype,
                                       "overlap_dp_comm": args.dp_overlap == "on"})
    return framework.cost_options(**fields)
