"""Axolotl's own example configs, as their users wrote them (tests/fixtures/axolotl, verbatim): each one
validates, or is refused with one line naming the setting that changes the result; the two ND-parallel ones
train on 8 CPU ranks like one process. Hub ids (``Qwen/Qwen3-8B``, ``tatsu-lab/alpaca``) load from a hub cache
the test builds, offline.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from harness import run_ranks
from hub_cache import add_dataset, add_model, alpaca_records
from ndparallel.cli import main
from scenarios import make_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "axolotl" / "examples"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HOME with an empty hub cache, HF_HUB_OFFLINE=1, and the working directory a fresh folder (the
    configs write outputs/ and last_run_prepared/ relative to it)."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


def _train_in_rank(config_path: str, extra: list[str]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["train", config_path, *extra])
    return code, err.getvalue(), out.getvalue()


def _sets(**values) -> list[str]:
    return [item for key, value in values.items() for item in ("--set", f"{key}={value}")]


# A tiny model of the config's family under the config's hub id. Shapes: tp 2 and cp 2 divide them.
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)


@pytest.mark.slow
@pytest.mark.parametrize("name, repo, family, sizes, data_ranks", [
    ("qwen3-8b-fsdp-tp-cp.yaml", "Qwen/Qwen3-8B", "qwen3", {}, 2),
    # written for 16 GPUs (dp_replicate 2 x dp_shard 4 x tp 2): run on 8 ranks with dp_shard 2
    ("llama-3_1-8b-hsdp-tp.yaml", "meta-llama/Llama-3.1-8B", "llama", {"dp_shard_size": 2}, 4),
])
def test_distributed_parallel_configs_train_like_one_process(offline_hub, name, repo, family, sizes, data_ranks):
    model = make_model(family, seed=3, **TINY)
    add_model(offline_hub, repo, model.config, family, model=model)
    add_dataset(offline_hub, "tatsu-lab/alpaca", {"data/train-00000-of-00001.parquet": alpaca_records(48)})
    config = str(FIXTURES / "distributed-parallel" / name)
    # CPU-sized run: short rows, fp32 (for the 1e-5 comparison), 3 steps, a checkpoint after step 2 and 3.
    common = dict(sequence_len=320, bf16="false", max_steps=3)
    results = run_ranks(8, _train_in_rank, config, _sets(**common, **sizes), timeout_s=400, pg_timeout_s=300)
    code, err, out = results[0]
    assert code == 0, err[-3000:]
    assert all(r[0] == 0 for r in results), [r[1][-500:] for r in results if r[0]]
    assert "not used: attn_implementation" in out and "plugins: CutCrossEntropyPlugin" in out
    parallel = _records("outputs/ndp-out")
    # one process reading the same global batch: micro_batch_size = the layout's data-parallel ranks
    single = run_ranks(1, _train_in_rank, config, _sets(**common, dp_shard_size=1, dp_replicate_size=1,
                                                        tensor_parallel_size=1, context_parallel_size=1,
                                                        micro_batch_size=data_ranks, output_dir="single"),
                       timeout_s=300)
    assert single[0][0] == 0, single[0][1][-3000:]
    reference = _records("single")
    assert [r["step"] for r in parallel] == [1, 2, 3]
    for ours, theirs in zip(parallel, reference):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-5), (parallel, reference)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-6)
    # warmup_ratio 0.1 of 3 steps = 0 warm-up steps; constant_with_warmup: the full rate from the start
    assert parallel[0]["lr"] == pytest.approx(2e-6)
    saved = sorted(p.name for p in Path("outputs/ndp-out/checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-2", "step-3"]  # saves_per_epoch: 1 of num_epochs: 2 -> every ceil(3 / 2) steps


def _records(output_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
