"""Which files a dataset spec names, and the raw rows inside them.

A ``path`` is a file, a directory (its data files, recursively, sorted), a glob pattern, or a Hugging Face
dataset saved with ``save_to_disk``: a directory with ``state.json`` listing its Arrow IPC stream files, or a
``DatasetDict`` directory with ``dataset_dict.json`` and one such directory per split. Arrow and Parquet are
read with pyarrow directly: the ``datasets`` package is not needed.

What is read is bounded: JSON lines (also compressed ones, decompressed as a stream) are read one record at a
time and a record longer than ``dataset_max_record_mb`` is an error naming it, before it is held in memory
(it would be tokenized whole before long_rows applies); ``**`` in a pattern does not follow directory links
(a link loop would never end).
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ndparallel.data.hub_files import hub_files
from ndparallel.data.spec import DatasetSpec
from ndparallel.errors import DataError
from ndparallel.safe_io import file_names
from ndparallel.safe_io.hub import is_hub_id

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".jsonl.zst", ".jsonl.gz", ".json.gz")
# Metadata a save_to_disk directory holds next to its Arrow files: never records.
HF_METADATA_FILES = {"state.json", "dataset_info.json", "dataset_dict.json"}
GLOB_CHARACTERS = set("*?[")
STDLIB_PREFIX = "stdlib:"
PARQUET_BATCH_ROWS = 1024
BINARY_SNIFF_BYTES = 8192
HEAD_BYTES = 1 << 20
"""How much of a plain-text (pretrain_files) document a sample reads."""
HEAD_RECORDS = 1000
"""At most this many records of a file are read for a sample (``head_rows``)."""
DEFAULT_MAX_RECORD_MB = 16.0
"""The default of ``dataset_max_record_mb``: a record (a JSON line, a row, a pretrain file) may hold this many
MiB; about 4M tokens of English text."""


def too_large(where: str, limit_bytes: int) -> DataError:
    return DataError(
        f"{where}: the record is larger than dataset_max_record_mb={limit_bytes / 2**20:g} MiB; it would be read "
        f"and tokenized whole before long_rows applies. Split the document, or raise dataset_max_record_mb"
    )


def resolve_data_path(path: str) -> str:
    """``stdlib:PATTERN`` -> a glob inside this Python's standard library directory (the built-in corpus)."""
    if path.startswith(STDLIB_PREFIX):
        return str(Path(sysconfig.get_paths()["stdlib"]) / (path[len(STDLIB_PREFIX) :] or "*.py"))
    return path


def resolve_files(spec: DatasetSpec) -> list[Path]:
    """The data files of ``spec`` in reading order; a DataError if there are none."""
    pattern = spec.path
    if is_hub_id(pattern):
        return hub_files(spec)
    # An existing path is taken literally even if its name contains glob characters ("data[1].jsonl").
    if GLOB_CHARACTERS & set(pattern) and not Path(pattern).expanduser().exists():
        files = sorted(p for p in set(_glob(os.path.expanduser(pattern))) if p.is_file())
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


def _glob(pattern: str) -> list[Path]:
    """``glob.glob(pattern, recursive=True)``, except that ``**`` does not descend into links to directories."""
    if "**" not in Path(pattern).parts:
        return [Path(p) for p in glob.glob(pattern, recursive=True)]
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    return list(_expand(base, list(parts[fixed:])))


def _expand(base: Path, parts: list[str]):
    if not parts:
        yield base
        return
    head, rest = parts[0], parts[1:]
    if head == "**":  # zero or more directories, never through a link (glob's rule: no hidden ones)
        yield from _expand(base, rest)
        for entry in _entries(base):
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                yield from _expand(Path(entry.path), parts)
    elif glob.has_magic(head):
        for entry in _entries(base):
            if fnmatch.fnmatch(entry.name, head) and (head.startswith(".") or not entry.name.startswith(".")):
                yield from _expand(Path(entry.path), rest)
    elif os.path.lexists(base / head):
        yield from _expand(base / head, rest)


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as found:
            return sorted(found, key=lambda e: e.name)
    except OSError:  # not a directory, or unreadable: as glob, no match
        return []


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
    files = [file_names.inside(path, entry["filename"]) for entry in entries]
    outside = next((e["filename"] for e, f in zip(entries, files) if f is None), None)
    if outside is not None:
        raise DataError(
            f"{path / 'state.json'} lists {outside!r}, which is not a file name inside {path} (no absolute "
            f"paths or '..'); save the dataset again"
        )
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


def iter_rows(path: Path, *, max_record_bytes: int | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each record of a data file; ``where`` names the file and record for messages. A JSON
    line longer than ``max_record_bytes`` (default ``dataset_max_record_mb``'s) is an error naming it."""
    limit = max_record_bytes or int(DEFAULT_MAX_RECORD_MB * 2**20)
    if path.suffix in (".zst", ".gz") and Path(path.stem).suffix in (".jsonl", ".json"):
        with _open_decompressed(path) as stream:
            yield from _iter_json_lines(path, stream, limit)
        return
    if path.suffix == ".jsonl":
        try:
            stream = open(path, "rb")
        except OSError as error:
            raise DataError(f"{path}: cannot be read ({error.strerror}); fix its permissions or remove it") from None
        with stream:
            yield from _iter_json_lines(path, stream, limit)
        return
    readers = {".json": _iter_json, ".parquet": _iter_parquet, ".arrow": _iter_arrow}
    reader = readers.get(path.suffix)
    if reader is None:
        raise DataError(
            f"{path}: records are read from {', '.join(RECORD_SUFFIXES)} files or save_to_disk directories, not "
            f"'{path.suffix}' files; convert it, or use type: pretrain_files for plain text"
        )
    yield from reader(path)


def head_rows(path: Path) -> tuple[list[tuple[str, Any]], bool]:
    """The first records of a data file, cheaply: at most ``HEAD_RECORDS`` of them, read as a stream (a JSON
    lines file's first bytes are checked for a binary file first). Returns (rows, whether they are all of the
    file's rows)."""
    if path.suffix == ".jsonl":
        read_utf8(path, limit=BINARY_SNIFF_BYTES)  # a binary file given as JSON lines: one line saying so
    rows = []
    for row in iter_rows(path):
        rows.append(row)
        if len(rows) >= HEAD_RECORDS:
            return rows, False
    return rows, True


def _open_decompressed(path: Path):
    """A binary stream of a .gz (gzip) or .zst (zstandard, through pyarrow) file, decompressed as it is read."""
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rb")
    pyarrow, _ = _import_pyarrow(path)
    return io.BufferedReader(pyarrow.input_stream(str(path), compression="zstd"))


def _iter_json_lines(path: Path, stream, limit: int) -> Iterator[tuple[str, Any]]:
    """Records of JSON lines read from the binary ``stream``, one line at a time, none longer than ``limit``."""
    offset, line_number = 0, 0
    while True:
        try:
            raw = stream.readline(limit + 2)  # the record, its newline (maybe \r\n), and one byte too many
        except (OSError, EOFError) as error:  # a damaged compressed stream
            raise DataError(f"{path}: cannot be read or decompressed ({error}); write it again or remove it") from None
        if not raw:
            return
        line_number += 1
        if len(raw.rstrip(b"\r\n")) > limit:
            raise too_large(f"{path} line {line_number}", limit)
        start = len(codecs.BOM_UTF8) if line_number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
        try:
            line = raw[start:].decode("utf-8")
        except UnicodeDecodeError as error:
            at = offset + start + error.start
            raise DataError(
                f"{path}: not UTF-8 text (byte {raw[start + error.start]:#04x} at byte offset {at}); re-encode it as "
                f"UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove it from the dataset"
            ) from None
        offset += len(raw)
        if not line.strip():
            continue
        yield f"{path} line {line_number}", _json_line(path, line_number, line)


def _json_line(path: Path, line_number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path} line {line_number}: not valid JSON ({error.msg}, column {error.colno}); fix or remove the line"
        ) from None
    except RecursionError:
        raise DataError(f"{path} line {line_number}: JSON nested too deeply to read; fix or remove the line") from None


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    """A JSON array of records, one JSON object, or JSON lines (``.json`` is used for all three)."""
    text = read_utf8(path)
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            raise DataError(f"{path}: not valid JSON ({error.msg}, line {error.lineno}); fix the file") from None
        yield from _iter_json_lines(path, io.BytesIO(text.encode("utf-8")), len(text.encode("utf-8")))  # JSON lines
        return
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read; fix the file") from None
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
