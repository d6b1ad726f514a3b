"""What loading a checkpoint trusts, and the checks that hold it to that.

A checkpoint directory is data from disk: it may have been copied from anywhere. Loading one never runs
code and never unpickles anything outside an exact allow-list:

- JSON (``index.json``, ``ranks/rank-<r>.json``, ``trainer_state.json`` ...) is parsed with ``json``;
  the state it describes is rebuilt by ``codec`` from plain values only.
- The tensor index ``tensors/.metadata`` is a pickle (PyTorch writes it so). Before anything else reads
  it, its opcodes are listed without running them (``pickletools``) and opcodes an index never holds are
  refused; then it is unpickled by an unpickler that resolves exactly the (module, qualified name) pairs
  of ``_compat.dcp_index_globals`` (looked up in a table, so a dotted name such as
  ``("torch.distributed.checkpoint.filesystem", "os.system")`` is simply absent). The result is checked
  field by field: only tensor entries, shard file names without a path, items inside their files.
- Tensor items inside the shard files are read by PyTorch with ``torch.load(weights_only=True)`` (PyTorch's
  own exact allow-list of tensor-rebuilding functions). A non-tensor (pickled) item is refused: ndparallel
  never writes one.
- Symbolic links that leave the checkpoint directory, and anything that is not a plain file or directory
  (a FIFO would block a reader), are refused before any file is opened.

Every refusal is a ``CheckpointError`` with one line naming the file and what was found.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import stat
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from ndparallel import _compat
from ndparallel.errors import CheckpointError

# Opcodes a checkpoint index never contains: building objects by calling a named class (INST, OBJ),
# extension-registry codes (EXT*), and references to data outside the pickle (PERSID, BINPERSID).
_REFUSED_OPCODES = frozenset({"INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp")
_INDEX_GLOBALS: dict[tuple[str, str], object] | None = None


class _Refused(Exception):
    """An index names something outside the allow-list (internal; becomes a CheckpointError)."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        global _INDEX_GLOBALS
        if _INDEX_GLOBALS is None:
            _INDEX_GLOBALS = _compat.dcp_index_globals()
        try:
            return _INDEX_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid):
        raise _Refused("an external (persistent) reference")


def check_tree(root: Path) -> None:
    """Refuse symbolic links leaving ``root`` and anything but plain files and directories below it."""
    top = root.resolve()
    for folder, dirs, files in os.walk(root, followlinks=False):
        for entry in (*dirs, *files):
            path = Path(folder) / entry
            if path.is_symlink():
                try:
                    target = path.resolve(strict=True)
                except (OSError, RuntimeError):  # dangling, or a loop
                    target = Path(os.readlink(path))
                if not target.is_relative_to(top):
                    raise CheckpointError(
                        f"{str(path)!r} is a symbolic link to {str(target)!r}, outside the "
                        f"checkpoint; it was not read. Copy the file into the checkpoint instead"
                    )
            mode = path.stat().st_mode if path.exists() else 0
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(
                    f"{str(path)!r} is not a regular file or directory (a dangling link, FIFO or "
                    f"device); a checkpoint holds only files"
                )


def read_index(tensors_dir: Path) -> Metadata:
    """The tensor index of a checkpoint, read under the allow-list and checked field by field."""
    path = tensors_dir / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        for opcode, _, _ in pickletools.genops(data):
            if opcode.name in _REFUSED_OPCODES:
                raise _Refused(f"the pickle opcode {opcode.name}")
        index = _IndexUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointError(
            f"{str(path)!r} references {exc}, which a checkpoint index never does; it was not "
            f"loaded. Use a checkpoint written by ndparallel"
        ) from None
    except Exception as exc:  # truncated or not a pickle: name what failed
        raise CheckpointError(
            f"{str(path)!r} is not a readable checkpoint index ({type(exc).__name__}: "
            f"{_one_line(exc)}); the file is damaged or not from torch.distributed.checkpoint"
        ) from None
    _check_index(index, tensors_dir)
    return index


def _check_index(index: object, tensors_dir: Path) -> None:
    path = tensors_dir / ".metadata"

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{str(path)!r} is not a valid checkpoint index: {what}")

    if type(index) is not Metadata or not isinstance(index.state_dict_metadata, dict):
        raise bad(f"it holds a {type(index).__name__}")
    for key, entry in index.state_dict_metadata.items():
        if not isinstance(key, str) or type(entry) not in (TensorStorageMetadata, BytesStorageMetadata):
            raise bad(f"entry {key!r} is a {type(entry).__name__}")
    sizes: dict[str, int] = {}
    for where, info in (index.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
            raise bad(
                f"the item {getattr(where, 'fqn', where)!r} points at {name!r}, not a shard file in the checkpoint"
            )
        if getattr(info, "transform_descriptors", None):
            raise bad(
                f"the item {where.fqn!r} is stored with transforms {info.transform_descriptors}, which "
                f"ndparallel never writes"
            )
        if name not in sizes:
            shard = tensors_dir / name
            if not shard.is_file():
                raise CheckpointError(f"the shard file {str(shard)!r} is missing; the checkpoint is incomplete")
            sizes[name] = shard.stat().st_size
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length):
            raise bad(f"the item {where.fqn!r} has offset {offset!r} and length {length!r}")
        if offset + length > sizes[name]:
            raise CheckpointError(
                f"the shard file {str(tensors_dir / name)!r} is truncated: it has {sizes[name]} "
                f"bytes, the item {where.fqn!r} ends at byte {offset + length}; the save was cut "
                f"short or the file was damaged, resume from another checkpoint"
            )


class GuardedReader(dcp.FileSystemReader):
    """A FileSystemReader that serves the index already read and checked by ``read_index``."""

    def __init__(self, tensors_dir: Path, index: Metadata) -> None:
        super().__init__(str(tensors_dir))
        self._checked_index = index

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank checkpoint indexes are not read; ndparallel writes one index")
        index = self._checked_index
        if getattr(index, "storage_meta", None) is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class TensorsOnlyPlanner(dcp.DefaultLoadPlanner):
    """The default load planner, except that a pickled (non-tensor) item is refused instead of unpickled."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"the checkpoint stores {read_item.dest_index.fqn!r} as a pickled object; ndparallel "
            f"stores only tensors there and does not unpickle it"
        )


def refuse_pickled_items(index: Metadata, keys) -> None:
    """Name the first wanted key that the index declares as a pickled object (before any read)."""
    for key in keys:
        if isinstance(index.state_dict_metadata.get(key), BytesStorageMetadata):
            raise CheckpointError(
                f"the checkpoint stores {key!r} as a pickled object; ndparallel stores only "
                f"tensors in the shard files and does not unpickle it"
            )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "no detail"
