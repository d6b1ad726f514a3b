"""The ``ndparallel`` command: validate, and train through its own launcher (real processes, ``launch.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.scenarios import max_rel_diff
from support.trainer_helpers import layout_config, losses, run_train, tiny_config
from transformers import LlamaConfig

from ndparallel.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _fake_8b(tmp: Path) -> Path:
    """A directory with the config (no weights) of an 8B Llama: enough for validate."""
    from ndparallel.data.load_tokenizer import byte_tokenizer

    path = tmp / "llama-8b"
    LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
    ).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)  # validate loads the tokenizer, as train would
    return path


RECORDS = {
    "completion": {"text": "hi"},
    "alpaca": {"instruction": "Say hi.", "output": "hi"},
    "chat_template": {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
}


@pytest.mark.parametrize(
    "example, world",
    [
        ("llama-8b-finetune-fsdp-tp-cp.yaml", 8),
        ("hsdp-tp-multinode.yaml", 16),
        ("long-context-128k-cp.yaml", 8),
        ("lora-8b-2x2x2.yaml", 8),
    ],
)
def test_examples_validate(tmp_path, capsys, example, world):
    model = _fake_8b(tmp_path)
    raw = yaml.safe_load((EXAMPLES / example).read_text())
    sets = []
    for i, dataset in enumerate(raw["datasets"]):  # one record of the dataset's type (validate samples them)
        data = tmp_path / f"data{i}.jsonl"
        data.write_text(json.dumps(RECORDS[dataset["type"]]) + "\n")
        sets.append(f"datasets.{i}.path={data}")
    sets += [f"base_model={model}"] if "base_model" in raw else [f"tokenizer_config={model}"]
    code = main(
        ["validate", str(EXAMPLES / example), "--world-size", str(world), *sum((["--set", s] for s in sets), [])]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"config OK for {world} process(es)" in out.out
    assert "rank 0: (r0, s0, c0, t0)" in out.out


def test_validate_reports_every_problem(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "model_shape": "tiny",
                "datasets": [{"path": "nowhere.jsonl"}],
                "learnig_rate": 1e-4,
                "micro_batch_size": 0,
            }
        )
    )
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    # the config's mistakes, then (with defaults in their place) the model's and the data's
    assert "4 problem(s)" in err and "did you mean 'learning_rate'" in err and "micro_batch_size" in err
    assert "the tokenizer has 262 tokens but the model's vocab_size is 256" in err
    assert "datasets[0].path 'nowhere.jsonl' matches no file or directory" in err


def test_validate_checks_the_layout_against_the_model(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg.write_text(
        yaml.safe_dump(
            {"model_shape": "tiny", "datasets": [{"path": str(data)}], "tensor_parallel_size": 3, "dp_shard_size": 1}
        )
    )
    assert main(["validate", str(cfg), "--world-size", "3"]) == 2
    assert "tp_size=3 does not divide the model's attention heads (num_attention_heads=8)" in capsys.readouterr().err


def _cli(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "ndparallel_cli", *args],  # the console script's module
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_train_launches_its_own_processes_and_matches_one_process(tmp_path):
    config = tiny_config(tmp_path, max_steps=4)
    single = run_train(1, {**config, "output_dir": str(tmp_path / "single")})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(layout_config(config, s=2, t=2)))
    done = _cli(["train", str(path), "--set", f"output_dir={tmp_path / 'cli'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert max_rel_diff(losses(records), losses(single)) < 1e-5
    assert "Traceback" not in done.stderr
    # what a newcomer sees: the layout and the run first, every setup phase with its time, plain progress lines
    # with percentage and ETA, then steady-state speed apart from the wall time; no other library's warnings
    out = done.stdout
    for expected in (
        "world 4 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 2",
        "run: lr 0.003 (cosine, warm-up 2 steps); batch 8 rows x 64 tokens per step",
        "setup 2/5: tokenizing and packing the data",
        "setup 4/5: initializing the weights at random",
        "setup 5/5: done in ",
        "step 1: first step done in ",
        "step 2/4 (50%) loss ",
        "ETA ",
        "steady state (",
        "wall time ",
    ):
        assert expected in out, (expected, out[-3000:])
    assert out.index("run: lr") < out.index("setup 2/5") < out.index("setup 5/5: done") < out.index("step 1/4")
    assert out.count("setup 2/5: done in") == 1  # rank 0 only
    assert "_pytree" not in done.stderr and "Failed to load" not in done.stderr


@pytest.mark.slow
def test_a_user_error_in_the_workers_is_one_line_and_exit_2(tmp_path):
    config = layout_config(tiny_config(tmp_path), s=1, t=2)
    config["model_config_overrides"] = {"vocab_size": 320, "num_key_value_heads": 1}  # tp 2 cannot split 1 KV head
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    done = _cli(["train", str(path)], tmp_path)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("ndparallel: error:")]
    assert len(errors) == 1 and "num_key_value_heads=1" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()
