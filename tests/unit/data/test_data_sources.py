"""Reading records: every file format, every dataset type, and one-line errors for every user mistake."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.paths import REPO

from ndparallel import DataError
from ndparallel.data.sources import ChatRecord, InstructionRecord, TextRecord, read_records
from ndparallel.data.spec import DatasetSpec

TEXTS = [{"text": "first"}, {"text": "second é"}, {"text": "third"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_arrow_stream(path, records):
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def save_to_disk_layout(directory, records):
    """The files Dataset.save_to_disk writes: an Arrow IPC stream, state.json listing it, dataset_info.json."""
    directory.mkdir(parents=True)
    write_arrow_stream(directory / "data-00000-of-00001.arrow", records)
    state = {
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": "0",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return directory


def texts(spec):
    return [record.text for record in read_records(spec)]


# --- formats ---------------------------------------------------------------------------------------------


def test_jsonl_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    path.write_text(path.read_text() + "\n\n")
    assert texts(DatasetSpec(str(path), "completion")) == ["first", "second é", "third"]


def test_json_array_and_json_lines_in_a_json_file(tmp_path):
    (tmp_path / "array.json").write_text(json.dumps(TEXTS))
    write_jsonl(tmp_path / "lines.json", TEXTS)
    assert texts(DatasetSpec(str(tmp_path / "array.json"), "text")) == ["first", "second é", "third"]
    assert texts(DatasetSpec(str(tmp_path / "lines.json"), "text")) == ["first", "second é", "third"]


def test_parquet_with_a_custom_text_field(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"body": "p1", "id": 1}, {"body": "p2", "id": 2}]), tmp_path / "a.parquet")
    assert texts(DatasetSpec(str(tmp_path / "a.parquet"), "completion", field="body")) == ["p1", "p2"]


def test_save_to_disk_dataset_and_dataset_dict_split(tmp_path):
    single = save_to_disk_layout(tmp_path / "single", TEXTS)
    assert texts(DatasetSpec(str(single), "completion")) == ["first", "second é", "third"]
    both = tmp_path / "dict"
    save_to_disk_layout(both / "train", [{"text": "t"}])
    save_to_disk_layout(both / "test", [{"text": "held out"}])
    (both / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert texts(DatasetSpec(str(both), "completion")) == ["t"]  # split defaults to train
    assert texts(DatasetSpec(str(both), "completion", split="test")) == ["held out"]
    with pytest.raises(DataError, match="has no split 'validation'; set split: to one of train, test"):
        texts(DatasetSpec(str(both), "completion", split="validation"))


def test_directory_reads_data_files_recursively_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", [{"text": "c"}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    (tmp_path / "README.md").write_text("not data")
    assert texts(DatasetSpec(str(tmp_path), "completion")) == ["a", "b", "c"]


def test_an_existing_path_with_glob_characters_is_taken_literally(tmp_path):
    write_jsonl(tmp_path / "data[1].jsonl", [{"text": "literal"}])
    assert texts(DatasetSpec(str(tmp_path / "data[1].jsonl"), "completion")) == ["literal"]


def test_text_files_each_file_one_document_from_directory_and_glob(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n")
    (tmp_path / "docs" / "a.txt").write_bytes("\ufeffa with BOM\n".encode())  # the BOM is not content
    (tmp_path / "docs" / "c.py").write_text("print('c')\n")
    (tmp_path / "docs" / ".hidden").write_text("skipped")
    records = list(read_records(DatasetSpec(str(tmp_path / "docs"), "pretrain_files")))
    assert [r.text for r in records] == ["a with BOM\n", "# B\n", "print('c')\n"]
    assert all(isinstance(r, TextRecord) for r in records)
    assert texts(DatasetSpec(str(tmp_path / "docs" / "*.md"), "text_files")) == ["# B\n"]


def test_alpaca_records_with_and_without_input(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"instruction": "add", "input": "1 1", "output": "2"},
            {"instruction": "greet", "output": "hi"},
            {"instruction": "greet", "input": None, "output": "hi"},
        ],
    )
    records = list(read_records(DatasetSpec(str(path), "alpaca")))
    assert records[0] == InstructionRecord("add", "1 1", "2", f"{path} line 1")
    assert [r.input for r in records[1:]] == ["", ""]


def test_chat_messages_and_sharegpt_conversations(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a"},
                ]
            },
        ],
    )
    first, second = read_records(DatasetSpec(str(path), "chat"))
    assert isinstance(first, ChatRecord)
    assert first.messages == ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant"]


# --- errors: one line each, naming the file / record / setting and the fix ---------------------------------


def bad_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))  # é is 0xe9 at byte offset 3
    return DatasetSpec(str(path), "pretrain_files")


ERRORS = [
    (
        "missing file",
        lambda p: DatasetSpec(str(p / "nope.jsonl"), "completion"),
        r"nope\.jsonl' does not exist .*; fix path:",
    ),
    (
        "empty file",
        lambda p: DatasetSpec(str(write_jsonl(p / "e.jsonl", [])), "completion"),
        r"e\.jsonl holds no records \(for split=None\); fix path: or split:, or add data",
    ),
    (
        "no matching files",
        lambda p: DatasetSpec(str(p / "*.parquet"), "completion"),
        r"no file matches path='.*\*\.parquet'",
    ),
    ("empty directory", lambda p: DatasetSpec(str(p), "completion"), r"holds no \*\.jsonl, \*\.json"),
    (
        "missing text field",
        lambda p: DatasetSpec(str(write_jsonl(p / "m.jsonl", [{"text": "ok"}, {"body": "x"}])), "completion"),
        r"m\.jsonl line 2: no field 'text' \(fields: body\); set field: to the column holding the text",
    ),
    (
        "wrong field type",
        lambda p: DatasetSpec(str(write_jsonl(p / "w.jsonl", [{"text": 5}])), "completion"),
        r"w\.jsonl line 1: field 'text' holds int, not a string; set field:",
    ),
    (
        "alpaca without output",
        lambda p: DatasetSpec(str(write_jsonl(p / "a.jsonl", [{"instruction": "x"}])), "alpaca"),
        r"a\.jsonl line 1: no field 'output' .*alpaca records need instruction, output",
    ),
    (
        "chat without messages",
        lambda p: DatasetSpec(str(write_jsonl(p / "c.jsonl", [{"text": "x"}])), "chat"),
        r"c\.jsonl line 1: no field 'messages' \(fields: text\); set field:",
    ),
    (
        "chat message not a dict",
        lambda p: DatasetSpec(str(write_jsonl(p / "c.jsonl", [{"messages": ["hi"]}])), "chat"),
        r"message 1 of 'messages': expected \{role, content\} or \{from, value\}, found str",
    ),
    (
        "unknown sharegpt speaker",
        lambda p: DatasetSpec(
            str(write_jsonl(p / "s.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])), "chat"
        ),
        r"from='bot' is not a ShareGPT speaker; use one of human",
    ),
    (
        "record not an object",
        lambda p: DatasetSpec(str(write_jsonl(p / "l.jsonl", [[1, 2]])), "completion"),
        r"l\.jsonl line 1: a record must be a JSON object",
    ),
    (
        "invalid json line",
        lambda p: (
            p.joinpath("j.jsonl").write_text('{"text": "a"}\n{oops\n'),
            DatasetSpec(str(p / "j.jsonl"), "completion"),
        )[1],
        r"j\.jsonl line 2: not valid JSON",
    ),
    (
        "non-UTF-8 text file",
        bad_utf8,
        r"latin1\.txt: not UTF-8 text \(byte 0xe9 at byte offset 3\); re-encode it as UTF-8 .* or remove it",
    ),
    (
        "text file given as records",
        lambda p: (p.joinpath("t.txt").write_text("x"), DatasetSpec(str(p / "t.txt"), "completion"))[1],
        r"not '\.txt' files; convert it, or use type: pretrain_files",
    ),
]


@pytest.mark.parametrize("build, message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_are_one_line_and_say_what_to_fix(tmp_path, build, message):
    with pytest.raises(DataError, match=message) as caught:
        list(read_records(build(tmp_path)))
    assert "\n" not in str(caught.value)


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    pq.write_table(pa.Table.from_pylist(TEXTS), tmp_path / "a.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now fails as if it were not installed
    with pytest.raises(
        DataError, match=r"a\.parquet: reading \.parquet data needs pyarrow; pip install 'ndparallel\[data\]'"
    ):
        list(read_records(DatasetSpec(str(tmp_path / "a.parquet"), "completion")))


def test_the_readme_names_the_data_extra_and_pyproject_has_it():
    """Parquet hub datasets need pyarrow: the README says which extra installs it, and that extra exists."""
    import tomllib

    root = REPO
    assert "pip install 'ndparallel[data]'" in (root / "README.md").read_text()
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("pyarrow") for requirement in extras["data"])


def test_unknown_type_lists_the_valid_ones():
    with pytest.raises(
        DataError,
        match=r"type='sharegpt' is not a dataset type; use one of: completion, alpaca, "
        r"chat_template, pretrain_files, text \(= completion\)",
    ):
        DatasetSpec("x.jsonl", "sharegpt")


def test_spec_from_dict_rejects_unknown_and_missing_keys():
    assert DatasetSpec.from_dict({"path": "x.jsonl", "type": "chat"}).kind == "chat_template"
    with pytest.raises(
        DataError, match="unknown setting.* feild; a dataset entry takes .*field, max_record_bytes, name, path"
    ):
        DatasetSpec.from_dict({"path": "x.jsonl", "type": "text", "feild": "body"})
    with pytest.raises(DataError, match="missing type; every dataset entry needs path: and type:"):
        DatasetSpec.from_dict({"path": "x.jsonl"})


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.gz"])
def test_a_record_over_the_limit_is_refused_before_it_is_held_in_memory(tmp_path, name):
    import gzip
    import tracemalloc

    line = b'{"text": "' + b"a" * (48 * 2**20) + b'"}\n'
    path = tmp_path / name
    with gzip.open(path, "wb", compresslevel=1) if name.endswith(".gz") else open(path, "wb") as f:
        f.write(b'{"text": "short"}\n' + line)  # the .gz is a few hundred KB: decompressed whole it was 48 MiB
    del line
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=rf"{name} line 2: the record is larger than dataset_max_record_mb=1 MiB"):
            list(read_records(DatasetSpec(str(path), "completion", max_record_bytes=2**20)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB held while reading"


def test_a_json_line_nested_too_deeply_is_one_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
    with pytest.raises(DataError, match=r"deep\.jsonl line 1: JSON nested too deeply to read"):
        list(read_records(DatasetSpec(str(path), "completion")))
