"""Crafted files given to the command line: names that leave their directory, tokenizer folders carrying code,
adapter settings that would hang or exhaust the host. Each is one line naming the file, never a hang."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from trainer_helpers import run_train, tiny_config

from ndparallel.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A one-rank run's output_dir (its latest checkpoint is what export reads)."""
    tmp = tmp_path_factory.mktemp("trained")
    run_train(1, tiny_config(tmp, max_steps=1))
    return Path(tmp / "out")


def _checkpoint_copy(output_dir: Path, tmp: Path) -> Path:
    source = output_dir / "checkpoints" / (output_dir / "checkpoints" / "latest").read_text()
    copy = tmp / "crafted" / "step-1"
    shutil.copytree(source, copy)
    return copy


def _error(capsys) -> str:
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ndparallel: error:")]
    return line


def test_export_copies_only_the_tokenizer_files_transformers_writes(trained, tmp_path, capsys):
    ckpt = _checkpoint_copy(trained, tmp_path)
    tokenizer = ckpt / "tokenizer"
    (tokenizer / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "evil.Model"}}))
    (tokenizer / "evil.py").write_text("import os\nos.system('touch pwned')\n")
    (tokenizer / "model.safetensors").write_text("not the weights")
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), str(out), "--dtype", "float32"]) == 0, capsys.readouterr().err
    assert not (out / "evil.py").exists()
    assert "auto_map" not in (out / "config.json").read_text()
    assert (out / "model.safetensors").read_bytes() != b"not the weights"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
