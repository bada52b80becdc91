"""An error's line as the command line prints it: the flag beside each quantity the error names.

Errors below the CLI name quantities (``trial budget is 0, but at least one trial is needed``) and
list them in :attr:`~mpipe_tune.errors.MpipeError.quantities`; :data:`FLAGS` says which flag sets
each, and :func:`error_line` writes it after the quantity's first mention
(``trial budget (--trials) is 0, ...``). A flag of another command keeps the command's name
(``owner policy (plan --owners)`` in an error of ``run``).
"""

from __future__ import annotations

import re

from mpipe_tune.errors import MpipeError

FLAGS = {
    # quantity, as errors name it: the flag that sets it ("COMMAND --flag" when one command has it)
    "trial budget": "plan --trials",
    "sampler": "plan --sampler",
    "tolerance": "plan --tolerance",
    "study storage": "--storage",
    "study name": "--study",
    "owner policies": "plan --owners",
    "owner policy": "plan --owners",
    "skeletons": "plan --skeletons",
    "microbatch count bound": "plan --max-microbatches",
    "chunk bound": "plan --max-chunks",
    "pipeline-parallel degrees": "plan --pp",
    "tensor-parallel degrees": "plan --tp",
    "data-parallel degrees": "plan --dp",
    "expert-parallel degrees": "plan --ep",
    "context-parallel degrees": "plan --cp",
    "context-parallel degree": "plan --cp",
    "expert-parallel degree": "plan --ep",
    "sequence parallelism": "plan --sequence-parallel",
    "encoder tensor parallelism": "plan --encoder-tp",
    "encoder-backward placement": "plan --encoder-backward",
    "recomputation": "plan --recompute",
    "ZeRO stage": "plan --zero",
    "global batch": "plan --global-batch",
    "owner mode": "run --owners",
    "data mode": "run --data",
    "compute mode": "--compute",
    "step count": "run --steps",
    "device kind": "--device",
    "process count": "profile --nproc",
    "dtype": "--dtype",
    "workload": "--workload",
    "tokenizer": "--tokenizer",
    "characters per token": "--chars-per-token",
    "image folder": "--image-folder",
    "model": "--model",
    "hardware profile": "--profile",
    "cut": "--cut",
    "output file": "--out",
    "trace file": "run --trace",
    "timeline picture": "--gantt",
    "export format": "export --to",
    "stored plan": "--plan",
    "HTML report": "report --html",
    "distribution picture": "workload --plot",
}
"""Each quantity an error may name, and the flag that sets it."""


def flag_of(quantity: str, command: str) -> str | None:
    """The flag that sets ``quantity``, as a user of ``command`` types it: ``--trials`` in ``plan``,
    ``plan --trials`` elsewhere; None for a quantity no flag sets."""
    flag = FLAGS.get(quantity)
    if flag is None:
        return None
    owner, _, bare = flag.rpartition(" ")
    return bare if owner in ("", command) else flag


def error_line(exc: MpipeError, command: str) -> str:
    """``exc``'s one line with the flag beside the first mention of each quantity it names."""
    return with_flags(str(exc), exc.quantities, command)


def with_flags(line: str, quantities: tuple[str, ...], command: str) -> str:
    """``line`` with the flag beside the first mention of each of ``quantities`` (a whole word: not
    ``model`` in ``model.json``); a quantity the line does not name is skipped."""
    for quantity in quantities:
        flag = flag_of(quantity, command)
        found = re.search(r"(?<![\w./-])" + re.escape(quantity) + r"(?![\w-]|\.\w)", line)
        if flag is not None and found is not None:
            line = f"{line[:found.end()]} ({flag}){line[found.end():]}"
    return line
