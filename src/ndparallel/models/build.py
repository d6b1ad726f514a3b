"""Build a model straight into its layout: skeleton on the meta device, parallelize, then fill each rank's
shards from a safetensors checkpoint or from a layout-independent random init.

No rank ever holds the whole model: from a checkpoint each rank reads only the slices it keeps (safetensors
``get_slice``), casts them on the host and copies them to its device; a random init is generated one full
tensor at a time and sliced. The random init is seeded per parameter name, so every layout starts from
the same weights (and the single-process run too) — what makes ``train`` runs comparable across layouts.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ndparallel import _compat
from ndparallel.adapters.lora import init_lora_tensor
from ndparallel.errors import ModelError
from ndparallel.models import presets
from ndparallel.models.families import needs_eager_attention
from ndparallel.models.moe import is_moe_weight
from ndparallel.models.moe_weights import hub_expert_tensor
from ndparallel.models.ties import shared_owners, tie_again
from ndparallel.parallel.single_rank import reallocate
from ndparallel.quantized import int8
from ndparallel.quantized.nf4 import assign_quantized, is_nf4
from ndparallel.safe_io import file_names, hub
from ndparallel.vocab import grow_rows


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


def materialize(
    model: nn.Module,
    device: torch.device,
    *,
    weights_dir: str | None,
    seed: int,
    offload_params: bool = False,
    vocab_from: int | None = None,
) -> None:
    """Give a parallelized meta model real storage and fill this rank's shards.

    ``weights_dir``: read this rank's slice of each tensor from its safetensors file; else a per-name seeded
    random init (generated whole on ``device``, so every layout starts from the same weights).
    ``offload_params``: parameters get CPU storage (FSDP's ``cpu_offload`` keeps its shards there and copies
    each unit to ``device`` when it runs); buffers (rotary tables) always live on ``device``.
    ``vocab_from``: the checkpoint's vocabulary size when the model's grew for added tokens (``vocab.py``).
    """
    ties = shared_owners(model)  # to_empty gives every module its own tensor: tied weights are tied again
    model.to_empty(device=torch.device("cpu") if offload_params else device)
    tie_again(ties)
    reallocate(model)  # a one-rank model keeps its parameters in flat buffers (parallel/single_rank.py)
    reader = _SafetensorsReader(weights_dir) if weights_dir else None
    init_std = getattr(model.config, "initializer_range", 0.02)
    owners = _owning_modules(model)
    quantized = []  # filled after the loop from the full weight (quantized/ says why)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = _compat.canonical_name(name)
            lora_init = init_lora_tensor(key, tuple(param.shape), seed, device)
            if lora_init is not None:  # adapters start fresh, whatever the base weights
                _copy_shard(param, lora_init)
            elif is_nf4(param) or (isinstance(owners[name], int8.Int8Linear) and name.endswith(".weight")):
                quantized.append((name, key))
            elif isinstance(owners[name], int8.Int8Linear) and name.endswith(".weight_scale"):
                continue  # computed with its codes
            elif reader is not None:
                if vocab_from is not None and param.shape[0] == model.config.vocab_size:
                    # The vocabulary grew for added tokens: read the rows there are, add the new ones (vocab.py).
                    full = grow_rows(reader.get(key), tuple(param.shape), vocab_from)
                    if tuple(full.shape) != tuple(param.shape):
                        raise ModelError(
                            f"{key}: the weights in {weights_dir!r} have shape {tuple(full.shape)} but "
                            f"the model expects {tuple(param.shape)}; config.json and the weights disagree"
                        )
                    _copy_shard(param, full)
                else:
                    reader.read_into(key, param)
            else:
                _copy_shard(param, _init_tensor(key, owners[name], tuple(param.shape), init_std, seed, device))
        for name, key in quantized:
            owner, attr = owners[name], name.rsplit(".", 1)[-1]
            if isinstance(owner, int8.Int8Linear) and _fill_int8_rows(owner, key, reader, device):
                continue
            # else the whole weight is quantized, then split (NF4's second-level scales span the whole tensor)
            shape = tuple(getattr(owner, attr).shape)
            full = reader.get(key) if reader is not None else _init_tensor(key, owner, shape, init_std, seed, device)
            if isinstance(owner, int8.Int8Linear):
                int8.fill(owner, full.to(device), _copy_shard)
            else:
                assign_quantized(owner, attr, full)
        restore_buffers(model, device)
        if reader is not None:  # persistent buffers a checkpoint holds (DeepSeek-V3's routing bias)
            params = {name for name, _ in model.named_parameters()}
            for name, value in model.state_dict(keep_vars=True).items():
                key = _compat.canonical_name(name)
                if name not in params and key in reader.files:
                    _copy_shard(value, reader.get(key))
    if reader is not None:
        tied = (
            model.get_output_embeddings() is not None
            and model.get_output_embeddings().weight is model.get_input_embeddings().weight
        )
        reader.check_all_used(ignore={"lm_head.weight"} if tied else set())


def _fill_int8_rows(owner: int8.Int8Linear, key: str, reader, device: torch.device) -> bool:
    """int8 scales are per row, so a rank reads (full width) only the rows it holds, quantizes them and keeps
    its columns. False where that does not apply (random init, or a placement whose rows are not one range
    shared by codes and scales): the caller reads the whole weight."""
    if reader is None or key not in reader.files:
        return False
    codes, box = _local_box(owner.weight)
    scales, scale_box = _local_box(owner.weight_scale)
    if box is None or scale_box is None or scale_box[0] != box[0]:
        return False
    if codes.numel():
        rows = reader.read_box(key, tuple(owner.weight.shape), (box[0], slice(None)))
        q, scale = int8.quantize_rowwise(rows.to(device), scale_dtype=owner.scale_dtype)
        codes.copy_(q[:, box[1]])
        scales.copy_(scale)
    return True


def initialize_adapters(model: nn.Module, seed: int) -> None:
    """LoRA adapters attached to an already materialized model get the same seeded start as ``materialize``
    gives them on every other layout."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            init = init_lora_tensor(_compat.canonical_name(name), tuple(param.shape), seed, param.device)
            if init is not None:
                _copy_shard(param, init)


def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        # Slices locally (src_data_rank=None): every rank holds ``full`` already, no communication.
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def _local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """This rank's storage of ``param`` and the index of the global tensor it holds (None: not one box)."""
    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    local = param.to_local()
    offsets, sizes = _compat.local_region(param)
    if tuple(sizes) != tuple(local.shape):
        return local, None
    return local, tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


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
    if not isinstance(owner, (nn.Linear, nn.Embedding)) and not is_moe_weight(owner, key):
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
        if hasattr(module, "scalar_embed_scale"):
            # Gemma's scaled embedding keeps its scale (sqrt(hidden)) as a float beside the buffer.
            local["embed_scale"].fill_(module.scalar_embed_scale)
            continue
        # Modules that keep no config of their own (DeepSeek-V3's router) are built from the model's.
        config = getattr(module, "config", None) or getattr(model, "config", None)
        if config is None:
            raise ModelError(
                f"cannot rebuild the buffers {sorted(local)} of {type(module).__name__} after meta-device init"
            )
        with torch.device(device):
            fresh = type(module)(config)
        for buffer_name, value in fresh.named_buffers(recurse=False):
            setattr(module, buffer_name, value.to(local[buffer_name].dtype))  # on ``device``, persistence kept


class _SafetensorsReader:
    """Reads single tensors by name from a model directory's safetensors files (sharded or not)."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                entries = weight_map.items()
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                raise ModelError(
                    f"{str(index)!r} has no readable weight_map ({type(exc).__name__}); fix or remove the index"
                ) from None
            self.files = {key: self._inside(path, index, key, file) for key, file in entries}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelError(
                    f"base_model {directory!r} has a config but no *.safetensors weights; add the weights, "
                    f"or use model_shape / model_config_overrides for random init"
                )
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

    @staticmethod
    def _inside(path: Path, index: Path, key: str, name: object) -> Path:
        found = file_names.inside(path, name)
        if found is None:
            raise ModelError(
                f"{str(index)!r} maps {key!r} to {name!r}, which is not a file name inside the model directory "
                f"(no absolute paths or '..'); fix the index"
            )
        return found

    def get(self, key: str) -> torch.Tensor:
        """The whole weight ``key`` (for the few readers that need all of it: stacked experts, grown rows)."""
        if key not in self.files:
            # MoE experts stored one tensor per expert (the Hub layout) for a stacked parameter
            stacked = hub_expert_tensor(key, self.files.__contains__, self.get)
            if stacked is not None:
                return stacked
            raise ModelError(
                f"base_model {self.directory!r}: no weight named {key!r} in its safetensors files "
                f"(is it a checkpoint of another architecture?)"
            )
        self.used.add(key)
        try:
            with safe_open(self.files[key], framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:  # a truncated or corrupted file
            raise ModelError(
                f"cannot read {key!r} from {str(self.files[key])!r}: {exc}; the file may be truncated"
            ) from None

    def read_into(self, key: str, param: torch.Tensor) -> None:
        """Fill this rank's part of ``param`` from the weight ``key``: only that slice is read from disk, cast
        to the parameter's dtype on the host, then copied to the parameter's device."""
        if key not in self.files:  # e.g. MoE experts stored one tensor per expert: assembled whole
            _copy_shard(param, self.get(key))
            return
        local, box = _local_box(param)
        if box is None:  # a placement whose local part is not one box: read it whole, slice in memory
            _copy_shard(param, self.read_box(key, tuple(param.shape), None))
        elif local.numel():
            local.copy_(self.read_box(key, tuple(param.shape), box).to(local.dtype))

    def read_box(self, key: str, shape: tuple, box: tuple[slice, ...] | None) -> torch.Tensor:
        """The part ``box`` (None: all) of the weight ``key``, which must have ``shape``; only it is read."""
        self.used.add(key)
        try:
            with safe_open(self.files[key], framework="pt") as f:
                stored = f.get_slice(key)
                if tuple(stored.get_shape()) != shape:
                    raise ModelError(
                        f"{key}: the weights in {self.directory!r} have shape {tuple(stored.get_shape())} but "
                        f"the model expects {shape}; config.json and the weights disagree"
                    )
                return stored[box] if box is not None else stored[:]
        except ModelError:
            raise
        except Exception as exc:  # a truncated or corrupted file
            raise ModelError(
                f"cannot read {key!r} from {str(self.files[key])!r}: {exc}; the file may be truncated"
            ) from None

    def check_all_used(self, *, ignore: set[str]) -> None:
        unused = sorted(set(self.files) - self.used - ignore)
        if unused:
            raise ModelError(
                f"base_model {self.directory!r} holds weights the model does not have: {unused[:5]}"
                f"{' ...' if len(unused) > 5 else ''}; is config.json the right architecture?"
            )
