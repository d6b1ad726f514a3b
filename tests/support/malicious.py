"""Malicious and damaged copies of a real checkpoint, for the tests of what loading trusts.

Each payload, unpickled by plain ``pickle`` (or ``torch.load(weights_only=False)``), creates a marker
file; ``payload_is_live`` proves that, so a test that finds no marker after a guarded load shows the
guard stopped a real attack. Pickles are assembled opcode by opcode (``pickle``'s opcode constants).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import torch


def _str(text: str) -> bytes:
    data = text.encode()
    return (
        pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
        if len(data) < 256
        else (pickle.BINUNICODE + len(data).to_bytes(4, "little") + data)
    )


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + pickle.STACK_GLOBAL


def _pickle(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


def payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that run ``touch marker`` when unpickled without an allow-list, one per technique."""
    command = _str(f"touch {marker}")
    return {
        # pickle protocol 4 resolves dotted names: an allowed module's attribute path reaches os.system
        "dotted-name": _pickle(
            _global("torch.distributed.checkpoint.filesystem", "os.system")
            + pickle.MARK
            + command
            + pickle.TUPLE
            + pickle.REDUCE
        ),
        "reduce": _pickle(_global("posix", "system") + pickle.MARK + command + pickle.TUPLE + pickle.REDUCE),
        # a class of the allow-list, then an instance attribute __setstate__ that BUILD calls
        "build": _pickle(
            _global("torch.distributed.checkpoint.metadata", "Metadata")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + pickle.EMPTY_DICT
            + _str("__setstate__")
            + _global("os", "system")
            + pickle.SETITEM
            + pickle.BUILD
            + command
            + pickle.BUILD
        ),
        "inst": _pickle(pickle.MARK + command + pickle.INST + b"os\nsystem\n"),
        "obj": _pickle(pickle.MARK + _global("os", "system") + command + pickle.OBJ),
        "newobj": _pickle(
            _global("types", "SimpleNamespace")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + pickle.EMPTY_DICT
            + _str("__setstate__")
            + _global("os", "system")
            + pickle.SETITEM
            + pickle.BUILD
            + command
            + pickle.BUILD
        ),
    }


def payload_is_live(data: bytes, marker: Path, *, torch_load: bool = False) -> bool:
    """Does plain unpickling of ``data`` run the payload? (in a forked child; the marker is removed)"""
    pid = os.fork()
    if pid == 0:  # the child: unpickle without an allow-list, then leave without cleanup
        try:
            if torch_load:
                torch.load(io.BytesIO(data), weights_only=False)
            else:
                pickle.loads(data)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def torch_saved(data: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is ``data`` (what a tensor item of a shard file is)."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1), buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for item in source.infolist():
            archive.writestr(item, data if item.filename.endswith("data.pkl") else source.read(item))
    return out.getvalue()


def _index(ckpt: Path):
    return pickle.loads((ckpt / "tensors" / ".metadata").read_bytes())  # our own, trusted, test checkpoint


def _write_index(ckpt: Path, index) -> None:
    (ckpt / "tensors" / ".metadata").write_bytes(pickle.dumps(index))


def tamper(ckpt: Path, kind: str, marker: Path, outside: Path) -> str:
    """Damage checkpoint ``ckpt`` (a copy) in one way; returns text the refusal must contain."""
    pay = payloads(marker)
    if kind.startswith("index-"):
        (ckpt / "tensors" / ".metadata").write_bytes(pay[kind[6:]])
        return "which a checkpoint index never does"
    if kind.startswith("tensor-item-"):  # a tensor item of a shard replaced by a torch.save archive with a payload
        index = _index(ckpt)
        where = next(k for k in index.storage_data if k.fqn.startswith("model."))
        info = index.storage_data[where]
        shard = ckpt / "tensors" / info.relative_path
        evil = torch_saved(pay[kind[12:]])
        info.offset, info.length = shard.stat().st_size, len(evil)
        with open(shard, "ab") as f:
            f.write(evil)
        _write_index(ckpt, index)
        return "weights_only loader refused it"
    if kind == "byte-item":  # the index declares a wanted key a pickled object, whose bytes carry a payload
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        index = _index(ckpt)
        key = next(k for k in index.state_dict_metadata if k.startswith("model."))
        where = next(k for k in index.storage_data if k.fqn == key)
        info = index.storage_data[where]
        shard = ckpt / "tensors" / info.relative_path
        evil = torch_saved(pay["reduce"])
        info.offset, info.length = shard.stat().st_size, len(evil)
        with open(shard, "ab") as f:
            f.write(evil)
        index.state_dict_metadata[key] = BytesStorageMetadata()
        _write_index(ckpt, index)
        return "as a pickled object"
    if kind.startswith("rank-file-"):  # the per-rank state file (random generator states) holds a pickle
        for path in (ckpt / "ranks").glob("rank-*.json"):
            path.write_bytes(pay[kind[10:]])
        return "is not readable JSON"
    return _tamper_files(ckpt, kind, pay, outside)


def _tamper_files(ckpt: Path, kind: str, pay: dict, outside: Path) -> str:
    if kind == "extra-pickle-files":  # files ndparallel never reads; they must stay unread
        for name in ("rng/rank-0.pt", "pytorch_model.bin", "tokenizer/evil.pkl", "optimizer.pt"):
            (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / name).write_bytes(pay["reduce"])
        return ""
    if kind == "shard-path-escape":  # the index points an item at a file outside the checkpoint
        index = _index(ckpt)
        next(iter(index.storage_data.values())).relative_path = f"../../{outside.name}"
        _write_index(ckpt, index)
        return "not a shard file in the checkpoint"
    if kind == "symlink-shard":
        shard = sorted((ckpt / "tensors").glob("*.distcp"))[0]
        shutil.copy(shard, outside / shard.name)
        shard.unlink()
        shard.symlink_to(outside / shard.name)
        return "outside the checkpoint"
    if kind == "symlink-tokenizer":
        (ckpt / "tokenizer" / "tokenizer.json").unlink()
        (ckpt / "tokenizer" / "tokenizer.json").symlink_to("/etc/passwd")
        return "outside the checkpoint"
    if kind == "symlink-rank-file":
        target = outside / "rank-0.json"
        shutil.copy(ckpt / "ranks" / "rank-0.json", target)
        (ckpt / "ranks" / "rank-0.json").unlink()
        (ckpt / "ranks" / "rank-0.json").symlink_to(target)
        return "outside the checkpoint"
    if kind == "fifo":
        os.mkfifo(ckpt / "tensors" / "__9_0.distcp")
        return "not a regular file or directory"
    if kind == "state-json-unknown-entry":
        for path in (ckpt / "ranks").glob("rank-*.json"):
            data = json.loads(path.read_text())
            data["states"]["scheduler"]["base_lrs"] = {"__ndp__": "object", "module": "os", "name": "system"}
            path.write_text(json.dumps(data))
        return "that ndparallel does not write"
    raise AssertionError(kind)


KINDS = (
    [f"index-{p}" for p in ("dotted-name", "reduce", "build", "inst", "obj", "newobj")]
    + [f"tensor-item-{p}" for p in ("dotted-name", "reduce", "build", "newobj")]
    + ["byte-item"]
    + [f"rank-file-{p}" for p in ("reduce", "build")]
    + [
        "extra-pickle-files",
        "shard-path-escape",
        "symlink-shard",
        "symlink-tokenizer",
        "symlink-rank-file",
        "fifo",
        "state-json-unknown-entry",
    ]
)
