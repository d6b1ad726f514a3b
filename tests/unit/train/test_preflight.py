"""What train refused 13-35 s after starting (after queueing and downloads on a cluster) is one line and exit 2
from ``validate``, and from ``train`` before any process starts. In-process CLI calls; no worker processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from ndparallel import cli


@pytest.fixture
def no_launch(monkeypatch):
    """train must stop before its launcher starts processes."""

    def launched(*_args, **_kwargs):
        raise AssertionError("train started processes despite a problem its checks can see")

    monkeypatch.setattr(cli, "_launch", launched)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def write_config(tmp: Path, data: Path, **settings) -> Path:
    config = {
        "model_shape": "tiny",
        "model_config_overrides": {"vocab_size": 320},
        "tokenizer_config": "byte",
        "datasets": [{"path": str(data), "type": "completion"}],
        "sequence_len": 64,
        "output_dir": str(tmp / "out"),
        "dataset_prepared_path": str(tmp / "prepared"),
        **settings,
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def texts(tmp: Path, *lengths: int) -> Path:
    path = tmp / "data.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    return path


def errors_of(capsys) -> list[str]:
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.strip() and not line.endswith("problem(s):")]


def run_both(config: Path, capsys) -> tuple[list[str], list[str]]:
    """(validate's problem lines, train's error lines); both exit 2."""
    assert cli.main(["validate", str(config)]) == 2
    validate = errors_of(capsys)
    assert cli.main(["train", str(config)]) == 2
    return validate, errors_of(capsys)


def test_empty_data_file(tmp_path, capsys, no_launch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    validate, train = run_both(write_config(tmp_path, empty), capsys)
    assert len(validate) == 1 and len(train) == 1
    assert "datasets[0]" in validate[0] and "empty.jsonl holds no records" in validate[0]
    assert "holds no records" in train[0]


def test_binary_file_given_as_jsonl(tmp_path, capsys, no_launch):
    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    validate, train = run_both(write_config(tmp_path, binary), capsys)
    assert len(validate) == 1 and len(train) == 1
    assert "weights.jsonl: a binary file (a NUL byte at offset 8), not .jsonl text" in validate[0]
    assert "a binary file" in train[0]


def test_every_example_longer_than_sequence_len(tmp_path, capsys, no_launch):
    validate, train = run_both(write_config(tmp_path, texts(tmp_path, 300, 500, 400)), capsys)
    assert len(validate) == 1 and len(train) == 1
    assert "no sampled example fits" in validate[0] and "sequence_len=64" in validate[0]
    assert "excess_length_strategy: truncate or split" in train[0]


def test_long_examples_refused_by_long_rows_error(tmp_path, capsys, no_launch):
    config = write_config(tmp_path, texts(tmp_path, 10, 500), excess_length_strategy="raise")
    validate, _ = run_both(config, capsys)
    assert "1 of the first 2 examples" in validate[0] and "long_rows: error refuses them" in validate[0]


def test_output_dir_under_a_regular_file(tmp_path, capsys, no_launch):
    blocker = tmp_path / "results"
    blocker.write_text("a file where a directory should be")
    config = write_config(tmp_path, texts(tmp_path, 10, 20), output_dir=str(blocker / "run1"))
    validate, train = run_both(config, capsys)
    assert len(validate) == 1 and len(train) == 1
    assert f"output_dir '{blocker / 'run1'}' lies under '{blocker}', which is a regular file" in validate[0]
    assert "which is a regular file" in train[0]


def test_output_dir_not_writable(tmp_path, capsys, no_launch):
    if os.geteuid() == 0:
        target = Path("/sys/ndparallel-out")  # root may write anywhere else; sysfs refuses new directories
        if not Path("/sys").is_dir():
            pytest.skip("no directory that root cannot write")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "out"
    validate, train = run_both(write_config(tmp_path, texts(tmp_path, 10, 20), output_dir=str(target)), capsys)
    assert len(validate) == 1 and len(train) == 1
    assert f"output_dir '{target}' cannot be written" in validate[0] and "choose another output_dir" in validate[0]


def test_output_dir_that_holds_checkpoints(tmp_path, capsys, no_launch):
    (tmp_path / "out" / "checkpoints" / "step-4").mkdir(parents=True)
    validate, train = run_both(write_config(tmp_path, texts(tmp_path, 10, 20)), capsys)
    assert len(validate) == 1 and len(train) == 1
    assert "already holds checkpoints; resume with resume_from_checkpoint: latest" in validate[0]


def test_validate_says_what_it_did_not_check(tmp_path, capsys):
    assert cli.main(["validate", str(write_config(tmp_path, texts(tmp_path, 10, 20)))]) == 0
    out = capsys.readouterr().out
    assert "not checked here: the data beyond each dataset's first records (train reads it all)" in out


def test_a_folder_whose_first_files_are_long_is_not_refused(tmp_path, capsys, no_launch):
    """A folder of documents sampled by its first files: when none of those fits, later ones still may (the
    GPU smoke's Python sources, sorted by name, began with a long file). A note, not a refusal."""
    from ndparallel.data.files import HEAD_BYTES

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a_long.txt").write_text("x" * (HEAD_BYTES + 100))
    (folder / "b_short.txt").write_text("short")
    config = write_config(tmp_path, folder / "*.txt")
    settings = yaml.safe_load(config.read_text())
    settings["datasets"] = [{"path": str(folder / "*.txt"), "type": "pretrain_files"}]
    config.write_text(yaml.safe_dump(settings))
    assert cli.main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert "none of the first 1 examples" in out and "no sampled example fits" not in out
    with pytest.raises(AssertionError, match="train started processes"):  # train's checks let it launch
        cli.main(["train", str(config)])


def test_a_folder_read_whole_whose_files_are_all_long_is_refused(tmp_path, capsys, no_launch):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text("x" * 500)
    config = write_config(tmp_path, folder / "*.txt")
    settings = yaml.safe_load(config.read_text())
    settings["datasets"] = [{"path": str(folder / "*.txt"), "type": "pretrain_files"}]
    config.write_text(yaml.safe_dump(settings))
    validate, _ = run_both(config, capsys)
    assert "all 2 are longer than sequence_len=64" in validate[0] and "train would stop with no data" in validate[0]
