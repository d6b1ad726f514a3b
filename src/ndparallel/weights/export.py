"""Checkpoint -> Hugging Face model directory, offline, in one process.

The sharded checkpoint is read without the ranks that wrote it (torch.distributed.checkpoint reassembles
each parameter from its slices), through the same guard as a resume (``checkpoint.open_checkpoint`` and
``checkpoint.load_tensors``: nothing is unpickled outside the allow-list, symlinks leaving the checkpoint
are refused), into a model built on the meta device and given CPU storage in the export dtype, then
written with ``save_pretrained`` (config.json, safetensors shards + index) beside the tokenizer files.
LoRA runs export their adapter in the PEFT format, or merged into the base weights.

Plain functions for other callers (e.g. exporting a live model gathered into one process):
``cpu_model(config, dtype=..., lora=...)`` builds the one-process model to fill; ``write_hf_directory(model,
out_dir, ...)`` writes any full, unsharded transformers model (or its PEFT adapter, or merged).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from ndparallel.adapters.lora import LoraSpec, attach_lora, merge_lora_weights, save_peft_adapter
from ndparallel.checkpoint import store
from ndparallel.checkpoint.guard import read_index
from ndparallel.checkpoint.loading import load_tensors, open_checkpoint
from ndparallel.checkpoint.training import checkpoints_dir
from ndparallel.errors import CheckpointError, ConfigError
from ndparallel.quantized.linears import FORMATS
from ndparallel.safe_io import bounded_yaml, owned_files
from ndparallel.weights.materialize import restore_buffers

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
MODEL_STATE = "model"  # the trainer's name for the model among a checkpoint's states


def resolve_checkpoint(path: str | Path) -> Path:
    """A checked checkpoint directory, from itself or from an output_dir (its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{str(path)!r} does not exist; give a checkpoint directory (output_dir/checkpoints/"
            f"step-N) or a training output_dir"
        )
    latest = store.latest(checkpoints_dir(path))
    if latest is not None:
        path = latest
    elif path.is_dir() and not (path / "index.json").exists() and not (path / "COMPLETE").exists():
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint directory and {str(checkpoints_dir(path) / 'latest')!r}"
            f" does not exist; give output_dir/checkpoints/step-N or a training output_dir"
        )
    open_checkpoint(path)
    return path


def load_hf_config(path: Path):
    try:
        data = json.loads((path / "hf_config.json").read_text(encoding="utf-8"))
        kind = data.pop("model_type")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise CheckpointError(
            f"{str(path / 'hf_config.json')!r} is missing or unreadable ({type(exc).__name__}: {exc})"
        ) from None
    return AutoConfig.for_model(kind, **data)


def cpu_model(config, *, dtype: torch.dtype, lora=None):
    """A transformers model of ``config`` on CPU, weights uninitialized (fill them, then ``restore_buffers``);
    with ``lora`` (a ``LoraSpec``) its adapters attached."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora is not None:
        attach_lora(model, lora, tp_mesh=None)
    return model.to_empty(device="cpu")


def load_full_model(path: Path, *, dtype: torch.dtype, with_adapters: bool = False):
    """The model of checkpoint ``path`` in one process, on CPU. Returns (model, adapter_spec or None)."""
    try:
        spec = LoraSpec.from_checkpoint(path)
    except (OSError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(
            f"{str(path / 'extra.json')!r} does not describe LoRA adapters ({type(exc).__name__}: {exc})"
        ) from None
    if spec is not None:
        _check_adapter_rank(path, spec)
    _refuse_quantized_base(path)
    try:
        model = cpu_model(load_hf_config(path), dtype=dtype, lora=spec if with_adapters else None)
    except ConfigError as exc:  # the adapters extra.json describes do not fit (a pattern that never ends)
        raise CheckpointError(f"{str(path / 'extra.json')!r}: {exc}") from None
    state = model.state_dict()
    load_tensors(path, {f"{MODEL_STATE}.{name}": value for name, value in state.items()}, distributed=False)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        restore_buffers(model, torch.device("cpu"))
    return model.eval(), spec


def _check_adapter_rank(path: Path, spec) -> None:
    """extra.json's r must be the rank the adapter tensors have: a crafted r must not size the model."""
    ranks = set()
    for key, entry in read_index(path / "tensors").state_dict_metadata.items():
        size = getattr(entry, "size", ())
        if key.endswith(".lora_A.weight") and len(size) == 2:
            ranks.add(size[0])  # (r, in)
        elif key.endswith("_lora_A") and len(size) == 3:
            ranks.add(size[1])  # experts: (E, r, in)
    if ranks != {spec.r}:
        raise CheckpointError(
            f"{str(path / 'extra.json')!r} says r={spec.r}, but the checkpoint's adapter tensors have rank "
            f"{sorted(ranks) or 'none'}; the checkpoint is damaged or was not written by ndparallel"
        )


def _refuse_quantized_base(path: Path) -> None:
    """A checkpoint over quantized base weights holds the trainable tensors only (its base comes from
    base_model)."""
    config = path / "config.yaml"
    try:
        text = config.read_text(encoding="utf-8") if config.is_file() else ""
        settings = bounded_yaml.load(text, source=repr(str(config)), error=CheckpointError) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{str(config)!r} is not readable YAML ({type(exc).__name__})") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{str(config)!r} holds a {type(settings).__name__}, not the settings ndparallel writes")
    for setting in FORMATS.values():
        if settings.get(setting):
            raise CheckpointError(
                f"{str(path)!r} is a {setting} checkpoint: it holds the adapters, not the base weights; "
                f"use the PEFT adapter the run wrote to output_dir/adapter with its base_model"
            )


def write_hf_directory(
    model,
    out_dir: str | Path,
    *,
    dtype: torch.dtype,
    lora=None,
    merge_lora: bool = False,
    base_model: str | None = None,
    tokenizer_dir: Path | None = None,
    max_shard_size: str = "2GB",
) -> Path:
    """Write a full (unsharded, one-process) transformers ``model`` as a Hugging Face directory.

    With ``lora`` (a ``LoraSpec`` whose adapters are attached): a PEFT adapter directory, or with
    ``merge_lora`` the merged model. ``out_dir`` must not exist or be empty: nothing is overwritten.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(
            f"export directory {str(out)!r} is not empty; choose a new directory (nothing is overwritten)"
        )
    if lora is not None and not merge_lora:
        save_peft_adapter(model, lora, out, base_model=base_model)
    else:
        if lora is not None:
            merge_lora_weights(model, lora)
        save_for_inference(model.to(dtype), out, max_shard_size=max_shard_size)
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        copy_tokenizer_files(tokenizer_dir, out)
    owned_files.mark_written(out)
    return out


# What a transformers tokenizer's save_pretrained writes (its own files and the vocabulary files of its
# classes). Nothing else of a checkpoint's tokenizer/ is copied: a config.json with an ``auto_map`` or a
# ``.py`` file there would put code in the exported model, and a weight file would replace the weights.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.json",
        "chat_template.jinja",
        "chat_template.json",
        "tokenizer.model",
        "tiktoken.model",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "spiece.model",
        "sentencepiece.bpe.model",
        "sentencepiece.model",
        "spm.model",
    }
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers' folder of named templates (*.jinja)


def copy_tokenizer_files(tokenizer_dir: Path, out: Path) -> list[str]:
    """Copy the tokenizer files transformers writes from ``tokenizer_dir`` (checked by the guard: plain files
    inside the checkpoint) into ``out``; returns the names copied. Files already in ``out`` are kept."""
    wanted = [tokenizer_dir / name for name in sorted(TOKENIZER_FILES)]
    wanted += sorted((tokenizer_dir / CHAT_TEMPLATE_DIR).glob("*.jinja"))
    copied = []
    for item in wanted:
        name = str(item.relative_to(tokenizer_dir))
        if item.is_file() and not item.is_symlink() and not (out / name).exists():
            (out / name).parent.mkdir(exist_ok=True)
            shutil.copyfile(item, out / name)
            copied.append(name)
    return copied


def save_for_inference(model, directory: Path, *, max_shard_size: str = "2GB") -> None:
    """``save_pretrained`` of a trained model for inference: ``use_cache`` on in its config and generation config
    (training turns the KV cache off; exported so, ``generate`` would run without one), and every file with the
    permissions config.json got (transformers writes the safetensors through a private temporary file: 0600)."""
    configs = [c for c in (model.config, getattr(model, "generation_config", None)) if hasattr(c, "use_cache")]
    before = [c.use_cache for c in configs]
    for config in configs:
        config.use_cache = True
    try:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    finally:
        for config, value in zip(configs, before):
            config.use_cache = value
    mode = (Path(directory) / "config.json").stat().st_mode & 0o777
    for item in Path(directory).iterdir():
        if item.is_file() and not item.is_symlink() and item.stat().st_mode & 0o777 != mode:
            item.chmod(mode)


def checkpoint_step(path: Path) -> int | None:
    """The step of checkpoint directory ``path`` (``step-N``), or None."""
    match = store.NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, *, merge_lora: bool = False, dtype: str = "bfloat16"
) -> Path:
    """Write a Hugging Face directory (or a PEFT adapter directory) for ``checkpoint`` into ``out_dir``."""
    path = resolve_checkpoint(checkpoint)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(
            f"export directory {str(out)!r} is not empty; choose a new directory (nothing is overwritten)"
        )
    torch_dtype = DTYPES[dtype]
    merging = (path / "extra.json").is_file()  # adapters are merged in float32, then cast
    model, spec = load_full_model(path, dtype=torch.float32 if merging else torch_dtype, with_adapters=True)
    return write_hf_directory(
        model, out, dtype=torch_dtype, lora=spec, merge_lora=merge_lora, tokenizer_dir=path / "tokenizer"
    )
