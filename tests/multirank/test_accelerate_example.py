"""The port of Accelerate's nd_parallel.py example (examples/accelerate_nd_parallel.py) on CPU ranks: every
layout gives the one-process losses on packed documents, and a checkpoint resumes on another layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from support.scenarios import make_model, max_rel_diff
from transformers import AutoModelForCausalLM

from ndparallel.data.load_tokenizer import byte_tokenizer
from ndparallel.testing.ranks import run_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_nd_parallel.py"


def _example():
    spec = importlib.util.spec_from_file_location("accelerate_nd_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(argv: list[str]) -> list[float]:
    example = _example()
    return example.train(example.parse_args(argv))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    make_model("llama", seed=4, vocab_size=320).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _argv(model_dir: Path, out: Path, steps: int, *sizes: str, **extra: str) -> list[str]:
    argv = [
        "--model-name",
        str(model_dir),
        "--save-dir",
        str(out),
        "--num-steps",
        str(steps),
        "--sequence-length",
        "64",
        "--global-batch-size",
        "4",
        "--lr",
        "0.05",
        "--checkpoint-frequency",
        "2",
        *sizes,
    ]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", value]
    return argv


def test_layouts_give_the_one_process_losses_and_resume_elsewhere(model_dir, tmp_path):
    single = run_ranks(1, _run, _argv(model_dir, tmp_path / "one", 4))[0]
    assert single[-1] < single[0]
    layout = ["--dp-shard-size", "2", "--cp-size", "2", "--cp-comm-strategy", "ring"]
    parallel = run_ranks(4, _run, _argv(model_dir, tmp_path / "cp", 4, *layout))[0]
    assert max_rel_diff(parallel, single) < 1e-5, (parallel, single)
    # steps 3-4 again, from the step-2 checkpoint of the cp run, on a tp x plain-replica layout
    resumed = run_ranks(
        4,
        _run,
        _argv(
            model_dir,
            tmp_path / "tp",
            4,
            "--dp-replicate-size",
            "2",
            "--tp-size",
            "2",
            "--dp-shard-size",
            "1",
            resume_from=str(tmp_path / "cp" / "checkpoints" / "step-2"),
        ),
    )[0]
    assert max_rel_diff(resumed, single[2:]) < 1e-5, (resumed, single[2:])
    # the exported model is the trained one (bf16 export of fp32 weights)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "final", dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final", dtype=torch.float32)
    for name, value in trained.state_dict().items():
        assert torch.allclose(exported.state_dict()[name], value, rtol=1e-2, atol=1e-3), name
