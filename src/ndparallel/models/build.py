"""Build a model straight into its layout: skeleton on the meta device, parallelize, then fill each rank's
shards from a safetensors checkpoint or from a layout-independent random init.

No rank ever holds the whole model: one full tensor at a time is read (or generated) and only this
rank's slice of it is kept. The random init is seeded per parameter name, so every layout starts from
the same weights (and the single-process run too) — what makes ``train`` runs comparable across layouts.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from ndparallel import _compat, hub
from ndparallel.errors import ModelError
from ndparallel.lora import init_lora_tensor
from ndparallel.vocab import grow_rows

# Llama-shaped presets for pre-training from scratch (model_shape). Dims of Llama 3.2 1B/3B and Llama 3 8B.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=256),
    # for the built-in byte tokenizer (258 tokens and chat markers, padded to a multiple of 64)
    "byte-tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=320),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}


def model_config_for(*, base_model: str | None, model_shape: str | None, overrides: dict[str, Any],
                     max_position_embeddings: int | None = None, revision: str | None = None,
                     trust_remote_code: bool = False) -> PretrainedConfig:
    """The transformers config of the model to train (no weights are read). ``base_model`` is a local
    directory or a hub id (``ndparallel.hub``: its config is fetched into the hub cache when missing)."""
    if base_model is not None:
        path = hub.model_dir(base_model, revision=revision, weights=False, trust_remote_code=trust_remote_code)
        if not path.is_dir():
            raise ModelError(f"base_model {base_model!r} is not a directory; give a local Hugging Face model directory "
                             f"(config.json + *.safetensors) or a hub id, or use model_shape for random init")
        if not (path / "config.json").is_file():
            raise ModelError(f"base_model {base_model!r} has no config.json; it must be a Hugging Face model directory")
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    elif model_shape is not None:
        if model_shape not in PRESETS:
            raise ModelError(f"model_shape {model_shape!r} is not a preset; choose one of {', '.join(PRESETS)}")
        config = LlamaConfig(**PRESETS[model_shape])
    else:
        kind = overrides.get("model_type")
        if not kind:
            raise ModelError("model_config_overrides needs model_type (e.g. llama) to describe an inline model")
        config = AutoConfig.for_model(kind)
    for key, value in overrides.items():
        if key != "model_type":
            setattr(config, key, value)
    if max_position_embeddings and getattr(config, "max_position_embeddings", 0) < max_position_embeddings:
        config.max_position_embeddings = max_position_embeddings
    config.use_cache = False
    return config


def meta_model(config: PretrainedConfig) -> nn.Module:
    """The model's skeleton with no storage: parameters on the meta device, float32."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model


def materialize(model: nn.Module, device: torch.device, *, weights_dir: str | None, seed: int,
                vocab_from: int | None = None) -> None:
    """Give a parallelized meta model real storage on ``device`` and fill this rank's shards.

    ``weights_dir``: read each tensor from its safetensors file; else a per-name seeded random init.
    ``vocab_from``: the checkpoint's vocabulary size when the model's grew for added tokens (``vocab.py``).
    """
    model.to_empty(device=device)
    reader = _SafetensorsReader(weights_dir) if weights_dir else None
    init_std = getattr(model.config, "initializer_range", 0.02)
    owners = _owning_modules(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = _compat.canonical_name(name)
            lora_init = init_lora_tensor(key, tuple(param.shape), seed, device)
            if lora_init is not None:  # adapters start fresh, whatever the base weights
                full = lora_init
            elif reader is not None:
                full = grow_rows(reader.get(key), tuple(param.shape), vocab_from)
                if tuple(full.shape) != tuple(param.shape):
                    raise ModelError(f"{key}: the weights in {weights_dir!r} have shape {tuple(full.shape)} but the model "
                                     f"expects {tuple(param.shape)}; config.json and the weights disagree")
            else:
                full = _init_tensor(key, owners[name], tuple(param.shape), init_std, seed, device)
            _copy_shard(param, full)
        restore_buffers(model, device)
    if reader is not None:
        tied = model.get_output_embeddings() is not None and \
            model.get_output_embeddings().weight is model.get_input_embeddings().weight
        reader.check_all_used(ignore={"lm_head.weight"} if tied else set())


def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        # Slices locally (src_data_rank=None): every rank holds ``full`` already, no communication.
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def _owning_modules(model: nn.Module) -> dict[str, nn.Module]:
    owners = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{param_name}" if module_name else param_name] = module
    return owners


def _init_tensor(key: str, owner: nn.Module, shape: tuple, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """transformers' init rule (normal(0, initializer_range) for linear and embedding weights, zeros for
    biases, ones for norm weights), drawn from a generator seeded by (seed, parameter name)."""
    if key.endswith("bias"):
        return torch.zeros(shape, device=device)
    if not isinstance(owner, (nn.Linear, nn.Embedding)):
        return torch.ones(shape, device=device)  # norm weights
    generator = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def restore_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) are not in checkpoints and ``to_empty`` left them
    uninitialized: rebuild each such module from its config and copy its buffers."""
    for module in model.modules():
        local = {n: b for n, b in module.named_buffers(recurse=False)}
        if not local:
            continue
        if not hasattr(module, "config"):
            raise ModelError(f"cannot rebuild the buffers {sorted(local)} of {type(module).__name__} after meta-device init")
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for buffer_name, value in fresh.named_buffers(recurse=False):
            local[buffer_name].copy_(value)


class _SafetensorsReader:
    """Reads single tensors by name from a model directory's safetensors files (sharded or not)."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: path / file for key, file in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelError(f"base_model {directory!r} has a config but no *.safetensors weights; add the weights, "
                                 f"or use model_shape / model_config_overrides for random init")
            self.files = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for key in f.keys():
                        self.files[key] = file
        missing = sorted({str(f) for f in self.files.values() if not f.is_file()})
        if missing:
            raise ModelError(f"base_model {directory!r}: the index names weight files that are missing: {missing}")
        self.directory = directory
        self.used: set[str] = set()

    def get(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise ModelError(f"base_model {self.directory!r}: no weight named {key!r} in its safetensors files "
                             f"(is it a checkpoint of another architecture?)")
        self.used.add(key)
        try:
            with safe_open(self.files[key], framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:  # a truncated or corrupted file
            raise ModelError(f"cannot read {key!r} from {str(self.files[key])!r}: {exc}; the file may be truncated") from None

    def check_all_used(self, *, ignore: set[str]) -> None:
        unused = sorted(set(self.files) - self.used - ignore)
        if unused:
            raise ModelError(f"base_model {self.directory!r} holds weights the model does not have: {unused[:5]}"
                             f"{' ...' if len(unused) > 5 else ''}; is config.json the right architecture?")
