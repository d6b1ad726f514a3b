"""Records of a dataset, checked and normalised per dataset type.

``read_records(spec)`` yields one record per document, whatever the file format:

- ``TextRecord`` for ``completion`` (the ``field:`` column, default ``text``) and ``pretrain_files``;
- ``InstructionRecord`` for ``alpaca`` (``instruction``, optional ``input``, ``output``);
- ``ChatRecord`` for ``chat_template``: ``messages`` of ``{role, content}``, or ShareGPT ``conversations`` of
  ``{from, value}`` with ``human`` -> ``user`` and ``gpt`` -> ``assistant``.

Every problem with a record is a one-line DataError naming the file, the record and the setting to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ndparallel.data.files import (
    DEFAULT_MAX_RECORD_MB,
    HEAD_BYTES,
    head_rows,
    iter_rows,
    read_utf8,
    resolve_files,
    too_large,
)
from ndparallel.data.spec import ALIASES, DATASET_TYPES, DatasetSpec
from ndparallel.errors import DataError

__all__ = [
    "ALIASES",
    "DATASET_TYPES",
    "ChatRecord",
    "DatasetSpec",
    "InstructionRecord",
    "Record",
    "TextRecord",
    "read_records",
    "sample_records",
]

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True, slots=True)
class TextRecord:
    """A document trained on every token."""

    text: str
    where: str


@dataclass(frozen=True, slots=True)
class InstructionRecord:
    """An alpaca instruction: the prompt is instruction (+ input), the trained part is the output."""

    instruction: str
    input: str
    output: str
    where: str


@dataclass(frozen=True, slots=True)
class ChatRecord:
    """A conversation of ``{"role", "content"}`` messages; assistant turns are trained."""

    messages: tuple[dict[str, str], ...]
    where: str


Record = TextRecord | InstructionRecord | ChatRecord


def read_records(spec: DatasetSpec) -> Iterator[Record]:
    """The records of one dataset, file by file in order, sliced as ``split`` says and after ``skip`` records;
    a DataError if there are none."""
    files = resolve_files(spec)
    ranges = _slice_ranges(spec, files)
    count = 0
    for number, record in enumerate(_all_records(spec, files)):
        if number < spec.skip or (ranges is not None and not any(a <= number < b for a, b in ranges)):
            continue
        count += 1
        yield record
    if count == 0:
        raise DataError(
            f"dataset {spec.label}: {spec.path} holds no records (for split={spec.split!r}); fix path: "
            f"or split:, or add data"
        )


def sample_records(spec: DatasetSpec) -> tuple[list[Record], bool]:
    """The dataset's first records, read cheaply (``files.head_rows``: at most a thousand records of its first
    file that has any), checked as ``read_records`` checks them. Returns (records, whether they are
    all of the dataset's records); ``split`` slices and ``skip`` are not applied."""
    files = resolve_files(spec)
    if spec.kind == "pretrain_files":
        return _sample_documents(files)
    for number, path in enumerate(files):
        rows, whole = head_rows(path)
        records = [r for r in (_normalise(row, where, spec) for where, row in rows) if r is not None]
        if records or not whole:
            return records, whole and number == len(files) - 1
    return [], True


def _sample_documents(files: list) -> tuple[list[Record], bool]:
    """The first files of a one-document-per-file dataset, about ``HEAD_BYTES`` of them in all (the last one
    read may be cut): one file alone says little when documents differ in length file by file."""
    records, budget = [], HEAD_BYTES
    for number, path in enumerate(files):
        size = path.stat().st_size
        whole = size <= budget
        records.append(TextRecord(read_utf8(path, limit=None if whole else budget), str(path)))
        budget -= min(size, budget)
        if not whole or budget <= 0:
            return records, whole and number == len(files) - 1
    return records, True


def _all_records(spec: DatasetSpec, files: list) -> Iterator[Record]:
    limit = spec.max_record_bytes or int(DEFAULT_MAX_RECORD_MB * 2**20)
    for path in files:
        if spec.kind == "pretrain_files":  # the whole file is one document
            if path.stat().st_size > limit:
                raise too_large(str(path), limit)
            yield TextRecord(read_utf8(path), str(path))
        else:
            for where, row in iter_rows(path, max_record_bytes=limit):
                record = _normalise(row, where, spec)
                if record is not None and _chars(record) > limit:  # a Parquet / Arrow / JSON row
                    raise too_large(where, limit)
                if record is not None:
                    yield record


def _chars(record: Record) -> int:
    if isinstance(record, TextRecord):
        return len(record.text)
    if isinstance(record, InstructionRecord):
        return len(record.instruction) + len(record.input) + len(record.output)
    return sum(len(m["role"]) + len(m["content"]) for m in record.messages)


def _slice_ranges(spec: DatasetSpec, files: list) -> list[tuple[int, int]] | None:
    """Record index ranges of the split's slices (None: every record). Percent bounds round to the nearest
    record, as ``datasets`` does; counting the records costs one extra pass only when a bound is a percent."""
    parts = spec.split_parts
    if all(start is None and stop is None for _, start, stop in parts):
        return None
    if len(parts) > 1:
        raise DataError(f"dataset {spec.label}: split={spec.split!r}: slices apply to one split at a time")
    _, start, stop = parts[0]
    total = sum(1 for _ in _all_records(spec, files)) if "%" in f"{start}{stop}" else None
    return [(_bound(start, total, 0), _bound(stop, total, None))]


def _bound(text: str | None, total: int | None, default: int | None) -> float:
    if text is None:
        return default if default is not None else float("inf")
    if text.endswith("%"):
        value = round(int(text[:-1]) * total / 100)
    else:
        value = int(text)
    return value if value >= 0 else max(0, (total if total is not None else 0) + value)


def _normalise(row: Any, where: str, spec: DatasetSpec) -> Record | None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a record must be a JSON object / table row, found {_kind(row)}; fix the file")
    if spec.kind == "completion":
        field = spec.field or "text"
        return TextRecord(_string(row, field, where, "set field: to the column holding the text"), where)
    if spec.kind == "alpaca":
        fix = "alpaca records need instruction, output and optionally input (or use another type:)"
        given = row.get("input")
        return InstructionRecord(
            instruction=_string(row, "instruction", where, fix),
            input="" if given is None else _string(row, "input", where, fix),
            output=_string(row, "output", where, fix),
            where=where,
        )
    messages = _messages(row, where, spec)
    if spec.drop_system_message:
        messages = tuple(m for m in messages if m["role"] != "system")
    return ChatRecord(messages, where) if messages else None


def _string(row: dict, field: str, where: str, fix: str) -> str:
    if field not in row:
        present = ", ".join(map(str, row)) or "none"
        raise DataError(f"{where}: no field '{field}' (fields: {present}); {fix}")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' holds {_kind(value)}, not a string; {fix}")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _messages(row: dict, where: str, spec: DatasetSpec) -> tuple[dict[str, str], ...]:
    """The conversation as role/content dicts, from ``messages`` (or ``field:``) or ShareGPT ``conversations``."""
    fix = "set field: to the column holding the messages list"
    if spec.field is not None:
        key = spec.field
    else:
        key = "messages" if "messages" in row or "conversations" not in row else "conversations"
    if key not in row:
        present = ", ".join(map(str, row)) or "none"
        raise DataError(f"{where}: no field '{key}' (fields: {present}); {fix}")
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        what = "an empty list" if isinstance(turns, list) else _kind(turns)
        raise DataError(f"{where}: field '{key}' holds {what}, not a list of messages; {fix}")
    roles = _role_names(spec)
    return tuple(_message(turn, number, key, where, spec, roles) for number, turn in enumerate(turns, start=1))


def _role_names(spec: DatasetSpec) -> dict[str, str]:
    """Dataset role name -> template role: ShareGPT's names, then the config's ``roles`` mapping."""
    names = dict(SHAREGPT_ROLES)
    for role, aliases in (spec.roles or {}).items():
        for alias in aliases:
            names[str(alias)] = str(role)
    return names


def _message(turn: Any, number: int, key: str, where: str, spec: DatasetSpec, roles: dict[str, str]) -> dict[str, str]:
    place = f"{where}: message {number} of '{key}'"
    role_key, content_key = spec.role_key, spec.content_key
    if isinstance(turn, dict) and (role_key or content_key):
        role_key, content_key = role_key or "role", content_key or "content"
        if role_key not in turn or content_key not in turn:
            raise DataError(
                f"{place}: no {role_key!r} / {content_key!r} keys (found {_describe(turn)}); fix "
                f"message_property_mappings"
            )
        role, content = roles.get(turn[role_key], turn[role_key]), turn[content_key]
    elif isinstance(turn, dict) and "role" in turn:
        role, content = (
            roles.get(turn.get("role"), turn.get("role")) if spec.roles else turn.get("role"),
            turn.get("content"),
        )
    elif isinstance(turn, dict) and "from" in turn:
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(
                f"{place}: from={speaker!r} is not a ShareGPT speaker; use one of {', '.join(SHAREGPT_ROLES)}"
            )
        role, content = SHAREGPT_ROLES[speaker], turn.get("value")
    else:
        raise DataError(f"{place}: expected {{role, content}} or {{from, value}}, found {_describe(turn)}; fix it")
    if not isinstance(role, str) or not isinstance(content, str):
        raise DataError(f"{place}: role and content must be strings, found {_describe(turn)}; fix it")
    message = {"role": role, "content": content}
    trace = turn.get(spec.thinking_key)  # a reasoning trace, under the key the chat template reads it from
    if trace:
        if not isinstance(trace, str):
            raise DataError(
                f"{place}: {spec.thinking_key!r} must be a string (a reasoning trace), found {_kind(trace)}"
            )
        message[spec.template_thinking_key] = trace
    return message


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_kind(v)}" for k, v in value.items()) + "}"
    return _kind(value)
