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
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from ndparallel.errors import CheckpointError

FORMAT_VERSION = 2
NAME = re.compile(r"step-(\d+)(?:-r(\d+))?")
PARTIAL_PREFIX = ".partial-"


def free_name(root: Path, step: int) -> str:
    """``step-N``, or ``step-N-rK`` when an earlier save of step N (another history) is still there."""
    name, k = f"step-{step}", 0
    while (root / name).exists():
        k += 1
        name = f"step-{step}-r{k}"
    return name


def is_checkpoint_dir(path: Path) -> bool:
    return NAME.fullmatch(path.name) is not None and path.is_dir() and (path / "COMPLETE").is_file()


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
    for stale in root.glob(PARTIAL_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


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
    prune(root, keep, protect={name})
    return final


def prune(root: Path, keep: int | None, *, protect: set[str]) -> list[Path]:
    """Delete complete checkpoints beyond the ``keep`` most recently saved; never ``protect`` or ``latest``."""
    if not keep:
        return []
    try:
        current = latest(root)
    except CheckpointError:
        current = None
    if current is not None:
        protect = protect | {current.name}
    done = sorted((p for p in root.iterdir() if is_checkpoint_dir(p)), key=_saved_at, reverse=True)
    removed = [p for p in done[keep:] if p.name not in protect]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def _saved_at(path: Path) -> float:
    """When a checkpoint was saved: its index's time, else its COMPLETE file's (checkpoints of format 1)."""
    try:
        value = json.loads((path / "index.json").read_text(encoding="utf-8")).get("saved_at")
        if isinstance(value, (int, float)):
            return float(value)
    except (OSError, ValueError, AttributeError):
        pass
    return (path / "COMPLETE").stat().st_mtime


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
