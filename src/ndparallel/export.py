"""Checkpoint -> Hugging Face model directory, offline, in one process.

The sharded checkpoint is read without the ranks that wrote it (torch.distributed.checkpoint reassembles
each parameter from its slices), into a model built on the meta device and given CPU storage in the
export dtype, then written with ``save_pretrained`` (config.json, safetensors shards + index) beside the
tokenizer files. LoRA runs export their adapter in the PEFT format, or merged into the base weights.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoConfig, AutoModelForCausalLM

from ndparallel.checkpoint import _check_complete, checkpoints_dir
from ndparallel.errors import CheckpointError
from ndparallel.models.build import restore_buffers

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or an output_dir (its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist; give a checkpoint directory (output_dir/checkpoints/"
                              f"step-N) or a training output_dir")
    latest = checkpoints_dir(path) / "latest"
    if latest.is_file():
        path = checkpoints_dir(path) / latest.read_text(encoding="utf-8").strip()
    _check_complete(path)
    return path


def load_hf_config(path: Path):
    try:
        data = json.loads((path / "hf_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{str(path / 'hf_config.json')!r} is missing or unreadable ({exc})") from None
    kind = data.pop("model_type")
    return AutoConfig.for_model(kind, **data)


def load_full_model(path: Path, *, dtype: torch.dtype, with_adapters: bool = False):
    """The model of checkpoint ``path`` in one process, on CPU. Returns (model, adapter_spec or None)."""
    from ndparallel.lora import LoraSpec, attach_lora

    config = load_hf_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    spec = LoraSpec.from_checkpoint(path)
    if spec is not None and with_adapters:
        attach_lora(model, spec, tp_mesh=None)
    model.to_empty(device="cpu")
    state = {k: v for k, v in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "no process group: loading in one process" is exactly the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(path / "model_optim"), no_dist=True)
    except (Exception, CheckpointException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read the model from {str(path / 'model_optim')!r}: {first}") from None
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        restore_buffers(model, torch.device("cpu"))
    return model.eval(), spec


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, merge_lora: bool = False,
                      dtype: str = "bfloat16") -> Path:
    """Write a Hugging Face directory (or a PEFT adapter directory) for ``checkpoint`` into ``out_dir``."""
    from ndparallel.lora import merge_lora_weights, save_peft_adapter

    path = resolve_checkpoint(checkpoint)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"export directory {str(out)!r} is not empty; choose a new directory (nothing is "
                              f"overwritten)")
    torch_dtype = _DTYPES[dtype]
    model, spec = load_full_model(path, dtype=torch.float32 if spec_needs_fp32(path) else torch_dtype,
                                  with_adapters=True)
    if spec is not None and not merge_lora:
        save_peft_adapter(model, spec, out)
    else:
        if spec is not None:
            merge_lora_weights(model, spec)
        model.to(torch_dtype).save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    tokenizer_dir = path / "tokenizer"
    if tokenizer_dir.is_dir():
        for item in tokenizer_dir.iterdir():
            shutil.copy2(item, out / item.name)
    return out


def spec_needs_fp32(path: Path) -> bool:
    """Merging adapters is done in float32, then cast."""
    return (path / "extra.json").is_file()
