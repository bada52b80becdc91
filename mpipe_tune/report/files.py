"""Output files written atomically: a crash leaves the old file or the new one, never half of one.

Every file the tool writes for a user (plan.json, exports) goes through :func:`write_atomic`: the
folder is checked first, the text goes to a temporary file beside the target, which then replaces
it in one rename.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mpipe_tune.errors import MpipeError


def validate_out_path(path: str | os.PathLike, *, label: str = "--out") -> Path:
    """``path`` as a Path whose folder exists; ``label`` names the option in the error."""
    path = Path(path)
    if not path.parent.exists():
        raise MpipeError(f"{label} {path}: folder {path.parent} does not exist; create it or pick another path")
    return path


def write_atomic(path: str | os.PathLike, text: str, *, label: str = "--out") -> None:
    """Write ``text`` to ``path`` atomically (mode 0644), after checking its folder exists."""
    path = validate_out_path(path, label=label)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
