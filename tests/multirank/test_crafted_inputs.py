"""Crafted files given to the command line: names that leave their directory, tokenizer folders carrying code,
adapter settings that would hang or exhaust the host. Each is one line naming the file, never a hang."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from support.trainer_helpers import cli_train, error_lines, run_train, tiny_config, write_corpus

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


@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trained_lora")
    run_train(1, tiny_config(tmp, max_steps=1, adapter="lora", lora_r=4, lora_target_modules=["q_proj", "v_proj"]))
    return Path(tmp / "out")


def _edit_lora(ckpt: Path, **changes) -> None:
    extra = json.loads((ckpt / "extra.json").read_text())
    extra["lora"].update(changes)
    (ckpt / "extra.json").write_text(json.dumps(extra))


def test_export_bounds_the_time_a_target_regex_from_a_checkpoint_takes(trained_lora, tmp_path, capsys, monkeypatch):
    from ndparallel.safe_io import bounded_regex

    monkeypatch.setattr(bounded_regex, "TIMEOUT_S", 2.0)
    ckpt = _checkpoint_copy(trained_lora, tmp_path)
    _edit_lora(ckpt, target_modules=[], target_regex="(.*)*(.*)*X")  # backtracks for ages on every module name
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    line = _error(capsys)
    assert "extra.json" in line and "(.*)*(.*)*X" in line and "simplify the pattern" in line


def test_export_refuses_a_lora_rank_its_tensors_do_not_have(trained_lora, tmp_path, capsys):
    ckpt = _checkpoint_copy(trained_lora, tmp_path)
    _edit_lora(ckpt, r=10**12)  # the model would be built with adapters of that rank
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    assert "r=1000000000000" in _error(capsys)
    _edit_lora(ckpt, r=8)
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    assert "says r=8, but the checkpoint's adapter tensors have rank [4]" in _error(capsys)


def _base_model_outside(tmp: Path) -> Path:
    """A model directory whose index maps every weight to a file beside (outside) it."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndparallel.models.presets import PRESETS

    model = LlamaForCausalLM(LlamaConfig(**{**PRESETS["tiny"], "vocab_size": 320}))
    directory = tmp / "model"
    model.config.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, tmp / "outside.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {key: "../outside.safetensors" for key in state}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_a_weight_map_entry_outside_the_model_directory_is_refused(tmp_path):
    config = tiny_config(tmp_path, max_steps=1, base_model=str(_base_model_outside(tmp_path)))
    del config["model_shape"], config["model_config_overrides"]
    code, err = cli_train(tmp_path, config)
    assert code == 2, err[-2000:]
    [line] = error_lines(err)
    assert "'../outside.safetensors', which is not a file name inside the model directory" in line


def test_a_saved_dataset_listing_a_file_outside_it_is_refused(tmp_path):
    import pyarrow as pa

    table = pa.Table.from_pylist([{"text": "a secret of someone else"}] * 64)
    with pa.OSFile(str(tmp_path / "outside.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../outside.arrow"}]}))
    config = {**tiny_config(tmp_path, max_steps=1), "datasets": [{"path": str(saved), "type": "completion"}]}
    code, err = cli_train(tmp_path, config)
    assert code == 2, err[-2000:]
    [line] = error_lines(err)
    assert "lists '../outside.arrow', which is not a file name inside" in line


def test_a_record_over_dataset_max_record_mb_is_one_line_naming_it(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * (3 * 2**20)}) + "\n")
    config = tiny_config(tmp_path, max_steps=1, dataset_max_record_mb=1)
    config["datasets"] = [{"path": str(data), "type": "completion"}]
    code, err = cli_train(tmp_path, config)
    assert code == 2, err[-2000:]
    [line] = error_lines(err)
    assert "long.jsonl line 2: the record is larger than dataset_max_record_mb=1 MiB" in line


def _yaml_config(tmp: Path, text: str) -> Path:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp)) + text)
    return path


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_yaml_alias_bomb_is_refused_before_anything_starts(tmp_path, capsys, command):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 values written out
    path = _yaml_config(
        tmp_path, "model_config_overrides:\n  vocab_size: 320\n  bomb:\n" + "".join(f"    {line}\n" for line in levels)
    )
    assert main([command, str(path)]) == 2
    assert "expands through its aliases" in capsys.readouterr().err


def test_deeply_nested_yaml_is_one_line(tmp_path, capsys):
    path = _yaml_config(tmp_path, "model_config_overrides: " + "[" * 20000 + "]" * 20000 + "\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nested too deeply" in err and "Traceback" not in err


def test_a_glob_through_a_symlink_loop_ends(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data)
    (data / "loop1").symlink_to(data)  # two loops: glob's ** walked 2**40 paths
    (data / "loop2").symlink_to(data)
    config = {**tiny_config(tmp_path, max_steps=1), "datasets": [{"path": f"{data}/**/*.jsonl", "type": "completion"}]}
    code, err = cli_train(tmp_path, config)
    assert code == 0, err[-2000:]


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("sequence_len", 10**9, "sequence_len: Input should be less than or equal to 16777216"),
        ("micro_batch_size", 10**12, "micro_batch_size: Input should be less than or equal to 65536"),
        ("lora_r", 10**9, "lora_r: Input should be less than or equal to 65536"),
    ],
)
def test_validate_refuses_absurd_sizes(tmp_path, capsys, setting, value, message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**tiny_config(tmp_path), setting: value}))
    assert main(["validate", str(config)]) == 2
    assert message in capsys.readouterr().err
