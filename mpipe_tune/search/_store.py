"""The study's storage under faults: one line naming the file and the fix, never a traceback.

A plan study lives in an Optuna RDB storage, usually an SQLite file. What can go wrong with it, and
what the user is told (each an :class:`~mpipe_tune.errors.MpipeError`, exit code 2):

- **another tool's database** (an SQLite file without Optuna's tables): refused before Optuna opens
  it, since Optuna would add its tables to it;
- **damaged** (not an SQLite file, or a malformed one): move it aside, or recover its rows;
- **locked** (another process holds a write transaction longer than SQLite's busy timeout): let it
  finish, then rerun the same command;
- **read-only** (the file or its folder): make it writable or copy it;
- **full** (its disk, or an SQLite page limit): free space, then rerun;
- **written by another Optuna version**: upgrade it with Optuna's own command.

Finished trials are never lost to a fault: each is committed in its own SQLite transaction, which a
fault rolls back whole, so the file keeps every trial committed before it, and rerunning the same
command continues the study from them. The messages say how many the file holds when it can be read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from mpipe_tune.errors import MpipeError

SQLITE_PREFIX = "sqlite:///"
OPTUNA_TABLES = frozenset({"studies", "trials"})
"""Tables every Optuna RDB storage has; an SQLite file with tables but without these is another tool's."""
_READ_TIMEOUT_S = 1.0
"""How long a read of the file for a message waits for a lock (the message goes without the count)."""


def sqlite_path(url: str | None) -> Path | None:
    """The file an ``sqlite:///`` URL names (None for another RDB, an in-memory database or no URL)."""
    if url is None or not url.startswith(SQLITE_PREFIX):
        return None
    name = url[len(SQLITE_PREFIX):].split("?")[0]
    if name.startswith("file:"):  # an SQLite URI, sqlite:///file:path?mode=ro&uri=true
        name = name[len("file:"):]
    return None if name in ("", ":memory:") else Path(name)


def check_file(url: str | None, *, write: bool = True) -> None:
    """Refuse, in one line, an SQLite file that is not a usable study storage: another tool's database,
    a damaged file, a folder, and (``write``) one this process may not write. A file that does not
    exist passes (the plan creates it)."""
    path = sqlite_path(url)
    if path is None or not path.exists():
        return
    if path.is_dir():
        raise MpipeError(f"study storage {path} is a folder; give a file, e.g. sqlite:///{path / 'mpipe-tune.db'}",
                         quantities=("study storage",))
    tables = _tables(path)
    if tables and not OPTUNA_TABLES <= tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise MpipeError(f"study storage {path} is another tool's SQLite database (tables {shown}), not an Optuna "
                         f"study storage; nothing was written to it: give a study storage file of its own, e.g. "
                         f"sqlite:///mpipe-tune.db", quantities=("study storage",))
    if write and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        what = "the file" if not os.access(path, os.W_OK) else f"its folder {path.parent}"
        raise MpipeError(f"study storage {path} is read-only ({what} cannot be written); make it writable (chmod u+w) "
                         f"or copy it to a writable folder and use the copy", quantities=("study storage",))


def _tables(path: Path) -> frozenset[str]:
    """The table names of the SQLite file at ``path``, read without writing it."""
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                                timeout=_READ_TIMEOUT_S)) as db:
            return frozenset(r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    except sqlite3.Error as exc:
        fault = fault_of(exc, SQLITE_PREFIX + str(path))
        if fault is None:
            raise
        raise fault from None


def fault_of(exc: BaseException, url: str | None) -> MpipeError | None:
    """The one-line error for a storage fault anywhere in ``exc``'s chain (SQLAlchemy, sqlite3 and Optuna
    wrap each other's), or None when the chain holds none this module knows."""
    texts = []
    seen = exc
    while seen is not None and len(texts) < 8:
        texts.append(str(seen).splitlines()[0] if str(seen) else type(seen).__name__)
        seen = seen.__cause__ or seen.__context__
    text = " | ".join(texts).lower()
    path = sqlite_path(url)
    name = str(path) if path is not None else url
    kept = _kept(path)
    if "database is locked" in text or "database table is locked" in text:
        return MpipeError(f"study storage {name} is locked by another process's write transaction; let it finish (or "
                          f"stop it), then rerun the same command to continue{kept}",
                          quantities=("study storage",))
    if "database or disk is full" in text or "no space left" in text or "disk quota" in text:
        return MpipeError(f"study storage {name} is full (no space left on its disk); free space, or use a copy on "
                          f"another disk, then rerun the same command to continue{kept}",
                          quantities=("study storage",))
    if "readonly database" in text or "read-only file system" in text:
        return MpipeError(f"study storage {name} is read-only; make it and its folder writable (chmod u+w), or use a "
                          f"copy in a writable folder{kept}", quantities=("study storage",))
    if "file is not a database" in text or "malformed" in text or "file is encrypted" in text:
        detail = "not an SQLite file" if "not a database" in text else "its SQLite pages are damaged"
        # the file named once, the command by its own name: a long path twice would push the fix past the line's cap
        here = path.name if path is not None else name
        return MpipeError(f"study storage {name} is damaged ({detail}); move it aside for a new study, or recover its "
                          f"rows in its folder: `sqlite3 {here} .recover | sqlite3 recovered.db`",
                          quantities=("study storage",))
    if "unable to open database file" in text:
        return MpipeError(f"study storage {name} cannot be opened: its folder does not exist or cannot be written; "
                          f"create the folder or give a file in a writable one", quantities=("study storage",))
    if "optuna storage upgrade" in text or "no longer compatible with the table schema" in text:
        # the file named once, in the command: twice, a long path would push the command past the line's cap
        return MpipeError(f"study storage was written by another Optuna version; upgrade it with `optuna storage "
                          f"upgrade --storage {url}` (or give a new file)", quantities=("study storage",))
    return None


def _kept(path: Path | None) -> str:
    """``: it keeps N finished trials`` when the file can be read now, else nothing."""
    if path is None or not path.is_file():
        return ""
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                                timeout=_READ_TIMEOUT_S)) as db:
            count = db.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.Error:
        return ""
    return f" (it keeps the {count} finished trials)"


@contextlib.contextmanager
def faults_named(url: str | None) -> Iterator[None]:
    """Inside the block, a storage fault of ``url`` becomes its one-line :class:`MpipeError`."""
    try:
        yield
    except MpipeError:
        raise
    except Exception as exc:  # SQLAlchemy, sqlite3 and Optuna errors: whatever the RDB layer raises
        fault = fault_of(exc, url)
        if fault is None:
            raise
        raise fault from None


def names_storage_faults(function):
    """Decorate a function whose ``storage`` parameter is the study's URL: its storage faults become one line."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        with faults_named(bound.arguments["storage"]):
            return function(*args, **kwargs)
    return wrapper


# --------------------------------------------------------------------------------------- one problem per study

PROBLEM_PARTS = {
    "model": "the model", "profile": "the hardware profile", "source": "the workload", "devices": "the device count",
    "global_batch": "the global batch", "samples": "the sampled steps", "seed": "the seed",
    "options": "the cost options (dtype, recomputation..., or their definition)",
    "space": "the search space (its settings, or its definition)",
}
"""The parts of a planning problem, as a message names them."""


def payload_digest(payload) -> str:
    """A short, stable digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim_study(study, storage: str | None, payload: dict) -> None:
    """Mark a new ``study`` as the one for the problem ``payload`` describes (its digest, and a digest per
    part), or refuse, in one line that names the parts that differ, a study made for another problem:
    other inputs, or an earlier mpipe-tune that defined the problem otherwise. Its trials' values hold
    for that problem only."""
    key, parts = payload_digest(payload), {name: payload_digest(value) for name, value in payload.items()}
    stored, stored_parts = study.user_attrs.get("problem"), study.user_attrs.get("problem_parts")
    if stored is None:
        study.set_user_attr("problem", key)
    if stored in (None, key):
        if stored_parts != parts:
            study.set_user_attr("problem_parts", parts)
        return
    # the storage named once, in the delete command: twice, a long path would push the fix past the line's cap
    place = f"study '{study.study_name}'"
    fix = (f"give another study name, or delete it: `optuna delete-study --storage {storage} --study-name "
           f"{study.study_name}`")
    if not isinstance(stored_parts, dict):
        raise MpipeError(f"{place} was made by an earlier mpipe-tune or for another planning problem (no parts "
                         f"recorded to compare); {fix}", quantities=("study name",))
    differ = [name for name in PROBLEM_PARTS if stored_parts.get(name) != parts.get(name)]
    named = "; ".join(PROBLEM_PARTS[name] for name in differ) or "the problem's digest"
    raise MpipeError(f"{place} was made for another planning problem, differing in {named}; rerun with its inputs, "
                     f"or {fix}", quantities=("study name",))


# --------------------------------------------------------------------------------------- size

MAX_TRIALS = 100_000
"""The most trials a plan study may hold. A search reloads every stored trial through Optuna's ORM: on the
2-core benchmark machine a study of 10^5 trials took 2.4 GB and minutes to reload
(``benchmarks/bench_bounds.py``), so 10^6 would need about 24 GB; and no search space here needs it (a
sampled search converges in hundreds, an exhaustive one settles most points by their bounds)."""


def check_trial_budget(n_trials: int) -> None:
    """Refuse, before anything starts, a requested total no study may hold."""
    if n_trials > MAX_TRIALS:
        raise MpipeError(f"trial budget {n_trials} is above {MAX_TRIALS}, the most a study may hold (a search reloads "
                         f"every stored trial, about 25 KB of memory each); give at most {MAX_TRIALS}",
                         quantities=("trial budget",))


def check_study_size(storage: str | None, study_name: str) -> None:
    """Refuse, with one counting query and before Optuna reads a trial, a study holding more than
    :data:`MAX_TRIALS` (one grown by many workers, or by hand)."""
    path = sqlite_path(storage)
    if path is None or not path.is_file():
        return
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                                timeout=_READ_TIMEOUT_S)) as db:
            count = db.execute("SELECT count(*) FROM trials t JOIN studies s ON s.study_id = t.study_id "
                               "WHERE s.study_name = ?", (study_name,)).fetchone()[0]
    except sqlite3.Error:
        return  # a fault here is named where Optuna meets it
    if count > MAX_TRIALS:
        raise MpipeError(f"study '{study_name}' in {path} holds {count} trials, more than the {MAX_TRIALS} a search "
                         f"reloads (about 25 KB of memory each); give another study name, or read its trials with "
                         f"`mpipe-tune trials --storage {storage} --study {study_name} --csv FILE`",
                         quantities=("study name",))
