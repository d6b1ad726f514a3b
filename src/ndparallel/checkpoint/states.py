"""What a checkpoint holds: your objects, each turned into a state dict and back.

A training state is a dict of named objects (``{"model": model, "optimizer": opt, "scheduler": sched,
"data": loader}``). Each value is one of:

- an ``nn.Module`` (plain, or parallelized by ndparallel: FSDP2 / tensor-parallel DTensors): saved with
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict``, keyed by parameter name with each
  tensor's global shape, so it loads into any other layout;
- a ``torch.optim.Optimizer``: keyed by parameter name the same way (so it reshards too); it belongs to
  the one ``nn.Module`` of the state (with several models, wrap it: ``OptimizerState(model, optimizer)``);
- any object with ``state_dict()`` / ``load_state_dict()`` (a scheduler, a data loader, your own);
- a plain dict, restored in place.

Tensors that are not DTensors are taken as the same on every rank (torch.distributed.checkpoint stores one
copy); non-tensor values may differ per rank (they are kept per rank, see ``loading``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.errors import CheckpointError
from ndparallel.quantized.linears import is_quantized

_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


class ModelState:
    """A model's state by parameter name, each tensor sharded as it lives (DTensor under FSDP/TP).

    A model with quantized base weights (QLoRA, 8-bit; ``quantized/``) saves its trainable tensors only: its
    frozen weights are rebuilt from base_model on resume (quantizing is deterministic), and quantized
    tensors have no place in a resharding checkpoint."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.frozen_rebuilt = any(is_quantized(p) for p in model.parameters())
        self.options = (
            StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=True)
            if self.frozen_rebuilt
            else _SHARDED
        )

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.frozen_rebuilt:
            set_model_state_dict(self.model, state, options=_SHARDED)
            return
        options = StateDictOptions(full_state_dict=False, cpu_offload=False, strict=False)
        missing = set(set_model_state_dict(self.model, state, options=options).missing_keys)
        trainable = {_compat.canonical_name(n) for n, p in self.model.named_parameters() if p.requires_grad}
        if missing & trainable:
            raise CheckpointError(
                f"the checkpoint lacks trainable weights {sorted(missing & trainable)[:3]}; was it saved by "
                f"a run with other adapters?"
            )


class OptimizerState:
    """An optimizer's state keyed by the names of ``model``'s parameters (not by position).

    Quantized states (torchao's ``AdamW8bit``: 8-bit codes with one float32 scale per block of 256 consecutive
    values, a tensor subclass that checkpoint staging cannot copy) are saved as two plain tensors each: the codes,
    shaped and split like the parameter, and the scales shaped ``(*shape[:-1], shape[-1] // 256)`` and split the
    same way, so a block is a run of 256 values of one row on every layout (where each rank's rows are whole
    blocks: torchao's own condition for the full tensor's blocks) and the pair reshards as any tensor and comes
    back as the same codes and scales. A state whose rows are not whole blocks is saved as its float32 values and
    quantized again on load (close, not bitwise: a block's scale is recomputed from its dequantized values)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
        # new dicts: the entries may be the optimizer's own
        state["state"] = {name: _saved_entry(entry) for name, entry in state["state"].items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        live = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)["state"]
        for name, entry in state["state"].items():
            for key in [k for k in entry if k.endswith(_CODES)] + [k for k in entry if k.endswith(_VALUES)]:
                base = key.rsplit("::", 1)[0]
                current = live.get(name, {}).get(base)
                if current is None or not _is_quantized_state(current):
                    raise CheckpointError(
                        f"the checkpoint holds 8-bit optimizer states ({name}); resume with optimizer: adamw_8bit"
                    )
                if key.endswith(_CODES):
                    local = _local(current)
                    local.codes.copy_(_local(entry.pop(key)))
                    local.scale.copy_(_local(entry.pop(base + _SCALES)).reshape(-1))
                else:
                    current.copy_(entry.pop(key))  # the subclass's copy quantizes
                entry[base] = current
        set_optimizer_state_dict(self.model, self.optimizer, state, options=_SHARDED)


_CODES, _SCALES, _VALUES = "::codes8", "::scales8", "::values8"
"""Suffixes of a quantized state's saved parts (``OptimizerState``)."""


def _saved_entry(entry: dict[str, Any]) -> dict[str, Any]:
    saved = {}
    for key, value in entry.items():
        saved.update(_quantized_parts(key, value) if _is_quantized_state(value) else {key: value})
    return saved


def _is_quantized_state(value: Any) -> bool:
    """A tensor subclass with codes and scales (torchao's 8-bit optimizer states), itself or a DTensor's shard."""
    local = _local(value)
    return isinstance(local, torch.Tensor) and type(local) is not torch.Tensor and hasattr(local, "codes")


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _quantized_parts(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{key::codes8, key::scales8}`` (blocks within rows on this rank), else ``{key::values8}``."""
    local = _local(value)
    block = local.block_size
    rows_of_blocks = value.dim() >= 1 and value.shape[-1] % block == 0 and local.codes.shape[-1] % block == 0
    if rows_of_blocks:
        scales = local.scale.view(*local.codes.shape[:-1], local.codes.shape[-1] // block)
        scale_shape = torch.Size((*value.shape[:-1], value.shape[-1] // block))
        return {key + _CODES: _like(value, local.codes, value.shape), key + _SCALES: _like(value, scales, scale_shape)}
    return {key + _VALUES: _like(value, local.dequantize(), value.shape)}


def _like(value: torch.Tensor, local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``local`` as a DTensor split as ``value`` is (global ``shape``), or as it is when ``value`` is plain."""
    if not isinstance(value, DTensor):
        return local
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=shape, stride=stride)


class _DictState:
    def __init__(self, target: dict) -> None:
        self.target = target

    def state_dict(self) -> dict:
        return self.target

    def load_state_dict(self, state: dict) -> None:
        self.target.clear()
        self.target.update(state)


def adapt(states: dict[str, Any]) -> dict[str, Any]:
    """Each named object as something with ``state_dict`` / ``load_state_dict``."""
    if not isinstance(states, dict) or not states or not all(isinstance(k, str) and k for k in states):
        raise CheckpointError(
            "the training state must be a non-empty dict of named objects, e.g. {'model': model, "
            "'optimizer': optimizer}"
        )
    models = [v for v in states.values() if isinstance(v, nn.Module)]
    adapted = {}
    for name, obj in states.items():
        if isinstance(obj, nn.Module):
            adapted[name] = ModelState(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            if len(models) != 1:
                raise CheckpointError(
                    f"the optimizer {name!r} needs its model: the state holds {len(models)} "
                    f"nn.Module objects; give OptimizerState(model, optimizer) instead"
                )
            adapted[name] = OptimizerState(models[0], obj)
        elif isinstance(obj, dict):
            adapted[name] = _DictState(obj)
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            adapted[name] = obj
        else:
            raise CheckpointError(
                f"{name!r} is a {type(obj).__name__}, which cannot be checkpointed: give an "
                f"nn.Module, an optimizer, a dict, or an object with state_dict() and "
                f"load_state_dict()"
            )
    return adapted


def optimizers_of(states: dict[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers among the (adapted) states: their step must not run while a save still copies."""
    found = []
    for obj in states.values():
        optimizer = obj.optimizer if isinstance(obj, OptimizerState) else obj
        if isinstance(optimizer, torch.optim.Optimizer):
            found.append(optimizer)
    return found
