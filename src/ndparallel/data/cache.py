"""The tokenized-rows cache: one directory per set of inputs, holding ``.npy`` columns and a manifest.

The directory name is a hash of everything that decides the rows (``cache_key``): each source file's
path, size and modification time, the dataset specs, the tokenizer's identity and the build options. A
cache directory is written under a temporary name and renamed into place (``os.replace``), so a reader
sees a complete cache or none, even if the writer is killed halfway.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from ndparallel.data.files import resolve_files
from ndparallel.data.rows import COLUMNS, Rows
from ndparallel.data.spec import DatasetSpec
from ndparallel.errors import DataError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def cache_key(inputs: dict[str, Any]) -> str:
    """A short stable hash of JSON-able ``inputs``."""
    return _sha256(json.dumps(inputs, sort_keys=True, default=str))[:24]


def source_identity(spec: DatasetSpec) -> dict[str, Any]:
    """The spec and (path, size, mtime_ns) of each file it reads: any edit to the data changes it."""
    files = []
    for path in resolve_files(spec):
        stat = path.stat()
        files.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    described = asdict(spec)
    described.pop("max_record_bytes")  # a bound on what is read, not a choice of rows
    return {"spec": described, "files": files}


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Name, vocabulary size and a hash of what the tokenizer does (vocabulary, rules, specials, chat template)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A fast tokenizer serialises its whole pipeline (normalizer, model, added tokens); a slow one its vocab.
    rules = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    details = {
        "class": type(tokenizer).__name__,
        "rules": _sha256(rules),
        "special_tokens": tokenizer.special_tokens_map,
        "added_tokens": {str(i): str(t) for i, t in sorted(tokenizer.added_tokens_decoder.items())},
        "chat_template": tokenizer.chat_template,
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
    }
    return {
        "name_or_path": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "hash": _sha256(json.dumps(details, sort_keys=True, default=str)),
    }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def save_splits(directory: Path, splits: dict[str, Rows], manifest: dict[str, Any]) -> None:
    """Write ``splits`` (name -> rows) to ``directory`` atomically: a temporary directory, then a rename."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        temporary.mkdir()
        for split, rows in splits.items():
            for column in COLUMNS:
                np.save(temporary / f"{split}.{column}.npy", getattr(rows, column), allow_pickle=False)
        summary = {split: {"rows": len(rows), "seq_len": rows.seq_len} for split, rows in splits.items()}
        content = {**manifest, "format_version": FORMAT_VERSION, "splits": summary}
        (temporary / MANIFEST).write_text(json.dumps(content, indent=1, sort_keys=True, default=str))
        if directory.exists():
            if load_splits(directory) is not None:  # another process finished the same cache first
                return
            shutil.rmtree(directory)  # a broken cache of the same inputs (e.g. edited by hand)
        os.replace(temporary, directory)
    except OSError as error:
        raise DataError(
            f"cannot write the data cache {directory} ({error.strerror or error}); make cache_dir writable or "
            f"point it elsewhere"
        ) from error
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def load_splits(directory: Path) -> dict[str, Rows] | None:
    """The cached splits, memory-mapped; None when the cache is missing, of another format or incomplete."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("format_version") != FORMAT_VERSION:
            return None
        splits = {}
        for split, summary in manifest["splits"].items():
            mode = "r" if summary["rows"] else None  # numpy cannot memory-map an empty array
            columns = {c: np.load(directory / f"{split}.{c}.npy", mmap_mode=mode, allow_pickle=False) for c in COLUMNS}
            rows = Rows(**columns)
            if (len(rows), rows.seq_len) != (summary["rows"], summary["seq_len"]):
                return None
            splits[split] = rows
        return splits
    except (OSError, ValueError, KeyError, TypeError):
        return None
