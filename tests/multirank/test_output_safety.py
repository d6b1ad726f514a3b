"""An output directory others could have prepared (a copied run, a shared folder): planted links never
redirect a write, and a run deletes only what ndparallel wrote (``overwrite_output_dir`` keeps the
earlier checkpoints it promises to keep; ``output_dir/hf`` holding someone's files is refused, not removed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from support.trainer_helpers import cli_train, error_lines, tiny_config

from ndparallel.safe_io.owned_files import MANIFEST


def test_links_planted_in_the_checkpoint_directory_are_not_written_through(tmp_path):
    config = tiny_config(tmp_path, max_steps=2, save_steps=1)
    root = Path(config["output_dir"]) / "checkpoints"
    root.mkdir(parents=True)
    victim_file = tmp_path / "notes.txt"
    victim_file.write_text("precious")
    victim_dir = tmp_path / "photos"
    victim_dir.mkdir()
    (victim_dir / "a.jpg").write_text("jpeg")
    (root / "latest.tmp").symlink_to(victim_file)  # the next write of `latest` went through it
    (root / ".partial-step-1").symlink_to(victim_dir)  # the first save was written into photos/

    code, err = cli_train(tmp_path, config)
    assert code == 0, err[-2000:]
    assert victim_file.read_text() == "precious"
    assert sorted(p.name for p in victim_dir.iterdir()) == ["a.jpg"] and (victim_dir / "a.jpg").read_text() == "jpeg"
    assert (root / "latest").read_text() == "step-2" and not (root / "latest").is_symlink()
    assert all(not p.is_symlink() for p in root.iterdir())


def test_a_link_at_metrics_jsonl_is_refused_with_one_line(tmp_path):
    config = tiny_config(tmp_path, max_steps=1)
    out = Path(config["output_dir"])
    out.mkdir()
    victim = tmp_path / "diary.txt"
    victim.write_text("precious\n")
    (out / "metrics.jsonl").symlink_to(victim)
    code, err = cli_train(tmp_path, config)
    assert code == 2 and victim.read_text() == "precious\n"
    [line] = error_lines(err)
    assert "metrics.jsonl" in line and "symbolic link" in line


def test_overwrite_output_dir_keeps_earlier_checkpoints_and_files_it_did_not_write(tmp_path):
    config = tiny_config(tmp_path, max_steps=2, save_steps=1, export_hf=True)
    out = Path(config["output_dir"])
    root = out / "checkpoints"
    code, err = cli_train(tmp_path, config)  # an earlier run: step-1, step-2 and its export
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-1", "step-2"]
    assert (out / "hf" / MANIFEST).is_file()
    # Someone's directory named like a checkpoint, saved "later": it must neither count towards the limit nor go.
    planted = root / "step-100"
    planted.mkdir()
    (planted / "COMPLETE").write_text("")
    (planted / "mine.txt").write_text("mine")
    os.utime(planted / "COMPLETE", (time.time() + 3600,) * 2)

    rerun = {**config, "overwrite_output_dir": True, "save_total_limit": 1}
    code, err = cli_train(tmp_path, rerun)
    assert code == 0, err[-2000:]
    names = sorted(p.name for p in root.glob("step-*"))
    assert names == ["step-1", "step-100", "step-2", "step-2-r1"], names  # the earlier run's are kept
    assert (planted / "mine.txt").read_text() == "mine"
    assert (root / "latest").read_text() == "step-2-r1"
    assert (out / "hf" / "config.json").is_file()  # the earlier export (ndparallel's) was replaced

    (out / "hf" / "my-notes.md").write_text("mine")  # now hf holds a file ndparallel did not write
    code, err = cli_train(tmp_path, rerun)
    assert code == 2 and (out / "hf" / "my-notes.md").read_text() == "mine"
    [line] = error_lines(err)
    assert "did not write" in line and "my-notes.md" in line


def test_overwrite_output_dir_never_deletes_a_foreign_hf_directory(tmp_path):
    """`--set output_dir=$HOME` with the defaults' export_hf + overwrite_output_dir deleted ~/hf."""
    config = tiny_config(tmp_path, max_steps=1, export_hf=True, overwrite_output_dir=True)
    home_hf = Path(config["output_dir"]) / "hf"
    home_hf.mkdir(parents=True)
    (home_hf / "model.safetensors").write_text("someone's model")
    code, err = cli_train(tmp_path, config)
    assert code == 2 and (home_hf / "model.safetensors").read_text() == "someone's model"
    [line] = error_lines(err)
    assert "hf" in line and "did not write" in line and "model.safetensors" in line
