"""A state dict as tensors (for the shard files) plus a JSON skeleton of everything else.

``split_state("optimizer", sd)`` walks a state dict: each tensor (or DTensor) leaf is taken out under a
dotted key (torch.distributed.checkpoint's own flattening: ``optimizer.state.<param>.exp_avg``) and
replaced by a reference; numbers, strings, None, lists, tuples and dicts stay in the skeleton, which is
written as JSON. ``join_state`` puts loaded tensors back. Anything else in a state dict (a function, an
arbitrary object) is refused at save time: what cannot be written as JSON or a tensor is never written,
so loading never has to unpickle.

    {"state": {"w": {"step": t0, "exp_avg": t1}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]}
    -> tensors  {"optimizer.state.w.step": t0, "optimizer.state.w.exp_avg": t1}
    -> skeleton {"state": {"w": {"step": {"__ndp__": "tensor", "key": "optimizer.state.w.step"}, ...}},
                 "param_groups": [{"lr": 0.1, "betas": {"__ndp__": "tuple", "items": [0.9, 0.95]}, "params": ["w"]}]}
"""

from __future__ import annotations

import base64
import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ndparallel.errors import CheckpointError

TAG = "__ndp__"
_PLAIN = (str, type(None))


def split_state(prefix: str, value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, tensors by key) of one state dict."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(item: Any, path: str) -> Any:
        if isinstance(item, torch.Tensor):
            if path in tensors:
                raise CheckpointError(
                    f"two tensors of the state {prefix!r} would be stored as {path!r}; rename one "
                    f"of the state dict keys"
                )
            tensors[path] = item
            return {TAG: "tensor", "key": path}
        if isinstance(item, Mapping):
            if all(isinstance(k, str) for k in item) and TAG not in item:
                return {k: encode(v, f"{path}.{k}") for k, v in item.items()}
            return {TAG: "dict", "items": [[_plain(k, path), encode(v, f"{path}.{k}")] for k, v in item.items()]}
        if isinstance(item, list):
            return [encode(v, f"{path}.{i}") for i, v in enumerate(item)]
        if isinstance(item, tuple):
            return {TAG: "tuple", "items": [encode(v, f"{path}.{i}") for i, v in enumerate(item)]}
        return _plain(item, path)

    return encode(value, prefix), tensors


def _plain(item: Any, path: str) -> Any:
    if isinstance(item, bool) or isinstance(item, _PLAIN):
        return item
    if isinstance(item, numbers.Integral):
        return int(item)
    if isinstance(item, numbers.Real):
        return float(item)
    raise CheckpointError(
        f"{path} is a {type(item).__name__}, which a checkpoint does not store: state_dict values "
        f"must be tensors, numbers, strings, None, or lists, tuples and dicts of them"
    )


def join_state(skeleton: Any, tensors: Mapping[str, torch.Tensor], *, where: str) -> Any:
    """The state dict a skeleton describes, with its tensors from ``tensors``."""

    def decode(item: Any) -> Any:
        if isinstance(item, list):
            return [decode(v) for v in item]
        if not isinstance(item, dict):
            return item
        if TAG not in item:
            return {k: decode(v) for k, v in item.items()}
        kind = item[TAG]
        if kind == "tensor" and isinstance(item.get("key"), str):
            if item["key"] not in tensors:
                raise CheckpointError(f"{where} names the tensor {item['key']!r}, which the shard files do not hold")
            return tensors[item["key"]]
        if kind == "tuple" and isinstance(item.get("items"), list):
            return tuple(decode(v) for v in item["items"])
        if (
            kind == "dict"
            and isinstance(item.get("items"), list)
            and all(isinstance(p, list) and len(p) == 2 for p in item["items"])
        ):
            return {_hashable(k, where): decode(v) for k, v in item["items"]}
        raise CheckpointError(f"{where} holds an entry {str(item)[:80]!r} that ndparallel does not write")

    return decode(skeleton)


def _hashable(key: Any, where: str) -> Any:
    if isinstance(key, (dict, list)):
        raise CheckpointError(f"{where} holds a dict key {str(key)[:80]!r} that ndparallel does not write")
    return key


def tensor_keys(skeleton: Any) -> list[str]:
    """The keys of the tensors a skeleton refers to, in order."""
    found: list[str] = []

    def walk(item: Any) -> None:
        if isinstance(item, list):
            for v in item:
                walk(v)
        elif isinstance(item, dict):
            if item.get(TAG) == "tensor":
                found.append(item.get("key"))
            else:
                for v in item.values():
                    walk(v)

    walk(skeleton)
    return found


def rng_state() -> dict[str, str]:
    """This process's random generator states (CPU, and the current CUDA device), as base64 text."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return {k: base64.b64encode(v.numpy().tobytes()).decode("ascii") for k, v in states.items()}


def set_rng_state(states: Any, *, where: str) -> None:
    if not isinstance(states, dict) or not all(isinstance(v, str) for v in states.values()):
        raise CheckpointError(f"{where}: the random generator states are not in the format ndparallel writes")
    try:
        decoded = {
            k: torch.frombuffer(bytearray(base64.b64decode(v, validate=True)), dtype=torch.uint8)
            for k, v in states.items()
        }
        if "cpu" in decoded:
            torch.set_rng_state(decoded["cpu"])
        if "cuda" in decoded and torch.cuda.is_available():
            torch.cuda.set_rng_state(decoded["cuda"])
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: cannot restore the random generator states ({exc})") from None


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint file (JSON cannot run code; this only names what is wrong)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is missing; the checkpoint is incomplete") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{str(path)!r} is not readable JSON ({type(exc).__name__}: {exc}); the file is "
            f"damaged or was not written by ndparallel"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{str(path)!r} holds a JSON {type(value).__name__}, not the object ndparallel writes")
    return value
