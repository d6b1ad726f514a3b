"""Where a run writes: ``output_dir`` can be written, holds no other run's checkpoints, and nothing ndparallel did
not write is replaced (the checks ``train`` makes at start and ``validate`` and the launcher make before it)."""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

from ndparallel.checkpoint import training as ckpt
from ndparallel.config.schema import TrainConfig
from ndparallel.errors import ConfigError
from ndparallel.safe_io import owned_files


def check_output_dir(cfg: TrainConfig, output_dir: Path) -> Path | None:
    """The checkpoint to resume from; refuses to mix a fresh run into another run's checkpoints or export, a
    link (or a file of the wrong kind) where the run writes, and replacing files ndparallel did not write."""
    owned_files.check_owned(output_dir / "metrics.jsonl", directory=False)
    resume_dir = ckpt.find_resume(output_dir, cfg.resume_from_checkpoint)
    if resume_dir is None and ckpt.has_checkpoints(output_dir) and not cfg.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {str(output_dir)!r} already holds checkpoints; resume with "
            f"resume_from_checkpoint: latest, choose another output_dir, or set overwrite_output_dir: true"
        )
    export_dir = output_dir / "hf"
    if cfg.export_hf:
        foreign = owned_files.foreign_files(export_dir)  # a link or not a directory: refused here
        if foreign:
            raise ConfigError(
                f"export_hf: {owned_files.foreign_message(export_dir, foreign)} (overwrite_output_dir replaces "
                f"only an export ndparallel wrote)"
            )
        if export_dir.exists() and any(export_dir.iterdir()) and not cfg.overwrite_output_dir:
            raise ConfigError(
                f"export_hf would replace {str(export_dir)!r}, which is not empty; move it away, choose "
                f"another output_dir, or set overwrite_output_dir: true"
            )
    if cfg.adapter in ("lora", "qlora"):
        adapter_dir = output_dir / "adapter"
        foreign = owned_files.foreign_files(adapter_dir)
        if foreign:
            raise ConfigError(
                f"the LoRA adapter goes to output_dir/adapter: {owned_files.foreign_message(adapter_dir, foreign)}"
            )
    return resume_dir


def writable_dir_problem(path: Path, setting: str) -> str | None:
    """Why directory ``path`` cannot be created or written (probed with a temporary directory), or None."""
    path = path.expanduser().absolute()
    existing = next(p for p in itertools.chain([path], path.parents) if os.path.lexists(p))
    if existing == path and not path.is_dir():
        return f"{setting} {str(path)!r} is a file, not a directory; choose a directory path for {setting}"
    if not existing.is_dir():
        return (
            f"{setting} {str(path)!r} lies under {str(existing)!r}, which is a regular file; choose another "
            f"{setting} (a directory path)"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ndparallel-check-", dir=existing))
    except OSError as exc:
        where = "in it" if existing == path else f"in {str(existing)!r}, where it would be created"
        return (
            f"{setting} {str(path)!r} cannot be written ({exc.strerror} {where}); choose another {setting} or fix "
            f"that directory's permissions"
        )
    return None
