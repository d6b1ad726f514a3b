"""Model shapes by name: the one table behind ``model_shape:`` (random-init training) and ``ndparallel plan --model``.

Each preset is the Hugging Face config fields of a Llama-shaped decoder (no weights). A name is accepted
bare (``8b``) or with its family (``llama-8b``); ``canonical_name`` maps either to the key of ``PRESETS``.
Pure data: importing this module imports nothing else.
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = dict(num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)

PRESETS: dict[str, dict[str, Any]] = {
    # The test suite's model (tests/scenarios.py): small enough to run and measure on a CPU.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=256,
    ),
    # For the built-in byte tokenizer (258 tokens and chat markers, padded to a multiple of 64).
    "byte-tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=320,
    ),
    # Llama-3.2-1B / 3B (tied embeddings), Llama-3.1-8B / 70B / 405B.
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        head_dim=64,
        tie_word_embeddings=True,
        **_LLAMA3,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        head_dim=128,
        tie_word_embeddings=True,
        **_LLAMA3,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        tie_word_embeddings=False,
        **_LLAMA3,
    ),
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        head_dim=128,
        tie_word_embeddings=False,
        **_LLAMA3,
    ),
    "405b": dict(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        head_dim=128,
        tie_word_embeddings=False,
        **_LLAMA3,
    ),
}

FAMILY_PREFIX = "llama-"


def canonical_name(name: str) -> str | None:
    """The ``PRESETS`` key for ``name`` ('8b' or 'llama-8b'), or None when it names no preset."""
    text = name.strip().lower()
    if text in PRESETS:
        return text
    if text.startswith(FAMILY_PREFIX) and text[len(FAMILY_PREFIX) :] in PRESETS:
        return text[len(FAMILY_PREFIX) :]
    return None


def display_name(key: str) -> str:
    """How the planner prints a preset: 'llama-8b' for the Llama sizes, the key itself for the test shapes."""
    return key if key.endswith("tiny") else FAMILY_PREFIX + key


def choices() -> str:
    """The accepted names, for error messages."""
    return ", ".join(f"{key} ({display_name(key)})" if display_name(key) != key else key for key in PRESETS)
