"""Writing and replacing the files ndparallel owns, without following links and without deleting others' files.

An output directory may be a copied or downloaded run, or a folder others can write to. So:

- A symbolic link planted where ndparallel writes (``checkpoints/latest.tmp``, ``metrics.jsonl``) never
  redirects the write: temporary files are created exclusively (``O_EXCL`` never follows a link) after a
  stale one is removed, files are appended with ``O_NOFOLLOW``, and an owned name that is a link or not a
  regular file is refused with one line.
- A directory ndparallel fills and may later replace (``output_dir/hf``, ``output_dir/adapter``) carries a
  manifest of the files it wrote (``MANIFEST``). Replacing it deletes exactly those files; a directory
  holding anything else was not written by ndparallel and is refused, never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import TextIO

from ndparallel.errors import OutputError
from ndparallel.safe_io import file_names

MANIFEST = ".ndparallel-files.json"
"""In a directory ndparallel wrote: the names of the files it wrote there."""

_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data``: written to ``<path>.tmp`` (created exclusively), flushed, renamed.

    The rename replaces a link found at ``path`` itself, never the file it points to.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    remove_stale(tmp)
    try:
        fd = os.open(tmp, _CREATE_NEW, 0o666)
    except FileExistsError:  # planted again between the removal and here
        raise OutputError(f"{str(tmp)!r} keeps appearing while ndparallel writes it; is another job writing here?")
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_stale(path: Path) -> None:
    """Remove a file or link left at ``path`` by an interrupted write (a link is removed, not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise OutputError(f"{str(path)!r} is a directory where ndparallel writes a temporary file; remove it")
    os.unlink(path)


def remove_tree(path: Path) -> None:
    """Remove a directory ndparallel left behind (an interrupted save); a link or file there is unlinked, never
    followed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)  # does not follow links inside
    else:
        os.unlink(path)


def open_append(path: Path) -> TextIO:
    """``path`` opened for appending text; refused (one line) when it is a link or not a regular file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW, 0o666)
    except OSError as exc:
        raise OutputError(_not_a_file(path, exc)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(_not_a_file(path, None))
    return os.fdopen(fd, "a", encoding="utf-8")


def check_owned(path: Path, *, directory: bool) -> None:
    """Refuse ``path`` when it exists but is a link, or not a directory (``directory``) / a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        raise OutputError(_not_a_file(path, None, directory=directory))


def _not_a_file(path: Path, exc: OSError | None, *, directory: bool = False) -> str:
    what = "a directory" if directory else "a regular file"
    found = "a symbolic link" if os.path.islink(path) else "something else"
    detail = f" ({exc.strerror})" if exc is not None and not os.path.islink(path) else ""
    return (
        f"{str(path)!r} is {found}{detail}, not {what}; ndparallel writes its own {what} there and does not follow "
        f"links: remove it, or choose another output_dir"
    )


# -- directories ndparallel wrote -----------------------------------------------------------------------------


def mark_written(directory: Path) -> None:
    """Record every file now in ``directory`` as written by ndparallel (call when the directory is complete)."""
    directory = Path(directory)
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    write_atomic(directory / MANIFEST, json.dumps({"written_by": "ndparallel", "files": names}, indent=1))


def foreign_files(directory: Path) -> list[str]:
    """What in ``directory`` ndparallel did not write (by its manifest); [] for a missing or empty directory."""
    directory = Path(directory)
    if not directory.exists() and not directory.is_symlink():
        return []
    check_owned(directory, directory=True)
    found = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    written = set(_manifest(directory)) | {MANIFEST}
    folders = {str(folder) for folder in _folders(written)}
    return [
        name
        for name in found
        if not (name in written and (directory / name).is_file() and not (directory / name).is_symlink())
        and not (name in folders and (directory / name).is_dir() and not (directory / name).is_symlink())
    ]


def clear_written(directory: Path) -> None:
    """Empty ``directory`` of the files ndparallel wrote there, then remove it; refuse if anything else is in it."""
    directory = Path(directory)
    if not directory.exists() and not directory.is_symlink():
        return
    others = foreign_files(directory)
    if others:
        raise OutputError(foreign_message(directory, others))
    names = _manifest(directory)
    for name in [*names, MANIFEST]:
        (directory / name).unlink(missing_ok=True)
    for folder in sorted(_folders(names), key=lambda p: -len(p.parts)):  # deepest first
        (directory / folder).rmdir()
    directory.rmdir()


def foreign_message(directory: Path, others: list[str]) -> str:
    shown = ", ".join(repr(n) for n in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (
        f"{str(directory)!r} holds files ndparallel did not write ({shown}: its manifest {MANIFEST} does not "
        f"list them); they are not deleted: move them away, or choose another output_dir"
    )


def _folders(names) -> set[Path]:
    return {parent for name in names for parent in Path(name).parents if parent != Path(".")}


def _manifest(directory: Path) -> list[str]:
    try:
        data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        names = data["files"] if data.get("written_by") == "ndparallel" else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [name for name in names if file_names.inside(directory, name) is not None]
