"""Which files a dataset spec names, and the raw rows inside them.

A ``path`` is a file, a directory (its data files, recursively, sorted), a glob pattern, or a Hugging Face
dataset saved with ``save_to_disk``: a directory with ``state.json`` listing its Arrow IPC stream files, or a
``DatasetDict`` directory with ``dataset_dict.json`` and one such directory per split. Arrow and Parquet are
read with pyarrow directly: the ``datasets`` package is not needed.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ndparallel.data.spec import DatasetSpec
from ndparallel.errors import DataError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".jsonl.zst", ".jsonl.gz", ".json.gz")
# Metadata a save_to_disk directory holds next to its Arrow files: never records.
HF_METADATA_FILES = {"state.json", "dataset_info.json", "dataset_dict.json"}
GLOB_CHARACTERS = set("*?[")
STDLIB_PREFIX = "stdlib:"
PARQUET_BATCH_ROWS = 1024
BINARY_SNIFF_BYTES = 8192
HEAD_BYTES = 1 << 20
"""How much of a JSON lines file a sample of its first records reads."""
HEAD_RECORDS = 1000
"""At most this many records of any other file are read for a sample."""


def resolve_data_path(path: str) -> str:
    """``stdlib:PATTERN`` -> a glob inside this Python's standard library directory (the built-in corpus)."""
    if path.startswith(STDLIB_PREFIX):
        return str(Path(sysconfig.get_paths()["stdlib"]) / (path[len(STDLIB_PREFIX) :] or "*.py"))
    return path


def resolve_files(spec: DatasetSpec) -> list[Path]:
    """The data files of ``spec`` in reading order; a DataError if there are none."""
    from ndparallel.hub import is_hub_id

    pattern = spec.path
    if is_hub_id(pattern):
        from ndparallel.data.hub_files import hub_files

        return hub_files(spec)
    # An existing path is taken literally even if its name contains glob characters ("data[1].jsonl").
    if GLOB_CHARACTERS & set(pattern) and not Path(pattern).expanduser().exists():
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"dataset {spec.label}: no file matches path={pattern!r}; fix the pattern in path:")
        return files
    path = Path(pattern).expanduser()
    if not path.exists():
        raise DataError(
            f"dataset {spec.label}: path={pattern!r} does not exist (relative paths start at {os.getcwd()}); fix path:"
        )
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").is_file():
        path = _dataset_dict_split(path, spec)
    if (path / "state.json").is_file():
        return _saved_dataset_files(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
    if spec.kind != "pretrain_files":
        files = [p for p in files if p.name.endswith(RECORD_SUFFIXES) and p.name not in HF_METADATA_FILES]
    if not files:
        wanted = "files" if spec.kind == "pretrain_files" else "*" + ", *".join(RECORD_SUFFIXES) + " files"
        raise DataError(f"dataset {spec.label}: directory {path} holds no {wanted}; fix path: or add data files")
    return files


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _dataset_dict_split(path: Path, spec: DatasetSpec) -> Path:
    """The split directory of a saved DatasetDict (``split:``, default ``train``)."""
    splits = _read_json_file(path / "dataset_dict.json").get("splits", [])
    names = [name for name, _, _ in spec.split_parts]
    if len(names) != 1:
        raise DataError(f"dataset {spec.label}: a saved DatasetDict is read one split at a time; split={spec.split!r}")
    split = names[0]
    if split not in splits or not (path / split).is_dir():
        raise DataError(
            f"dataset {spec.label}: the saved DatasetDict {path} has no split {split!r}; set split: to one of "
            f"{', '.join(map(str, splits)) or '(none listed in dataset_dict.json)'}"
        )
    return path / split


def _saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files a ``save_to_disk`` directory lists in ``state.json``, in its order."""
    state = _read_json_file(path / "state.json")
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise DataError(
            f"{path / 'state.json'}: no '_data_files' list of {{'filename': ...}}; this is not a directory "
            f"written by Dataset.save_to_disk: save it again or point path: at the data files"
        )
    files = [path / entry["filename"] for entry in entries]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{path / 'state.json'} lists {missing[0]}, which does not exist; save the dataset again")
    if not files:
        raise DataError(f"dataset {path}: state.json lists no data files; the saved dataset is empty")
    return files


def _read_json_file(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(read_utf8(path))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error.msg}, line {error.lineno}); fix or rewrite it") from error
    if not isinstance(content, dict):
        raise DataError(f"{path}: expected a JSON object, found a {type(content).__name__}; fix or rewrite it")
    return content


def read_utf8(path: Path, *, limit: int | None = None) -> str:
    """The file's text (its first ``limit`` bytes, a character cut at the end dropped); a DataError naming the
    byte offset of the first byte that is not UTF-8, or saying it is a binary file."""
    try:
        if limit is None:
            data = path.read_bytes()
        else:
            with open(path, "rb") as f:
                data = f.read(limit)
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror}); fix its permissions or remove it") from error
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # a BOM is no content
    nul = data.find(b"\0", 0, BINARY_SNIFF_BYTES)
    if nul >= 0:  # text never holds NUL bytes: an image, an archive, a model file ...
        raise DataError(
            f"{path}: a binary file (a NUL byte at offset {nul}), not {path.suffix or 'plain'} text; point path: "
            f"at the dataset's text (or Parquet / Arrow files named .parquet / .arrow)"
        )
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        if limit is not None and len(data) == limit and error.start >= len(data) - 3:
            return data[start : error.start].decode("utf-8")  # the limit cut a character in two
        offset = start + error.start
        raise DataError(
            f"{path}: not UTF-8 text (byte {data[offset]:#04x} at byte offset {offset}); re-encode it as UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8) or remove it from the dataset"
        ) from None


def iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each record of a data file; ``where`` names the file and record for messages."""
    readers = {".jsonl": _iter_json_lines, ".json": _iter_json, ".parquet": _iter_parquet, ".arrow": _iter_arrow}
    if path.suffix in (".zst", ".gz") and Path(path.stem).suffix in (".jsonl", ".json"):
        yield from _iter_json_lines(path, _decompress(path))
        return
    reader = readers.get(path.suffix)
    if reader is None:
        raise DataError(
            f"{path}: records are read from {', '.join(RECORD_SUFFIXES)} files or save_to_disk directories, not "
            f"'{path.suffix}' files; convert it, or use type: pretrain_files for plain text"
        )
    yield from reader(path)


def head_rows(path: Path) -> tuple[list[tuple[str, Any]], bool]:
    """The first records of a data file, cheaply: a JSON lines file's first ``HEAD_BYTES`` (its last, cut line
    left out), other formats up to ``HEAD_BYTES`` of their rows' worth read as a stream. Returns (rows, whether
    they are all of the file's rows)."""
    if path.suffix == ".jsonl" and path.stat().st_size > HEAD_BYTES:
        text = read_utf8(path, limit=HEAD_BYTES)
        return list(_iter_json_lines(path, text[: text.rfind("\n") + 1])), False
    rows = []
    for row in iter_rows(path):
        rows.append(row)
        if len(rows) >= HEAD_RECORDS:
            return rows, False
    return rows, True


def _decompress(path: Path) -> str:
    """The text of a .gz (gzip) or .zst (zstandard, through pyarrow) compressed file."""
    try:
        if path.suffix == ".gz":
            import gzip

            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            pyarrow, _ = _import_pyarrow(path)
            with pyarrow.input_stream(str(path), compression="zstd") as f:
                data = f.read()
    except (OSError, EOFError) as error:  # gzip's BadGzipFile is an OSError; pyarrow raises OSError
        raise DataError(
            f"{path}: not a readable {path.suffix} file ({error}); compress it again, or remove it"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: the decompressed data is not UTF-8 text (byte offset {error.start})") from None


def _iter_json_lines(path: Path, text: str | None = None) -> Iterator[tuple[str, Any]]:
    text = read_utf8(path) if text is None else text
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {line_number}", json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path} line {line_number}: not valid JSON ({error.msg}, column {error.colno}); fix or remove the line"
            ) from None


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    """A JSON array of records, one JSON object, or JSON lines (``.json`` is used for all three)."""
    text = read_utf8(path)
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            raise DataError(f"{path}: not valid JSON ({error.msg}, line {error.lineno}); fix the file") from None
        yield from _iter_json_lines(path, text)  # several values: JSON lines
        return
    records = content if isinstance(content, list) else [content]
    for number, record in enumerate(records, start=1):
        yield f"{path} record {number}", record


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    pyarrow, _ = _import_pyarrow(path)
    import pyarrow.parquet as parquet

    try:
        file = parquet.ParquetFile(str(path))
    except (pyarrow.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error}); write it again or remove it") from None
    number = 0
    for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", record


def _iter_arrow(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of an Arrow IPC file: the stream format ``save_to_disk`` writes, or the random-access file format."""
    pyarrow, ipc = _import_pyarrow(path)
    number = 0
    with pyarrow.memory_map(str(path)) as source:
        try:
            batches = iter(ipc.open_stream(source))
        except pyarrow.ArrowInvalid:
            source.seek(0)
            try:
                reader = ipc.open_file(source)
            except pyarrow.ArrowInvalid as error:
                raise DataError(f"{path}: not an Arrow IPC file ({error}); save it again or remove it") from None
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in batches:
            for record in batch.to_pylist():
                number += 1
                yield f"{path} row {number}", record


def _import_pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.ipc as ipc
    except ImportError:
        raise DataError(
            f"{path}: reading {path.suffix or 'Arrow'} data needs pyarrow; pip install 'ndparallel[data]'"
        ) from None
    return pyarrow, ipc
