"""Output files checked before any work and written atomically, all of a command's files or none.

Every file the tool writes for a user (plan.json, pictures, traces, exports, profiles) is first
checked with :func:`validate_out_path` (its folder exists and takes a new file, it is not a folder
itself, it has the suffix its format needs), before the command does its work; then written with
:func:`write_together` (or :func:`write_atomic` for one file): each file's content goes to a
temporary file beside its target, and only once every one of them is complete are they renamed into
place. A crash or an error leaves the old files or the new ones, never half of one, and never some
of a command's outputs without the others.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from mpipe_tune.errors import MpipeError
from mpipe_tune.interrupt import held, keep, mark, phase

Writer = Callable[[Path], None]
"""Writes one output's content to the (temporary) path it is given."""
_writing = 0
"""Calls of :func:`write_together` under way (a writer that writes atomically itself nests one)."""


def _staging_file(path: Path) -> str:
    """A new empty temporary file beside ``path`` (the name :func:`write_together` stages it under)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:64]}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    return tmp


def validate_out_path(path: str | os.PathLike, *, label: str = "output file",
                      suffixes: Sequence[str] | None = None) -> Path:
    """``path`` as a Path a file can be written to, checked before any work; ``label`` names it in the
    error (the quantity: ``output file``, ``trace file``), ``suffixes`` (lower case, with the dot) are the
    endings its format allows (None: any).

    The folder must exist and take a new file (a scratch file is created there and removed), and the
    path must not be a folder itself."""
    path = Path(path)

    def bad(what: str) -> MpipeError:
        return MpipeError(f"{label} {path}{what}", quantities=(label,))

    if path.is_dir():
        raise bad(f" is a folder; give a file path in it, e.g. {path / ('NAME' + (suffixes or ('',))[0])}")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise bad(f": the file name must end in {' or '.join(suffixes)}, e.g. {path.stem or 'NAME'}{suffixes[0]}")
    folder = path.parent
    if not folder.is_dir():
        if folder.exists():
            raise bad(f": {folder} is a file, not a folder; pick another path")
        raise bad(f": folder {folder} does not exist; create it or pick another path")
    try:
        os.unlink(_staging_file(path))
    except OSError as exc:
        raise bad(f": cannot write in {folder} ({exc.strerror or exc}); pick a writable path") from None
    return path


def write_together(outputs: Sequence[tuple[str | os.PathLike, Writer]]) -> None:
    """Write every ``(path, writer)`` or none: each ``writer`` writes its file to a temporary file
    beside ``path``; once all of them have, the temporary files replace their targets (mode 0644).
    The paths should have passed :func:`validate_out_path` before the command's work.

    Ctrl-C (:mod:`mpipe_tune.interrupt`): writing is a command's last safe point (``phase("writing")``),
    where a pending Ctrl-C stops it with nothing written; one that comes while the files are written lets
    them be written whole (a second stops at once, with nothing renamed, or after every rename)."""
    global _writing
    outermost = not _writing  # a writer may itself write atomically (dump_plan to the staged file)
    if outermost:
        phase("writing")
    staged: list[tuple[str, Path]] = []
    _writing += 1
    try:
        for path, write in outputs:
            path = Path(path)
            try:
                tmp = _staging_file(path)
            except OSError as exc:
                raise MpipeError(f"cannot write {path} ({exc.strerror or exc}); nothing was written") from None
            staged.append((tmp, path))
            if outermost:
                mark("write")
            try:
                write(Path(tmp))
            except OSError as exc:
                raise MpipeError(f"cannot write {path} ({exc.strerror or exc}); nothing was written") from None
            os.chmod(tmp, 0o644)
        with held():  # renamed all, even under Ctrl-C: never some of the files new and some old
            for tmp, path in staged:
                os.replace(tmp, path)
            if staged and outermost:
                keep(f"{', '.join(str(path) for _, path in staged)} written")
    finally:
        _writing -= 1
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_atomic(path: str | os.PathLike, text: str, *, label: str = "output file",
                 suffixes: Sequence[str] | None = None) -> None:
    """Write ``text`` to ``path`` atomically (mode 0644), after :func:`validate_out_path`."""
    path = validate_out_path(path, label=label, suffixes=suffixes)
    write_together([(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))])
