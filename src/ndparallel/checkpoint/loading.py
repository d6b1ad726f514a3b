"""Reading a checkpoint back into live objects, on any layout, through the guard.

Order: the directory is checked (``guard.check_tree``), its JSON read, the tensor index read under the
allow-list and checked against the shard files; the tensors the objects hold now are the targets (their
current sharding decides which slices each rank reads: resharding); saved tensors an object does not
hold yet are read whole; then torch.distributed.checkpoint fills the targets (tensor items only), the
JSON skeletons are joined with them and each object's ``load_state_dict`` is called.

Non-tensor state that differed between ranks when saved (a per-rank data loader) is restored per rank,
which needs the same world size; state that was the same everywhere is read from rank 0's file and loads
under any world size. Random generator states are restored only under the same world size.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ndparallel.checkpoint import codec, guard, store
from ndparallel.errors import CheckpointError


def open_checkpoint(path: Path) -> dict:
    """Check a checkpoint directory and return its index (``index.json``); nothing else is read."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a directory; give a checkpoint directory (.../checkpoints/step-N) or 'latest'"
        )
    if path.name.startswith(store.PARTIAL_PREFIX):
        raise CheckpointError(
            f"{str(path)!r} is an interrupted save and cannot be resumed; use the previous checkpoint"
        )
    guard.check_tree(path)
    if not (path / "index.json").is_file() and (path / "trainer_state.json").is_file():
        raise CheckpointError(
            f"{str(path)!r} was written by an earlier ndparallel (format 1, which stored optimizer "
            f"settings as pickles); this version reads format {store.FORMAT_VERSION} only. Export "
            f"it with the version that wrote it, or train again"
        )
    for required in ("COMPLETE", "index.json", "tensors/.metadata"):
        if not (path / required).is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} is incomplete: {required} is missing; resume from an earlier checkpoint"
            )
    index = codec.read_json(path / "index.json")
    if index.get("format") != store.FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {index.get('format')!r}; this version reads "
            f"format {store.FORMAT_VERSION}"
        )
    for key, kind in (("step", int), ("world_size", int), ("states", list), ("per_rank", list), ("meta", dict)):
        if not isinstance(index.get(key), kind):
            raise CheckpointError(
                f"{str(path / 'index.json')!r} has no valid {key!r}; the file is damaged or was "
                f"not written by ndparallel"
            )
    guard.read_index(path / "tensors")  # refused here, before a caller builds anything
    return index


@dataclass
class Restored:
    """What a load restored: the step it was saved at, where from, and the metadata saved with it."""

    step: int
    path: Path
    meta: dict = field(default_factory=dict)
    lineage: str | None = None
    """The history the checkpoint belongs to (``store.prune`` deletes only checkpoints of one history)."""


def load(
    path: Path, states: dict[str, Any], *, rank: int, world_size: int, rng: bool, process_group, distributed: bool
) -> Restored:
    """Restore adapted ``states`` (see ``states.adapt``) from checkpoint ``path``."""
    index = open_checkpoint(path)
    missing = [name for name in states if name not in index["states"]]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds {index['states']}, not {missing}; load the states it holds"
        )
    same_world = index["world_size"] == world_size
    per_rank = [name for name in states if name in index["per_rank"]]
    if per_rank and not same_world:
        raise CheckpointError(
            f"{per_rank} differed between the {index['world_size']} ranks that saved "
            f"{str(path)!r}, so they resume only on {index['world_size']} ranks (this run has "
            f"{world_size})"
        )
    rank_path = path / "ranks" / f"rank-{rank if same_world else 0}.json"
    saved = codec.read_json(rank_path)
    skeletons = saved.get("states")
    if not isinstance(skeletons, dict) or any(name not in skeletons for name in states):
        raise CheckpointError(f"{str(rank_path)!r} does not hold the states {list(states)}")
    tensor_index = guard.read_index(path / "tensors")
    targets = _targets(states, skeletons, tensor_index, path)
    load_tensors(path, targets, tensor_index=tensor_index, process_group=process_group, distributed=distributed)
    for name, obj in states.items():
        obj.load_state_dict(codec.join_state(skeletons[name], targets, where=str(rank_path)))
    if rng and same_world and saved.get("rng") is not None:
        codec.set_rng_state(saved["rng"], where=str(rank_path))
    lineage = index.get("lineage") if isinstance(index.get("lineage"), str) else None
    return Restored(step=index["step"], path=path, meta=index["meta"], lineage=lineage)


def _targets(states: dict[str, Any], skeletons: dict, tensor_index: Metadata, path: Path) -> dict:
    """Tensors to fill: those the objects hold now (in their current sharding), plus saved ones they lack."""
    current: dict[str, torch.Tensor] = {}
    for name, obj in states.items():
        # an object whose saved form depends on the layout (8-bit optimizer states) reads in the form it was saved
        template = obj.load_templates(skeletons[name]) if hasattr(obj, "load_templates") else obj.state_dict()
        current.update(codec.split_state(name, template)[1])
    wanted = [k for name in states for k in codec.tensor_keys(skeletons[name])]
    wanted_set = set(wanted)
    extra = [k for k in current if k not in wanted_set]
    if extra:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no tensor {extra[0]!r} ({len(extra)} missing in all); "
            f"it was saved from another model or setup (adapters, tied weights?)"
        )
    targets = {}
    for key in wanted:
        guard.refuse_pickled_items(tensor_index, [key])
        entry = tensor_index.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: the shard index has no tensor {key!r}; the checkpoint is incomplete"
            )
        if key in current:
            shape = tuple(current[key].shape)  # a DTensor's shape is its global shape
            if shape != tuple(entry.size):
                raise CheckpointError(
                    f"checkpoint {str(path)!r}: {key!r} has shape {tuple(entry.size)} there and "
                    f"{shape} here; it was saved from another model shape"
                )
            targets[key] = current[key]
        else:  # state an object creates lazily (not there yet): read it whole
            targets[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return targets


def load_tensors(
    path: Path,
    targets: dict[str, torch.Tensor],
    *,
    tensor_index: Metadata | None = None,
    process_group=None,
    distributed: bool = True,
) -> None:
    """Fill ``targets`` (key -> tensor or DTensor, in place) from checkpoint ``path``'s shards.

    Usable on its own (export reads a model this way in one process with ``distributed=False``).
    """
    tensor_index = tensor_index or guard.read_index(Path(path) / "tensors")
    guard.refuse_pickled_items(tensor_index, targets)
    try:
        with warnings.catch_warnings():  # "loading in a single process" is the intent when not distributed
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                targets,
                storage_reader=guard.GuardedReader(Path(path) / "tensors", tensor_index),
                planner=guard.TensorsOnlyPlanner(),
                process_group=process_group,
                no_dist=not distributed,
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"cannot read the tensors of {str(path)!r}: {describe(exc)}") from None


def describe(exc: BaseException) -> str:
    """One line saying what failed, from an error of torch.distributed.checkpoint (per-rank failures)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = next(iter(sorted(failures.items())))
        cause = cause[0] if isinstance(cause, tuple) else getattr(cause, "exc", cause)
        if isinstance(cause, CheckpointError):
            return str(cause)
        return f"rank {rank}: {_cause(cause)}"
    return _cause(exc)


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = text[0][:300] if text else ""
    if "Weights only load failed" in str(exc):
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = "a tensor item is not a plain tensor; PyTorch's weights_only loader refused it" + (
            f" (it references {named.group(1)})" if named else ""
        )
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
