"""Fill a parallelized meta model (``meta.py``) with weights: each rank's shards from a safetensors checkpoint
(``safetensors_reader.py``) or from a layout-independent random init.

No rank ever holds the whole model: from a checkpoint each rank reads only the slices it keeps (safetensors
``get_slice``), casts them on the host and copies them to its device; a random init is generated one full
tensor at a time and sliced. The random init is seeded per parameter name, so every layout starts from
the same weights (and the single-process run too) — what makes ``train`` runs comparable across layouts.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from ndparallel import _compat
from ndparallel.adapters.lora import init_lora_tensor
from ndparallel.errors import ModelError
from ndparallel.models.moe import is_moe_weight
from ndparallel.models.ties import shared_owners, tie_again
from ndparallel.parallel.single_rank import reallocate
from ndparallel.quantized import int8
from ndparallel.quantized.nf4 import assign_quantized, is_nf4
from ndparallel.weights.safetensors_reader import SafetensorsReader
from ndparallel.weights.shards import copy_shard, local_box
from ndparallel.weights.vocab import grow_rows


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
    ``vocab_from``: the checkpoint's vocabulary size when the model's grew for added tokens (``weights/vocab.py``).
    """
    ties = shared_owners(model)  # to_empty gives every module its own tensor: tied weights are tied again
    model.to_empty(device=torch.device("cpu") if offload_params else device)
    tie_again(ties)
    reallocate(model)  # a one-rank model keeps its parameters in flat buffers (parallel/single_rank.py)
    source = _Source(
        reader=SafetensorsReader(weights_dir) if weights_dir else None,
        owners=_owning_modules(model),
        device=device,
        seed=seed,
        init_std=getattr(model.config, "initializer_range", 0.02),
    )
    with torch.no_grad():
        quantized = _fill_parameters(model, source, vocab_from=vocab_from)
        for name, key in quantized:
            _fill_quantized(source, name, key)
        restore_buffers(model, device)
        if source.reader is not None:  # persistent buffers a checkpoint holds (DeepSeek-V3's routing bias)
            # By canonical name on both sides: a checkpoint wrapper's state_dict drops its prefix, so a raw name
            # would take every parameter for a buffer and copy the checkpoint's float weights over int8 codes
            # (truncated to zeros: an int8 base with activation checkpointing trained nothing, grad norm 0).
            params = {_compat.canonical_name(name) for name, _ in model.named_parameters()}
            for name, value in model.state_dict(keep_vars=True).items():
                key = _compat.canonical_name(name)
                if key not in params and key in source.reader.files:
                    copy_shard(value, source.reader.get(key))
    if source.reader is not None:
        tied = (
            model.get_output_embeddings() is not None
            and model.get_output_embeddings().weight is model.get_input_embeddings().weight
        )
        source.reader.check_all_used(ignore={"lm_head.weight"} if tied else set())


@dataclass
class _Source:
    """Where the weights come from: a safetensors directory (``reader``) or the seeded init."""

    reader: SafetensorsReader | None
    owners: dict[str, nn.Module]
    device: torch.device
    seed: int
    init_std: float

    def init(self, key: str, owner: nn.Module, shape: tuple) -> torch.Tensor:
        return _init_tensor(key, owner, shape, self.init_std, self.seed, self.device)


def _fill_parameters(model: nn.Module, source: _Source, *, vocab_from: int | None) -> list[tuple[str, str]]:
    """Fill every parameter but the quantized base weights; returns those as (name, checkpoint key): they are
    filled after the loop from the full weight (``quantized/`` says why)."""
    quantized = []
    for name, param in model.named_parameters():
        key, owner = _compat.canonical_name(name), source.owners[name]
        lora_init = init_lora_tensor(key, tuple(param.shape), source.seed, source.device)
        if lora_init is not None:  # adapters start fresh, whatever the base weights
            copy_shard(param, lora_init)
        elif is_nf4(param) or (isinstance(owner, int8.Int8Linear) and name.endswith(".weight")):
            quantized.append((name, key))
        elif isinstance(owner, int8.Int8Linear) and name.endswith(".weight_scale"):
            continue  # computed with its codes
        elif source.reader is None:
            copy_shard(param, source.init(key, owner, tuple(param.shape)))
        elif vocab_from is not None and param.shape[0] == model.config.vocab_size:
            # The vocabulary grew for added tokens: read the rows there are, add the new ones (weights/vocab.py).
            full = grow_rows(source.reader.get(key), tuple(param.shape), vocab_from)
            if tuple(full.shape) != tuple(param.shape):
                raise ModelError(
                    f"{key}: the weights in {source.reader.directory!r} have shape {tuple(full.shape)} but "
                    f"the model expects {tuple(param.shape)}; config.json and the weights disagree"
                )
            copy_shard(param, full)
        else:
            source.reader.read_into(key, param)
    return quantized


def _fill_quantized(source: _Source, name: str, key: str) -> None:
    """A quantized base weight: int8 rows read and quantized where this rank holds them, else the whole weight
    quantized, then split (NF4's second-level scales span the whole tensor)."""
    owner, attr = source.owners[name], name.rsplit(".", 1)[-1]
    if isinstance(owner, int8.Int8Linear) and _fill_int8_rows(owner, key, source.reader, source.device):
        return
    shape = tuple(getattr(owner, attr).shape)
    full = source.reader.get(key) if source.reader is not None else source.init(key, owner, shape)
    if isinstance(owner, int8.Int8Linear):
        int8.fill(owner, full.to(source.device), copy_shard)
    else:
        assign_quantized(owner, attr, full)


def _fill_int8_rows(owner: int8.Int8Linear, key: str, reader, device: torch.device) -> bool:
    """int8 scales are per row, so a rank reads (full width) only the rows it holds, quantizes them and keeps
    its columns. False where that does not apply (random init, or a placement whose rows are not one range
    shared by codes and scales): the caller reads the whole weight."""
    if reader is None or key not in reader.files:
        return False
    codes, box = local_box(owner.weight)
    scales, scale_box = local_box(owner.weight_scale)
    if box is None or scale_box is None or scale_box[0] != box[0]:
        return False
    if codes.numel():
        rows = reader.read_box(key, tuple(owner.weight.shape), (box[0], slice(None)))
        q, scale = owner.quantize(rows.to(device))
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
                copy_shard(param, init)


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
