"""The checkpoint directory on disk: names, atomic publication, ``latest``, keep-K pruning.

    <root>/
      step-200/               a complete checkpoint (renamed into place only once fully written)
        tensors/              torch.distributed.checkpoint shards: every tensor, by key, with its global shape
        ranks/rank-<r>.json   each rank's non-tensor state (JSON skeletons) and random generator states
        index.json            format, step, world size, the states it holds, when it was saved, caller's metadata
        COMPLETE              written last inside the directory
      step-200-r1/            a later save of step 200 (after resuming from an earlier step): names are never reused
      latest                  the name of the newest complete checkpoint, replaced atomically
      .partial-step-300/      a save in progress or interrupted: never read, removed by the next save

Publication (``publish``): the partial directory is flushed, renamed to its final name, then ``latest``
is pointed at it, then old checkpoints are pruned. A crash at any moment leaves a complete checkpoint that
``latest`` names (the previous one until the rename of ``latest``). Nothing is ever deleted before the
new checkpoint is in place, and pruning never deletes the checkpoint just written or the one ``latest``
names.

Pruning deletes only checkpoints of the same history (``index.json``'s ``lineage``: a fresh run starts a
new one, a resume continues the one it loaded): another run's checkpoints in the same directory, a
directory ndparallel did not write and anything reached through a link are never deleted nor counted.
Writes never follow links (``owned_files``): a link planted at ``latest.tmp`` or ``.partial-*`` is removed,
not written through.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

from ndparallel.errors import CheckpointError
from ndparallel.safe_io import owned_files

FORMAT_VERSION = 2
NAME = re.compile(r"step-(\d+)(?:-r(\d+))?")
PARTIAL_PREFIX = ".partial-"


def free_name(root: Path, step: int) -> str:
    """``step-N``, or ``step-N-rK`` when an earlier save of step N (another history) is still there."""
    name, k = f"step-{step}", 0
    while os.path.lexists(root / name):  # a dangling link takes the name too
        k += 1
        name = f"step-{step}-r{k}"
    return name


def is_checkpoint_dir(path: Path) -> bool:
    """A complete checkpoint: a real directory (not a link) named step-N holding a regular COMPLETE file."""
    return (
        NAME.fullmatch(path.name) is not None
        and _is_real(path, stat.S_ISDIR)
        and _is_real(path / "COMPLETE", stat.S_ISREG)
    )


def _is_real(path: Path, kind) -> bool:
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


def has_checkpoints(root: Path) -> bool:
    return root.is_dir() and any(NAME.fullmatch(p.name) for p in root.iterdir())


def latest(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when there is no ``latest``."""
    marker = root / "latest"
    if not marker.exists() and not marker.is_symlink():
        return None
    if marker.is_symlink() or not marker.is_file():
        raise CheckpointError(f"{str(marker)!r} is not a plain file; ndparallel writes the name of a checkpoint in it")
    name = marker.read_text(encoding="utf-8", errors="replace").strip()
    if not NAME.fullmatch(name):
        raise CheckpointError(
            f"{str(marker)!r} names {name[:80]!r}, which is not a checkpoint of this directory "
            f"(step-N); point it at one, or give the checkpoint directory itself"
        )
    target = root / name
    if not target.is_dir():
        raise CheckpointError(
            f"{str(marker)!r} points at {name!r}, which does not exist; set resume_from_checkpoint "
            f"to an existing checkpoint directory"
        )
    return target


def remove_partials(root: Path) -> None:
    """Remove interrupted saves; a link or file under a partial's name is unlinked, never followed."""
    for stale in root.glob(PARTIAL_PREFIX + "*"):
        owned_files.remove_tree(stale)


def new_partial(root: Path, name: str) -> Path:
    """A fresh, empty partial directory for checkpoint ``name`` (created here: nothing planted is reused)."""
    root.mkdir(parents=True, exist_ok=True)
    remove_partials(root)
    partial = root / f"{PARTIAL_PREFIX}{name}"
    partial.mkdir()
    (partial / "ranks").mkdir()
    return partial


def publish(partial: Path, root: Path, name: str, index: dict, keep: int | None) -> Path:
    """Seal ``partial`` (index, COMPLETE, flushes), rename it to ``root/name``, point ``latest`` at it, prune."""
    index = {**index, "saved_at": time.time()}
    write_atomic(partial / "index.json", json.dumps(index, indent=1))
    for folder in (partial / "tensors", partial / "ranks"):
        if folder.is_dir():
            fsync_dir(folder)
    write_atomic(partial / "COMPLETE", "")
    fsync_dir(partial)
    final = root / name
    os.replace(partial, final)  # ``name`` is free: never replaces an existing checkpoint
    fsync_dir(root)
    write_atomic(root / "latest", name)
    prune(root, keep, protect={name}, lineage=index.get("lineage"))
    return final


def prune(root: Path, keep: int | None, *, protect: set[str], lineage: str | None) -> list[Path]:
    """Delete complete checkpoints of ``lineage`` beyond the ``keep`` most recently saved; never ``protect`` or
    ``latest``, never a checkpoint of another history (or of none: written before histories were recorded)."""
    if not keep or not lineage:
        return []
    try:
        current = latest(root)
    except CheckpointError:
        current = None
    if current is not None:
        protect = protect | {current.name}
    ours = [(p, index) for p in root.iterdir() if is_checkpoint_dir(p) and (index := read_index(p)) is not None]
    ours = [(p, index["saved_at"]) for p, index in ours if index.get("lineage") == lineage]
    done = [p for p, _ in sorted(ours, key=lambda item: item[1], reverse=True)]
    removed = [p for p in done[keep:] if p.name not in protect]
    for old in removed:  # best effort: the new checkpoint is published already (real directories: no links)
        shutil.rmtree(old, ignore_errors=True)
    return removed


def read_index(path: Path) -> dict | None:
    """A checkpoint's ``index.json`` as ndparallel writes it (a regular file, a time of saving), else None."""
    index_file = path / "index.json"
    if not _is_real(index_file, stat.S_ISREG):
        return None
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("saved_at"), (int, float)):
        return None
    return index


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` atomically, never writing through a link (``owned_files.write_atomic``)."""
    owned_files.write_atomic(path, text)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
