"""The export-target interface: what one trainer's format can express, how it is written, and which
client's own code checks it.

A target is a subclass of :class:`ExportTarget` in its own module of this package, registered by one
line in ``TARGETS`` (``exports/__init__.py``). :meth:`ExportTarget.export` is the one way a plan is
exported: the output paths first (a target of several files names the file ``--out`` gives and the one
that goes beside it), then :meth:`~ExportTarget.validate` (one refusal line naming the closest plan the
target can express), then :meth:`~ExportTarget.write`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from mpipe_tune.errors import MpipeError
from mpipe_tune.report.exports._plan import ExportPlan, Output


@dataclass(frozen=True)
class TwoFiles:
    """A target written as two files: the one ``--out`` names and one beside it, named after it."""

    first: str
    """What ``--out``'s file holds (``the TOML job config``)."""
    first_short: str
    """Its name in a word, possessive (``TOML's``)."""
    beside: str
    """What the file beside it holds (``the schedule CSV it names``)."""
    beside_short: str
    """The same in a word or two (``CSV``)."""
    suffix: str | None
    """The suffix ``--out`` must end in (``.toml``); None: any other than ``beside_suffix``."""
    beside_suffix: str
    """The suffix of the file beside it (``.csv``), replacing ``--out``'s."""
    example: str
    """The file name a message offers (``job.toml``)."""

    def paths(self, target: str, out: Path | None) -> tuple[Path, Path]:
        """``--out``'s path and the one beside it, or one line saying which path to give."""
        if out is None or (self.suffix is None and out.suffix.lower() == self.beside_suffix):
            beside = Path(self.example).with_suffix(self.beside_suffix)
            raise MpipeError(f"the {target} export is two files, {self.first} and {self.beside}; give the "
                             f"{self.first_short} path as the output file, e.g. {self.example} (the "
                             f"{self.beside_short} goes beside it, as {beside})", quantities=("output file",))
        if self.suffix is not None and out.suffix.lower() != self.suffix:
            raise MpipeError(f"the {target} output file {out}, {self.first}, must end in {self.suffix} (the "
                             f"{self.beside_short} goes beside it, as {out.with_suffix(self.beside_suffix).name}); "
                             f"e.g. {out.stem or Path(self.example).stem}{self.suffix}", quantities=("output file",))
        return out, out.with_suffix(self.beside_suffix)


class ExportTarget(ABC):
    """One trainer's format. Subclasses set the class attributes and define :meth:`write`; most also
    extend :meth:`validate` with what their trainer cannot run."""

    name: ClassVar[str]
    """The ``--to`` name (``megatron``)."""
    trainer: ClassVar[str]
    """How refusal lines name the trainer (``Megatron-LM``)."""
    help: ClassVar[str]
    """One line for the format list."""
    client: ClassVar[str]
    """Whose code checks the written files, at which version, and where (a test, or a recorded check)."""
    files: ClassVar[TwoFiles | None] = None
    """Two files (``--out`` needed), or None: one text, to ``--out`` or the standard output."""

    def export(self, plan: ExportPlan, out: Path | None) -> tuple[Output, ...]:
        """The target's files of ``plan`` (a path of None: the standard output), or one refusal line."""
        paths = self.files.paths(self.name, out) if self.files else (out,)
        self.validate(plan)
        return self.write(plan, paths)

    def validate(self, plan: ExportPlan) -> None:
        """Raise one :class:`~mpipe_tune.errors.MpipeError` line, naming the closest plan the target can
        express, when it cannot express ``plan``; the default accepts every plan."""

    @abstractmethod
    def write(self, plan: ExportPlan, paths: tuple[Path | None, ...]) -> tuple[Output, ...]:
        """The files of a plan :meth:`validate` accepted, at ``paths`` (``--out``'s, then the one beside it)."""
