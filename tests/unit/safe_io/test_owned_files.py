"""Writes that never follow planted links, manifests of what ndparallel wrote, names kept inside their directory."""

from __future__ import annotations

import os

import pytest

from ndparallel.errors import OutputError
from ndparallel.safe_io import file_names, owned_files


def test_write_atomic_replaces_links_and_never_writes_through_them(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "latest.tmp").symlink_to(victim)  # a stale temporary that is a link
    (tmp_path / "latest").symlink_to(victim)  # the name itself a link: replaced, not followed
    owned_files.write_atomic(tmp_path / "latest", "step-2")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "latest").is_symlink() and (tmp_path / "latest").read_text() == "step-2"
    assert not os.path.lexists(tmp_path / "latest.tmp")


def test_open_append_refuses_a_link_and_a_fifo(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OutputError, match=r"metrics\.jsonl' is a symbolic link, not a regular file"):
        owned_files.open_append(tmp_path / "metrics.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")  # opening it for writing would block without a reader
    with pytest.raises(OutputError, match=r"fifo\.jsonl' is something else"):
        owned_files.open_append(tmp_path / "fifo.jsonl")
    assert victim.read_text() == "precious"


def test_clear_written_deletes_exactly_the_files_of_the_manifest(tmp_path):
    out = tmp_path / "hf"
    (out / "sub" / "deeper").mkdir(parents=True)
    for name in ("config.json", "sub/a.jinja", "sub/deeper/b.jinja"):
        (out / name).write_text("x")
    owned_files.mark_written(out)
    assert owned_files.foreign_files(out) == []
    (out / "notes.md").write_text("mine")
    assert owned_files.foreign_files(out) == ["notes.md"]
    with pytest.raises(OutputError, match=r"holds files ndparallel did not write \('notes\.md'"):
        owned_files.clear_written(out)
    assert (out / "notes.md").read_text() == "mine" and (out / "config.json").exists()
    (out / "notes.md").unlink()
    owned_files.clear_written(out)
    assert not out.exists()


def test_a_directory_without_a_manifest_or_through_a_link_is_foreign(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_text("someone's")
    assert owned_files.foreign_files(mine) == ["model.safetensors"]
    (tmp_path / "hf").symlink_to(mine)
    with pytest.raises(OutputError, match="is a symbolic link, not a directory"):
        owned_files.foreign_files(tmp_path / "hf")
    assert owned_files.foreign_files(tmp_path / "absent") == []


@pytest.mark.parametrize(
    "name, ok",
    [
        ("model-00001-of-00002.safetensors", True),
        ("sub/data.arrow", True),
        ("../outside.safetensors", False),
        ("sub/../../x", False),
        ("/etc/passwd", False),
        ("", False),
        (7, False),
        ("a\\..\\..\\x", False),
    ],
)
def test_names_from_files_stay_inside_their_directory(tmp_path, name, ok):
    assert (file_names.inside(tmp_path, name) is not None) == ok
