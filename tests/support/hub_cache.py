"""A Hugging Face hub cache built by the tests themselves, so hub ids load offline (HF_HUB_OFFLINE=1).

The cache layout is huggingface_hub's public one: ``<cache>/<models|datasets>--<org>--<name>/snapshots/<commit>/
<files>`` and ``refs/main`` holding the commit. Files are written straight into the snapshot (the real cache
links them to ``blobs/``; readers only follow the snapshot paths).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import LlamaConfig, MistralConfig, MixtralConfig, PretrainedConfig, Qwen3Config

# The published shapes of the models Axolotl's examples name (config.json only: validate reads no weights).
LLAMA_31_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
LLAMA_32_1B = dict(
    LLAMA_31_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True
)
LLAMA_32_3B = dict(LLAMA_32_1B, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24)
QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
MISTRAL_7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=32768,
    sliding_window=4096,
)
MIXTRAL_8X22B = dict(
    hidden_size=6144,
    intermediate_size=16384,
    num_hidden_layers=56,
    num_attention_heads=48,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=65536,
    rope_theta=1e6,
)
LLAMA_3_70B = dict(
    LLAMA_31_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    max_position_embeddings=8192,
)
LLAMA_31_405B = dict(
    LLAMA_31_8B, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128
)
# hugging-quants' 405B checkpoint is stored in bitsandbytes' 4-bit format (its config says so)
BNB_NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
MIXTRAL_8X7B = dict(MISTRAL_7B, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None)
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": LlamaConfig(**LLAMA_31_8B),
    "NousResearch/Meta-Llama-3.1-8B": LlamaConfig(**LLAMA_31_8B),
    "NousResearch/Meta-Llama-3-8B": LlamaConfig(**{**LLAMA_31_8B, "max_position_embeddings": 8192}),
    "NousResearch/Meta-Llama-3-8B-Instruct": LlamaConfig(**{**LLAMA_31_8B, "max_position_embeddings": 8192}),
    "NousResearch/Llama-3.2-1B": LlamaConfig(**LLAMA_32_1B),
    "meta-llama/Llama-3.2-1B": LlamaConfig(**LLAMA_32_1B),
    "meta-llama/Llama-3.2-3B": LlamaConfig(**LLAMA_32_3B),
    "Qwen/Qwen3-8B": Qwen3Config(**QWEN3_8B),
    "mistralai/Mistral-7B-v0.1": MistralConfig(**MISTRAL_7B),
    "mistral-community/Mixtral-8x22B-v0.1": MixtralConfig(**MIXTRAL_8X22B),
    "mistralai/Mixtral-8x7B-v0.1": MixtralConfig(**MIXTRAL_8X7B),
    "casperhansen/llama-3-70b-fp16": LlamaConfig(**LLAMA_3_70B),
    "hugging-quants/Meta-Llama-3.1-405B-BNB-NF4-BF16": LlamaConfig(**LLAMA_31_405B, quantization_config=BNB_NF4),
}
# The special tokens the examples name, per model family (added to the tests' byte-level tokenizer).
FAMILY_TOKENS = {
    "llama": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
    ],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "mistral": ["<s>", "</s>", "<unk>"],
}


def _snapshot(cache: Path, kind: str, repo_id: str) -> Path:
    commit = hashlib.sha1(f"{kind}/{repo_id}".encode()).hexdigest()
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def family_tokenizer(family: str, *, leave_out: tuple[str, ...] = ()):
    """The byte-level tokenizer with the family's special tokens (eos/bos as the family names them), except
    ``leave_out`` (so that a config's special_tokens must add them)."""
    from ndparallel.data.load_tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokens = [t for t in FAMILY_TOKENS[family] if t not in leave_out]
    tokenizer.add_tokens(tokens, special_tokens=True)
    if family == "llama":
        tokenizer.bos_token = "<|begin_of_text|>"
        if "<|end_of_text|>" not in leave_out:
            tokenizer.eos_token = "<|end_of_text|>"
    elif family == "qwen3":
        tokenizer.eos_token = "<|im_end|>"
    else:
        tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token = "<s>", "</s>", "<unk>"
    return tokenizer


def add_model(cache: Path, repo_id: str, config: PretrainedConfig, family: str, model=None, tokenizer=None) -> Path:
    """A model repository: config.json, the family's tokenizer (or ``tokenizer``), and safetensors weights when
    ``model`` is given."""
    snapshot = _snapshot(cache, "model", repo_id)
    if model is not None:
        model.save_pretrained(snapshot, safe_serialization=True)
    else:
        config.save_pretrained(snapshot)
    (tokenizer or family_tokenizer(family)).save_pretrained(snapshot)
    return snapshot


def add_dataset(cache: Path, repo_id: str, files: dict[str, list[dict] | bytes], card: str | None = None) -> Path:
    """A dataset repository: ``files`` maps a path in the repository to records (.parquet / .jsonl) or raw bytes."""
    snapshot = _snapshot(cache, "dataset", repo_id)
    for name, content in files.items():
        path = snapshot / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif name.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(content), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in content))
    if card is not None:
        (snapshot / "README.md").write_text(card)
    return snapshot


def alpaca_records(n: int = 40) -> list[dict]:
    verbs = ["Name", "List", "Explain", "Describe", "Summarize"]
    things = ["a colour", "three fruits", "gravity", "the sea", "a river", "two planets", "rain", "a song"]
    return [
        {
            "instruction": f"{verbs[i % 5]} {things[i % 8]}.",
            "input": "" if i % 3 else f"case {i}",
            "output": f"Answer {i}: {things[(i * 3) % 8]} and {things[(i * 5) % 8]}.",
        }
        for i in range(n)
    ]


def chat_records(n: int = 30, *, layout: str = "sharegpt") -> list[dict]:
    """Two-turn chats in ShareGPT's ``conversations`` from/value layout (mlabonne/FineTome-100k's), or with
    ``layout="messages"`` in the role/content ``messages`` layout (fozziethebeat/alpaca_messages_2k_test's)."""
    turns = [(f"Question {i}: what is {i} plus {i}?", f"It is {2 * i}.") for i in range(n)]
    if layout == "messages":
        return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in turns]
    return [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in turns]
