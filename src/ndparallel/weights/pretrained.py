"""Pretrained models in and out of a layout, for a user's own training loop (no trainer needed).

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=2, tp_size=2))
    model = ndp.load_pretrained("Qwen/Qwen3-0.6B", topo)        # or a local directory
    ...                                                          # the user's loop
    ndp.save_pretrained(model, "out/hf", topo, tokenizer=tok)    # a Hugging Face directory, from the live model

``load_pretrained`` builds the model on the meta device, parallelizes it, then gives it storage and fills
each rank's shards from the safetensors files (``weights/materialize.py``): no rank ever holds the whole model.
``save_pretrained`` gathers one parameter at a time to rank 0 (a collective: every rank calls it), which
writes the directory under a temporary name and renames it into place; with ``lora`` it writes the PEFT
adapter instead, or the base weights with the adapters merged in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from ndparallel import _compat
from ndparallel.adapters.lora import LoraSpec, attach_lora, merge_lora_weights, save_peft_adapter
from ndparallel.errors import ModelError, NdParallelError
from ndparallel.mesh.topology import Topology
from ndparallel.parallel.apply import parallelize
from ndparallel.parallel.options import ParallelOptions, as_dtype
from ndparallel.safe_io import owned_files
from ndparallel.weights.export import save_for_inference
from ndparallel.weights.materialize import materialize, restore_buffers
from ndparallel.weights.meta import meta_model, model_config_for

# What a model directory needs for training (weights, configs, tokenizer); nothing that could hold code.
_MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def load_pretrained(
    name_or_path: str | os.PathLike,
    topology: Topology,
    *,
    options: ParallelOptions | None = None,
    lora: LoraSpec | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
    config_overrides: dict[str, Any] | None = None,
    seed: int = 0,
) -> nn.Module:
    """A Hugging Face causal LM (a local directory or a hub id) parallelized over ``topology``, in train mode.

    Every rank calls it. A hub id is downloaded once per node (local rank 0) while the other ranks wait;
    ``revision``, ``cache_dir`` and ``local_files_only`` mean what they mean in transformers, and
    ``HF_HUB_OFFLINE=1`` reads only the local cache. Weights are read with safetensors only; no code from the
    directory is run. ``lora``: add fresh LoRA adapters (the base frozen), placed like the layers they adapt.
    """
    directory = model_directory(name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
    config = model_config_for(base_model=str(directory), model_shape=None, overrides=dict(config_overrides or {}))
    model = meta_model(config)
    parallelize(model, topology, options=options, lora=lora)
    materialize(model, topology.device, weights_dir=str(directory), seed=seed)
    return model.train()


def model_directory(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local model directory, or the snapshot of a hub id in the Hugging Face cache (downloaded on each node's
    local rank 0 first; a failure there is raised on every rank)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import constants, snapshot_download

    def fetch(only_local: bool) -> Path:
        try:
            return Path(
                snapshot_download(
                    str(name_or_path),
                    revision=revision,
                    cache_dir=cache_dir,
                    allow_patterns=_MODEL_FILES,
                    local_files_only=only_local,
                )
            )
        except Exception as exc:  # not found, offline without a cached copy, no access ...
            raise ModelError(
                f"{str(name_or_path)!r} is neither a local directory nor a model the Hugging Face hub "
                f"cache can give ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check the "
                f"name, revision and HF_HUB_OFFLINE/HF_HOME"
            ) from None

    offline = local_files_only or constants.HF_HUB_OFFLINE
    if not (dist.is_available() and dist.is_initialized()):
        return fetch(offline)
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    error = None
    if first:
        try:
            fetch(offline)
        except ModelError as exc:
            error = str(exc)
    _raise_everywhere(error, ModelError)
    return fetch(True)


def save_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike,
    topology: Topology,
    *,
    lora: LoraSpec | None = None,
    merge_lora: bool = False,
    dtype: str | torch.dtype = "bfloat16",
    tokenizer: Any = None,
    base_model: str | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Write a Hugging Face directory from a live (sharded) model: every rank calls it, rank 0 writes.

    ``lora``: the model carries these adapters; write them as a PEFT adapter directory (``base_model``
    names its base), or with ``merge_lora=True`` the full model with the adapters folded in. ``out_dir``
    must not exist or be empty; it appears complete or not at all.
    """
    out = Path(out_dir)
    problem = None
    if topology.is_main and out.exists() and (not out.is_dir() or any(out.iterdir())):
        problem = f"export directory {str(out)!r} is not empty; choose a new directory (nothing is overwritten)"
    _raise_everywhere(problem)
    partial = out.with_name(f".partial-{out.name}")
    if topology.is_main:
        owned_files.remove_tree(partial)  # left by an export that was interrupted (a link: unlinked, not followed)
        partial.mkdir(parents=True)
    if lora is not None and not merge_lora:
        save_peft_adapter(model, lora, partial, base_model=base_model, write=topology.is_main)
    else:
        torch_dtype = as_dtype(dtype, setting="dtype")
        # Merging adapters is done in float32 (then cast); otherwise gather straight in the export dtype.
        state = _gathered_state(model, on_rank0=topology.is_main, dtype=torch.float32 if lora else torch_dtype)
        if topology.is_main:
            _write_hf(
                model.config,
                state,
                partial,
                dtype=torch_dtype,
                max_shard_size=max_shard_size,
                lora=lora if merge_lora else None,
            )
    if topology.is_main:
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        owned_files.mark_written(partial)
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(partial, out)
    dist.barrier()
    return out


def _gathered_state(model: nn.Module, *, on_rank0: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full CPU tensors of ``dtype`` under transformers' names, on rank 0 (one parameter in flight at a time).

    Rank 0's host memory holds the whole model in ``dtype`` (what ``save_pretrained`` writes anyway)."""
    state = {}
    tied_head = _tied_head_key(model)
    for name, value in model.state_dict().items():
        key = _compat.canonical_name(name)
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if on_rank0 and key != tied_head:
            state[key] = full.detach().to("cpu", dtype, copy=True)
    return state


def _tied_head_key(model: nn.Module) -> str | None:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return None
    return next(_compat.canonical_name(n) for n, m in model.named_modules() if m is head) + ".weight"


def _write_hf(
    config,
    state: dict[str, torch.Tensor],
    directory: Path,
    *,
    dtype: torch.dtype,
    max_shard_size: str,
    lora: LoraSpec | None,
) -> None:
    """Rank 0: a CPU model of ``config`` holding ``state`` (adapters merged if ``lora``), saved by transformers."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    if lora is not None:
        attach_lora(skeleton, lora, tp_mesh=None)
    skeleton.to_empty(device="cpu")
    missing, unexpected = skeleton.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != _tied_head_key(skeleton)]
    if missing or unexpected:
        raise ModelError(
            f"the live model's weights do not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        restore_buffers(skeleton, torch.device("cpu"))
    if lora is not None:
        merge_lora_weights(skeleton, lora)

    save_for_inference(skeleton.to(dtype), directory, max_shard_size=max_shard_size)


def _raise_everywhere(problem: str | None, error: type[NdParallelError] = NdParallelError) -> None:
    """Raise the first rank's ``problem`` on every rank, so no rank waits at a collective for one that failed."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise error(problem)
