"""Sharded, atomic, reshardable training checkpoints.

Layout of ``output_dir/checkpoints/``::

    step-200/                 a complete checkpoint (renamed into place only once fully written)
      model_optim/            torch.distributed.checkpoint shards: model + optimizer, keyed by parameter name
      trainer_state.json      step, tokens, data position, scheduler, layout and model shape it was saved under
      rng/rank-<r>.pt         each rank's RNG states (tensors only)
      config.yaml             the resolved training config
      hf_config.json          the transformers config (export needs nothing else)
      tokenizer/              the tokenizer files
      COMPLETE                written last inside the directory
    latest                    the name of the newest complete checkpoint, replaced atomically
    .partial-step-300/        a save that was interrupted: never read, removed by the next save

A checkpoint is written to ``.partial-step-N``, every rank's part is flushed, rank 0 renames it to
``step-N`` and only then points ``latest`` at it; a crash at any moment leaves the previous checkpoint
and ``latest`` intact. Distributed checkpointing stores each parameter's global shape and the slices
each rank wrote, so loading under another layout or world size reads the right slices (resharding).

What loading trusts: tensor data and JSON. PyTorch reads the checkpoint's index (``.metadata``) with plain
``pickle``, which could run code, so ndparallel first unpickles it with an allow-list of the classes such an
index holds and refuses anything else; other pickled items go through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import yaml
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ndparallel.errors import CheckpointError
from ndparallel.topology import Topology

FORMAT_VERSION = 1
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def has_checkpoints(output_dir: Path) -> bool:
    root = checkpoints_dir(output_dir)
    return root.is_dir() and any(p.name.startswith("step-") for p in root.iterdir())


def find_resume(output_dir: Path, request: str | None) -> Path | None:
    """Resolve ``resume_from_checkpoint`` (None, 'latest' or a path) to a complete checkpoint directory.

    A requested resume never silently starts from scratch: anything that cannot be resumed is an error.
    """
    if request is None:
        return None
    if request == "latest":
        root = checkpoints_dir(output_dir)
        marker = root / "latest"
        if not marker.is_file():
            raise CheckpointError(f"resume_from_checkpoint: latest, but {str(marker)!r} does not exist (no complete "
                                  f"checkpoint in {str(root)!r}); remove the setting to start from scratch")
        target = root / marker.read_text(encoding="utf-8").strip()
        if not target.is_dir():
            raise CheckpointError(f"{str(marker)!r} points at {target.name!r}, which does not exist; set "
                                  f"resume_from_checkpoint to an existing checkpoint directory")
    else:
        target = Path(request)
        if not target.is_dir():
            raise CheckpointError(f"resume_from_checkpoint {request!r} is not a directory; give a checkpoint "
                                  f"directory (output_dir/checkpoints/step-N) or 'latest'")
    _check_complete(target)
    return target


def _check_complete(path: Path) -> None:
    if path.name.startswith(".partial-"):
        raise CheckpointError(f"{str(path)!r} is an interrupted save and cannot be resumed; use the previous checkpoint")
    for required in ("COMPLETE", "trainer_state.json", "model_optim/.metadata"):
        if not (path / required).is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {required} is missing; resume from an "
                                  f"earlier checkpoint")
    check_index_is_plain_data(path)


# The classes a torch.distributed.checkpoint index may reference (checked on torch 2.11 and 2.13).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                     ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch as _torch

        allowed = (module, name) in _METADATA_GLOBALS or module in _METADATA_MODULES or (
            module == "torch" and isinstance(getattr(_torch, name, None), _torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def check_index_is_plain_data(path: Path) -> None:
    """Unpickle a checkpoint index with an allow-list before PyTorch unpickles it without one."""
    index = path / "model_optim" / ".metadata"
    try:
        _IndexUnpickler(io.BytesIO(index.read_bytes())).load()
    except pickle.UnpicklingError as exc:
        if "refusing" in str(exc):
            raise CheckpointError(f"{str(index)!r} references code ({exc}), which a checkpoint index never does; "
                                  f"it was not loaded. Use a checkpoint written by ndparallel") from None
        raise CheckpointError(f"{str(index)!r} is corrupted ({exc}); resume from an earlier checkpoint") from None
    except Exception as exc:
        raise CheckpointError(f"{str(index)!r} is corrupted ({type(exc).__name__}: {exc}); resume from an earlier "
                              f"checkpoint") from None


def _shape_of(config: Any) -> dict:
    return {k: getattr(config, k, None) for k in _SHAPE_KEYS}


def _state_dicts(model, optimizer):
    options = StateDictOptions(full_state_dict=False, cpu_offload=False)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def save(output_dir: Path, *, state: TrainState, model, optimizer, scheduler, order, topology: Topology, config,
         keep: int | None, tokenizer=None, extra: dict | None = None) -> Path:
    """Write a checkpoint of the current step atomically (a collective: every rank calls it)."""
    root = checkpoints_dir(output_dir)
    name = f"step-{state.step}"
    partial = root / f".partial-{name}"
    final = root / name
    if topology.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        (partial / "rng").mkdir(parents=True)
    dist.barrier()
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(partial / "model_optim"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, partial / "rng" / f"rank-{topology.rank}.pt")
    _fsync_dir(partial / "rng")
    dist.barrier()
    if topology.is_main:
        layout = topology.layout
        trainer_state = {
            "format_version": FORMAT_VERSION, **asdict(state), "data": order.state_dict(),
            "data_rows_per_batch": order.global_batch_rows,
            "scheduler": scheduler.state_dict(), "world_size": topology.world_size,
            "layout": {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "cp": layout.cp,
                       "tp": layout.tp},
            "model_shape": _shape_of(model.config),
        }
        _write_atomic(partial / "trainer_state.json", json.dumps(trainer_state, indent=1, default=_json_default))
        _write_atomic(partial / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        _write_atomic(partial / "hf_config.json", model.config.to_json_string())
        if extra:
            _write_atomic(partial / "extra.json", json.dumps(extra, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(partial / "tokenizer")
        _write_atomic(partial / "COMPLETE", "")
        _fsync_dir(partial)
        if final.exists():  # a rerun of the same step after a resume: replace it
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / "latest", name)
        _prune(root, keep)
    dist.barrier()
    return final


def load(path: Path, *, model, optimizer, scheduler, order, topology: Topology, config) -> TrainState:
    """Restore model, optimizer, scheduler, data position and RNG from ``path`` into the current layout."""
    _check_complete(path)
    try:
        meta = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{str(path / 'trainer_state.json')!r} is unreadable ({exc}); the checkpoint is "
                              f"corrupted, resume from an earlier one") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta.get('format_version')}, this version reads "
                              f"{FORMAT_VERSION}")
    saved, current = meta.get("model_shape", {}), _shape_of(model.config)
    diffs = [f"{k}: checkpoint {saved.get(k)} vs model {current[k]}" for k in _SHAPE_KEYS if saved.get(k) != current[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {str(path)!r} is of another model shape ({'; '.join(diffs)}); "
                              f"resume with the config it was saved with")
    states = _state_dicts(model, optimizer)
    try:
        dcp.load(states, checkpoint_id=str(path / "model_optim"))
    except (Exception, CheckpointException) as exc:  # truncated / corrupted shards, on every rank
        raise CheckpointError(f"cannot read the shards in {str(path / 'model_optim')!r}: {_first_line(exc)}; the "
                              f"checkpoint is corrupted or incomplete, resume from an earlier one") from None
    set_model_state_dict(model, states["model"])
    set_optimizer_state_dict(model, optimizer, states["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])
    rows_before = meta.get("data_rows_per_batch")
    order.load_state_dict(_rescale_data_position(meta["data"], rows_before, order.global_batch_rows))
    rng_file = path / "rng" / f"rank-{topology.rank}.pt"
    if meta.get("world_size") == topology.world_size and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return TrainState(step=int(meta["step"]), tokens=int(meta["tokens"]))


def _rescale_data_position(data_state: dict, rows_before: int | None, rows_now: int | None) -> dict:
    """The data position is kept in global rows: another data-parallel width continues at the same row."""
    if not rows_before or not rows_now or rows_before == rows_now:
        return data_state
    state = dict(data_state)
    done_rows = state["batches_done_in_epoch"] * rows_before
    if done_rows % rows_now:
        raise CheckpointError(f"the checkpoint consumed {done_rows} rows of its epoch, which is not a whole number of "
                              f"the new global micro-batch ({rows_now} rows); choose micro_batch_size so that "
                              f"micro_batch_size x data-parallel ranks divides {done_rows}")
    state["batches_done_in_epoch"] = done_rows // rows_now
    return state


def _prune(root: Path, keep: int | None) -> None:
    if not keep:
        return
    steps = sorted((p for p in root.iterdir() if p.name.startswith("step-")), key=lambda p: int(p.name[5:]))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in trainer_state.json")


def _first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # CheckpointException: the underlying error per rank
    if isinstance(failures, dict) and failures:
        rank, cause = next(iter(failures.items()))
        cause = cause[0] if isinstance(cause, tuple) else getattr(cause, "exc", cause)
        message = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
        return f"rank {rank}: {type(cause).__name__}" + (f": {message}" if message else " (a shard file is truncated?)")
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
