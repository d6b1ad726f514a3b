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

import pyarrow
import pytest
import yaml
from support.hub_cache import add_dataset, add_model, alpaca_records, chat_records, family_tokenizer
from support.scenarios import make_model

from ndparallel.cli import main
from ndparallel.testing.ranks import run_ranks

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
@pytest.mark.parametrize(
    "name, repo, family, sizes, data_ranks",
    [
        ("qwen3-8b-fsdp-tp-cp.yaml", "Qwen/Qwen3-8B", "qwen3", {}, 2),
        # written for 16 GPUs (dp_replicate 2 x dp_shard 4 x tp 2): run on 8 ranks with dp_shard 2
        ("llama-3_1-8b-hsdp-tp.yaml", "meta-llama/Llama-3.1-8B", "llama", {"dp_shard_size": 2}, 4),
    ],
)
def test_distributed_parallel_configs_train_like_one_process(offline_hub, name, repo, family, sizes, data_ranks):
    # The Llama config's special_tokens (pad_token: <|end_of_text|>) name a token this tokenizer lacks, and the
    # model's vocabulary is exactly the tokenizer's: the embeddings must grow, split over tp like the rest.
    tokenizer = family_tokenizer(family, leave_out=("<|end_of_text|>",))
    vocab = len(tokenizer) if family == "llama" else TINY["vocab_size"]
    model = make_model(family, seed=3, **{**TINY, "vocab_size": vocab})
    add_model(offline_hub, repo, model.config, family, model=model, tokenizer=tokenizer)
    add_dataset(offline_hub, "tatsu-lab/alpaca", {"data/train-00000-of-00001.parquet": alpaca_records(48)})
    config = str(FIXTURES / "distributed-parallel" / name)
    # CPU-sized run: short rows, fp32 (for the 1e-5 comparison), 3 steps, a checkpoint after step 2 and 3.
    common = dict(sequence_len=320, bf16="false", max_steps=3)
    results = run_ranks(8, _train_in_rank, config, _sets(**common, **sizes), timeout_s=400, pg_timeout_s=300)
    code, err, out = results[0]
    assert code == 0, err[-3000:]
    assert all(r[0] == 0 for r in results), [r[1][-500:] for r in results if r[0]]
    assert "not used: attn_implementation" in out and "plugins: CutCrossEntropyPlugin" in out
    if family == "llama":
        assert f"vocabulary: 1 token(s) added (<|end_of_text|>); embeddings grow from {vocab} to 320 rows" in out
    parallel = _records("outputs/ndp-out")
    # one process reading the same global batch: micro_batch_size = the layout's data-parallel ranks
    single = run_ranks(
        1,
        _train_in_rank,
        config,
        _sets(
            **common,
            dp_shard_size=1,
            dp_replicate_size=1,
            tensor_parallel_size=1,
            context_parallel_size=1,
            micro_batch_size=data_ranks,
            output_dir="single",
        ),
        timeout_s=300,
    )
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


# --- every example config: validates as written, or is refused naming the settings that change the result ---

RL = {"rl"}
REFUSED = {  # config -> the settings its one-line errors name (everything else about it is accepted)
    "llama-3/3b-qat-nvfp4.yaml": {"qat"},  # torchao's NVFP4 QAT needs a Blackwell GPU
    "llama-3/diffusion/pretrain-1b.yaml": {"diffusion", "plugins"},
    "llama-3/diffusion/sft-1b.yaml": {"diffusion", "plugins", "save_strategy"},
    "llama-3/instruct-dpo-lora-8b.yml": RL | {"datasets[0].field_chosen", "datasets[0].field_rejected"},
    "llama-3/lora-1b-deduplicate-dpo.yml": RL
    | {f"datasets[{i}].field_{k}" for i in (0, 1) for k in ("chosen", "rejected")},
    "llama-3/lora-1b-ray.yml": {"use_ray"},
    "llama-3/qlora-1b-gdpo.yaml": RL | {"trl"},
    # stored quantized by bitsandbytes: refused, naming base_model (the unquantized model with load_in_4bit runs)
    "llama-3/qlora-fsdp-405b.yaml": {"base_model"},
    "llama-3/qlora-1b-kto.yaml": RL | {"rl_beta", "kto_desirable_weight"},
    "llama-3/sparse-finetuning.yaml": {"llmcompressor", "plugins"},
    "mistral/dpo/mistral-dpo-qlora.yml": RL | {"datasets[0].field_chosen", "datasets[0].field_rejected"},
    "mistral/orpo/mistral-qlora-orpo.yml": RL | {"orpo_alpha"},
    "qwen3/30b-a3b-nvfp4-lora.yaml": {"nvfp4_merge_aware"},  # lora_target_parameters (experts) is supported
    "qwen3/reward-model.yaml": {"model_type", "num_labels", "reward_model", "center_rewards_coefficient"},
}
WORLD = {
    "distributed-parallel/qwen3-8b-fsdp-tp-cp.yaml": 8,
    "distributed-parallel/llama-3_1-8b-hsdp-tp.yaml": 16,
    "alst/llama3-8b-fsdp2-alst.yaml": 8,
}
CONFIGS = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*.y*ml"))


@pytest.fixture(scope="module")
def example_hub(tmp_path_factory):
    """The hub cache every validating example needs: published config.json shapes (no weights), the family's
    tokenizer, and small datasets laid out as on the hub."""
    from support.hub_cache import PUBLISHED

    root = tmp_path_factory.mktemp("examples-hf")
    cache = root / "hub"
    for repo, family in [
        ("meta-llama/Llama-3.1-8B", "llama"),
        ("NousResearch/Meta-Llama-3.1-8B", "llama"),
        ("NousResearch/Llama-3.2-1B", "llama"),
        ("meta-llama/Llama-3.2-3B", "llama"),
        ("Qwen/Qwen3-8B", "qwen3"),
        ("mistralai/Mistral-7B-v0.1", "mistral"),
        ("mistral-community/Mixtral-8x22B-v0.1", "mistral"),
        ("mistralai/Mixtral-8x7B-v0.1", "mistral"),
        ("casperhansen/llama-3-70b-fp16", "llama"),
        ("NousResearch/Meta-Llama-3-8B", "llama"),
        ("NousResearch/Meta-Llama-3-8B-Instruct", "llama"),
        ("meta-llama/Llama-3.2-1B", "llama"),
        ("hugging-quants/Meta-Llama-3.1-405B-BNB-NF4-BF16", "llama"),
    ]:
        add_model(cache, repo, PUBLISHED[repo], family)
    add_dataset(cache, "tatsu-lab/alpaca", {"data/train-00000-of-00001.parquet": alpaca_records()})
    add_dataset(cache, "aaditya/alpaca_subset_1", {"data/train-00000-of-00001.parquet": alpaca_records()})
    add_dataset(cache, "teknium/GPT4-LLM-Cleaned", {"alpaca_gpt4_data_unfiltered.json": alpaca_records()})
    add_dataset(cache, "yahma/alpaca-cleaned", {"alpaca_data_cleaned.json": alpaca_records()})
    add_dataset(cache, "mhenrichsen/alpaca_2k_test", {"alpaca_2000.jsonl": alpaca_records()})
    add_dataset(
        cache,
        "fozziethebeat/alpaca_messages_2k_test",
        {"data/train-00000-of-00001.parquet": chat_records(layout="messages")},
    )
    add_dataset(cache, "mlabonne/FineTome-100k", {"data/train-00000-of-00001.parquet": chat_records()})
    add_dataset(cache, "princeton-nlp/TextbookChapters", {"data/train.parquet": [{"chapter": "x " * 50}] * 4})
    # alst's long documents (min_sample_len 200,000; validate samples them): one of 300,000 byte tokens, zstd
    long_document = (json.dumps({"text": "x " * 150_000}) + "\n").encode()
    zstd = pyarrow.compress(long_document, codec="zstd", asbytes=True)
    add_dataset(cache, "togethercomputer/Long-Data-Collections", {"pretrain/rp_sub.jsonl.zst": zstd})
    return root


@pytest.mark.parametrize("name", CONFIGS)
def test_every_example_config_validates_or_is_refused_by_name(example_hub, monkeypatch, tmp_path, capsys, name):
    monkeypatch.setenv("HF_HOME", str(example_hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    world = ["--world-size", str(WORLD[name])] if name in WORLD else []
    code = main(["validate", str(FIXTURES / name), *world])
    out = capsys.readouterr()
    if name not in REFUSED:
        assert code == 0, out.err
        assert "config OK for" in out.out
        if name.startswith("mistral/") and yaml.safe_load((FIXTURES / name).read_text()).get("unfrozen_parameters"):
            # written against the checkpoint's block_sparse_moe names: 12 layers' routers and experts, embeddings
            # and head (transformers 5 calls the block mlp and stacks the experts)
            assert "unfrozen_parameters: 38 of 507 weight tensors train" in out.out
        return
    assert code == 2
    lines = [line.removeprefix("  - ") for line in out.err.splitlines() if line.startswith("  - ")]
    named = {
        line.split(":")[0].split(" ")[0]
        for line in lines
        if " — " in line
        or line.startswith("adapter:")
        or line.startswith("optimizer:")
        or line.startswith("save_strategy:")
        or line.startswith("qat:")
    }
    named |= {line.split("'")[1] for line in lines if line.startswith("unknown setting '")}
    assert REFUSED[name] <= named, (named, lines)
    assert all("\n" not in line for line in lines)


def test_a_dpo_config_is_refused_naming_rl(example_hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(example_hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", str(FIXTURES / "llama-3/instruct-dpo-lora-8b.yml")]) == 2
    err = capsys.readouterr().err
    assert "  - rl: 'dpo' — preference, reinforcement-learning and reward-model training are not supported" in err


@pytest.mark.slow
def test_a_chat_config_trains_as_written(offline_hub):
    """llama-3/fft-8b-liger-fsdp.yaml: a hub chat dataset sliced train[:20%] with ShareGPT keys mapped, the
    llama3 template by name, special_tokens, fsdp_config with CPU offload, liger plugin: 2 ranks, 2 steps."""
    model = make_model("llama", seed=3, **TINY)
    add_model(offline_hub, "NousResearch/Meta-Llama-3.1-8B", model.config, "llama", model=model)
    add_dataset(offline_hub, "mlabonne/FineTome-100k", {"data/train-00000-of-00001.parquet": chat_records(60)})
    config = str(FIXTURES / "llama-3" / "fft-8b-liger-fsdp.yaml")
    results = run_ranks(
        2,
        _train_in_rank,
        config,
        _sets(sequence_len=128, bf16="false", max_steps=2, micro_batch_size=1, gradient_accumulation_steps=1),
        timeout_s=300,
    )
    code, err, out = results[0]
    assert code == 0, err[-3000:]
    assert "liger_rope" in next(line for line in out.splitlines() if line.startswith("ndparallel: not used: "))
    records = _records("outputs/out")
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] == r["loss"] for r in records)
    assert "eval_loss" in records[-1]  # val_set_size 0.02, evals_per_epoch 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("outputs/out/checkpoints/step-2/tokenizer")
    assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.pad_token == "<|finetune_right_pad_id|>"
    assert tokenizer.chat_template.startswith("{{ bos_token }}{% for message in messages %}<|start_header_id|>")
