"""An error's line as the command line prints it: the flag beside each quantity the error names.

Errors below the CLI name quantities (``trial budget is 0, but at least one trial is needed``) and
list them in :attr:`~mpipe_tune.errors.MpipeError.quantities`; :data:`FLAGS` says which flag sets
each, and :func:`error_line` writes it after the quantity's first mention
(``trial budget (--trials) is 0, ...``). A flag the command does not have keeps the name of the command
it belongs to (``owner policy (plan --owners)`` in an error of ``run``).
"""

from __future__ import annotations

import re
from collections.abc import Collection

from mpipe_tune.errors import MpipeError

FLAGS = {
    # quantity, as errors name it: the flag that sets it, after the command it belongs to
    "trial budget": "plan --trials",
    "sampler": "plan --sampler",
    "tolerance": "plan --tolerance",
    "search time limit": "plan --timeout",
    "study storage": "plan --storage",
    "study name": "plan --study",
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
    "dtype": "plan --dtype",
    "model": "plan --model",
    "hardware profile": "plan --profile",
    "workload": "plan --workload",
    "tokenizer": "plan --tokenizer",
    "characters per token": "plan --chars-per-token",
    "packing length": "plan --seq-len",
    "image folder": "plan --image-folder",
    "output file": "plan --out",
    "timeline picture": "plan --gantt",
    "cut": "predict --cut",
    "owner mode": "run --owners",
    "data mode": "run --data",
    "compute mode": "run --compute",
    "step count": "run --steps",
    "round count": "bench --rounds",
    "trace file": "run --trace",
    "device kind": "run --device",
    "process count": "profile --nproc",
    "calibration model": "profile --calibrate",
    "export format": "export --to",
    "stored plan": "export --plan",
    "HTML report": "report --html",
    "distribution picture": "workload --plot",
}
"""Each quantity an error may name, and the flag that sets it, after the command it belongs to."""


def flag_of(quantity: str, command: str, options: Collection[str] = ()) -> str | None:
    """The flag that sets ``quantity`` as a user of ``command`` (whose flags are ``options``) types it:
    ``--steps`` where the command has it (``run``, ``bench``), ``run --steps`` elsewhere; None for a
    quantity no flag sets."""
    flag = FLAGS.get(quantity)
    if flag is None:
        return None
    owner, _, bare = flag.rpartition(" ")
    return bare if command == owner or bare in options else flag


def error_line(exc: MpipeError, command: str, options: Collection[str] = ()) -> str:
    """``exc``'s one line with the flag beside the first mention of each quantity it names."""
    return with_flags(str(exc), exc.quantities, command, options)


def with_flags(line: str, quantities: tuple[str, ...], command: str, options: Collection[str] = ()) -> str:
    """``line`` with the flag beside the first mention of each of ``quantities`` (a whole word: not
    ``model`` in ``model.json``); a quantity the line does not name is skipped."""
    for quantity in quantities:
        flag = flag_of(quantity, command, options)
        found = re.search(r"(?<![\w./-])" + re.escape(quantity) + r"(?![\w-]|\.\w)", line)
        if flag is not None and found is not None:
            line = f"{line[:found.end()]} ({flag}){line[found.end():]}"
    return line
