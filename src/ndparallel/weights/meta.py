"""The model to train, before any weight exists: its transformers config (a local or hub directory, a preset
shape, or an inline config) and its skeleton on the meta device."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ndparallel.errors import ModelError
from ndparallel.models import presets
from ndparallel.models.families import needs_eager_attention
from ndparallel.safe_io import hub


def model_config_for(
    *,
    base_model: str | None,
    model_shape: str | None,
    overrides: dict[str, Any],
    max_position_embeddings: int | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> PretrainedConfig:
    """The transformers config of the model to train (no weights are read). ``base_model`` is a local
    directory or a hub id (``ndparallel.safe_io.hub``: its config is fetched into the hub cache when missing)."""
    if base_model is not None:
        path = hub.model_dir(base_model, revision=revision, weights=False, trust_remote_code=trust_remote_code)
        if not path.is_dir():
            raise ModelError(
                f"base_model {base_model!r} is not a directory; give a local Hugging Face model directory "
                f"(config.json + *.safetensors) or a hub id, or use model_shape for random init"
            )
        if not (path / "config.json").is_file():
            raise ModelError(f"base_model {base_model!r} has no config.json; it must be a Hugging Face model directory")
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        stored = getattr(config, "quantization_config", None)
        if stored:
            method = stored.get("quant_method", "quantized") if isinstance(stored, dict) else type(stored).__name__
            raise ModelError(
                f"base_model: {base_model!r} — its weights are stored quantized ({method}); ndparallel reads "
                f"unquantized safetensors (bf16/fp16/fp32): train the original model, with load_in_4bit: true "
                f"for 4-bit base weights"
            )
    elif model_shape is not None:
        key = presets.canonical_name(model_shape)
        if key is None:
            raise ModelError(f"model_shape {model_shape!r} is not a preset; choose one of {presets.choices()}")
        config = LlamaConfig(**presets.PRESETS[key])
    else:
        kind = overrides.get("model_type")
        if not kind:
            raise ModelError("model_config_overrides needs model_type (e.g. llama) to describe an inline model")
        # Built from the overrides, so fields derived from them follow (Gemma's layer_types from
        # num_hidden_layers); set afterwards they would keep the defaults' length.
        if kind not in CONFIG_MAPPING:
            raise ModelError(
                f"model_config_overrides.model_type {kind!r} is not a model type transformers "
                f"{transformers.__version__} knows (e.g. llama, qwen3, gemma2)"
            )
        try:
            config = AutoConfig.for_model(kind, **{k: v for k, v in overrides.items() if k != "model_type"})
        except Exception as exc:  # transformers' config validation (its exception types vary across versions)
            reason = " ".join(str(exc).split())[-300:]
            raise ModelError(f"model_config_overrides do not make a valid {kind} config: {reason}") from None
    for key, value in overrides.items():
        if key != "model_type":
            setattr(config, key, value)
    if max_position_embeddings and getattr(config, "max_position_embeddings", 0) < max_position_embeddings:
        config.max_position_embeddings = max_position_embeddings
    config.use_cache = False
    return config


def meta_model(config: PretrainedConfig) -> nn.Module:
    """The model's skeleton with no storage: parameters on the meta device, float32. ndparallel replaces the
    attention function anyway; a family SDPA cannot express (gpt-oss refuses it) is built eager."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(config), dtype=torch.float32)
    return model


def attention_for(config: PretrainedConfig) -> str:
    """SDPA, unless the family cannot express its attention with it (Gemma 2's soft-capping: eager)."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    sdpa = not needs_eager_attention(config) and (model_class is None or model_class._supports_sdpa)
    return "sdpa" if sdpa else "eager"
