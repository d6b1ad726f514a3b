"""The trainer's checkpoints: a ``Checkpointer`` over the trainer's objects, plus the facts a resume checks.

A trainer checkpoint (``output_dir/checkpoints/step-N``) holds the states ``model``, ``optimizer``,
``scheduler``, ``data`` (the position in the data order, in global rows, so another data-parallel width
continues at the same row) and ``progress`` (step, tokens), and beside them ``config.yaml`` (the resolved
training config), ``hf_config.json`` (all ``export`` needs besides the tensors), ``tokenizer/`` and, for
LoRA runs, ``extra.json``. ``index.json``'s metadata records the layout, world size and model shape it
was saved under; a resume under another model shape is refused before anything is read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from ndparallel.checkpoint import store
from ndparallel.checkpoint.checkpointer import Checkpointer
from ndparallel.checkpoint.loading import open_checkpoint
from ndparallel.errors import CheckpointError
from ndparallel.mesh.topology import Topology

_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


@dataclass
class TrainState:
    """How far training went: optimizer steps and (real, non-padding) input tokens over all ranks."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


class DataPosition:
    """A ``DataOrder``'s position, rescaled on load when the global batch has another number of rows."""

    def __init__(self, order) -> None:
        self.order = order

    def state_dict(self) -> dict[str, Any]:
        return {**self.order.state_dict(), "global_batch_rows": self.order.global_batch_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        rows_before, rows_now = state.pop("global_batch_rows", None), self.order.global_batch_rows
        if rows_before and rows_before != rows_now:
            done_rows = state["batches_done_in_epoch"] * rows_before
            if done_rows % rows_now:
                raise CheckpointError(
                    f"the checkpoint consumed {done_rows} rows of its epoch, which is not a whole "
                    f"number of the new global micro-batch ({rows_now} rows); choose "
                    f"micro_batch_size so that micro_batch_size x data-parallel ranks divides "
                    f"{done_rows}"
                )
            state["batches_done_in_epoch"] = done_rows // rows_now
        self.order.load_state_dict(state)


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def has_checkpoints(output_dir: Path) -> bool:
    return store.has_checkpoints(checkpoints_dir(output_dir))


def find_resume(output_dir: Path, request: str | None) -> Path | None:
    """Resolve ``resume_from_checkpoint`` (None, 'latest' or a path) to a checked checkpoint directory.

    A requested resume never silently starts from scratch: anything that cannot be resumed is an error.
    """
    if request is None:
        return None
    if request == "latest":
        root = checkpoints_dir(output_dir)
        target = store.latest(root)
        if target is None:
            raise CheckpointError(
                f"resume_from_checkpoint: latest, but {str(root / 'latest')!r} does not exist (no "
                f"complete checkpoint in {str(root)!r}); remove the setting to start from scratch"
            )
    else:
        target = Path(request)
        if not target.is_dir():
            raise CheckpointError(
                f"resume_from_checkpoint {request!r} is not a directory; give a checkpoint "
                f"directory (output_dir/checkpoints/step-N) or 'latest'"
            )
    open_checkpoint(target)
    return target


def trainer_checkpointer(output_dir: Path, *, keep: int | None, async_save: bool, timeout_s: float) -> Checkpointer:
    return Checkpointer(checkpoints_dir(output_dir), keep=keep, async_save=async_save, timeout_s=timeout_s)


def _states(model, optimizer, scheduler, order, state: TrainState) -> dict[str, Any]:
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "data": DataPosition(order),
        "progress": state,
    }


def save(
    checkpointer: Checkpointer,
    *,
    state: TrainState,
    model,
    optimizer,
    scheduler,
    order,
    topology: Topology,
    config,
    tokenizer=None,
    extra: dict | None = None,
) -> Path:
    """Checkpoint the trainer at ``state.step`` (a collective; asynchronous if the checkpointer is)."""
    layout = topology.layout
    meta = {
        "layout": {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "cp": layout.cp, "tp": layout.tp},
        "model_shape": _shape_of(model.config),
    }

    def write_files(directory: Path) -> None:
        store.write_atomic(directory / "config.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        store.write_atomic(directory / "hf_config.json", model.config.to_json_string())
        if extra:
            store.write_atomic(directory / "extra.json", json.dumps(extra, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(directory / "tokenizer")

    return checkpointer.save(
        state.step, _states(model, optimizer, scheduler, order, state), meta=meta, extra_files=write_files
    )


def load(checkpointer: Checkpointer, path: Path, *, model, optimizer, scheduler, order) -> TrainState:
    """Restore model, optimizer, scheduler, data position and RNG from ``path`` into the current layout."""
    saved = open_checkpoint(path)["meta"].get("model_shape", {})
    current = _shape_of(model.config)
    diffs = [f"{k}: checkpoint {saved.get(k)} vs model {current[k]}" for k in _SHAPE_KEYS if saved.get(k) != current[k]]
    if diffs:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of another model shape ({'; '.join(diffs)}); "
            f"resume with the config it was saved with"
        )
    state = TrainState()
    checkpointer.load(_states(model, optimizer, scheduler, order, state), path)
    return state


def _shape_of(config: Any) -> dict:
    return {k: getattr(config, k, None) for k in _SHAPE_KEYS}
