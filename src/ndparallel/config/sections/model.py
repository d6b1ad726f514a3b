"""The model and its tokenizer: which weights or shape, the tokens to add, the chat template."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ndparallel.data.templates import check_template_name


class SpecialTokens(BaseModel):
    """Axolotl's special_tokens: set these tokens, adding them to the vocabulary when they are new."""

    model_config = ConfigDict(extra="forbid")
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] | None = None


class ModelSettings(BaseModel):
    """What model to train and how its text becomes tokens."""

    base_model: str | None = None
    """Local Hugging Face model directory, or a hub id (org/name) read from the hub cache (downloaded once per
    node unless HF_HUB_OFFLINE is set; safetensors only). Each rank reads only its slices of the weights."""
    revision_of_model: str | None = None
    """Hub revision (branch, tag or commit) of base_model."""
    trust_remote_code: bool = False
    """Allow a model or tokenizer to run Python code from its repository. Off: nothing read runs code."""
    model_shape: str | None = None
    """Random-init pre-training from a preset shape instead of base_model: tiny, byte-tiny, 1b, 3b, 8b
    (Llama-shaped)."""
    model_config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the transformers config to set or override (an inline shape with model_type). Axolotl's
    overrides_of_model_config and rope_scaling land here."""
    tokenizer_config: str | None = None
    """Tokenizer directory or hub id, or 'byte' for the built-in byte-level tokenizer. Default: base_model's."""
    tokenizer_type: str | None = None
    """transformers tokenizer class to load it with (e.g. AutoTokenizer, PreTrainedTokenizerFast)."""
    special_tokens: SpecialTokens | None = None
    """bos/eos/pad/unk tokens and additional special tokens; new ones are added to the vocabulary and the
    embeddings grow (to a multiple of 64 and of tensor_parallel_size; new rows start at the mean row)."""
    tokens: list[str] | None = None
    """Plain tokens to add to the vocabulary (the embeddings grow as for special_tokens)."""
    chat_template: str | None = None
    """Chat template by name (chatml, llama3, qwen3, qwen_25, mistral_v1, gemma, phi_3, alpaca,
    tokenizer_default, tokenizer_default_fallback_<name>) or jinja (with chat_template_jinja)."""
    chat_template_jinja: str | None = None
    """Jinja source of the chat template (implies chat_template: jinja)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. enable_thinking: false)."""

    @field_validator("chat_template")
    @classmethod
    def _template_name(cls, value):
        check_template_name(value)
        return value
