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

from ndparallel import _compat
from ndparallel.checkpoint import codec, eight_bit
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

    torchao's 8-bit states (``AdamW8bit``: a tensor subclass that checkpoint staging cannot copy, quantized on
    some layouts and not on others) are saved and read back in the forms ``checkpoint/eight_bit.py`` describes:
    bitwise where the layout allows it, and loadable on any other."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.block = optimizer.block_size if eight_bit.is_eight_bit(optimizer) else None

    def state_dict(self) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
        if self.block is not None:  # new dicts: the entries may be the optimizer's own
            state["state"] = {name: self._saved_entry(entry) for name, entry in state["state"].items()}
        return state

    def _saved_entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        saved = {}
        for key, value in entry.items():
            tensor = isinstance(value, torch.Tensor) and value.dim() > 0
            saved.update(eight_bit.saved_parts(key, value, self.block) if tensor else {key: value})
        return saved

    def load_templates(self, saved: dict[str, Any]) -> dict[str, Any]:
        """What to read into: the live state, with each 8-bit state in the form the checkpoint holds
        (``saved``: the checkpoint's skeleton of this state, its keys)."""
        saved_state = saved.get("state") if isinstance(saved, dict) else None
        saved_state = saved_state if isinstance(saved_state, dict) else {}
        holds_parts = any(isinstance(e, dict) and eight_bit.holds_parts(e) for e in saved_state.values())
        if holds_parts and self.block is None:
            raise CheckpointError(
                "the checkpoint holds 8-bit optimizer states (torchao's AdamW8bit); resume with optimizer: adamw_8bit"
            )
        if self.block is not None and not codec.tensor_keys(saved.get("param_groups")):  # torchao's lr is a tensor
            raise CheckpointError(
                "the checkpoint holds the states of another optimizer, not torchao's 8-bit AdamW; resume with the "
                "optimizer it was saved with"
            )
        state = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)
        if self.block is None:
            return state
        templates = {}
        for name, entry in state["state"].items():
            keys = set(saved_state.get(name, {})) if isinstance(saved_state.get(name), dict) else set()
            templates[name] = {}
            for key, value in entry.items():
                tensor = isinstance(value, torch.Tensor) and value.dim() > 0
                templates[name].update(eight_bit.templates(key, value, keys, self.block) if tensor else {key: value})
        state["state"] = templates
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.block is not None:
            live = get_optimizer_state_dict(self.model, self.optimizer, options=_SHARDED)["state"]
            for name, entry in state["state"].items():
                for key, value in live.get(name, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        eight_bit.restore(key, value, entry, self.block)
                        entry[key] = value
        set_optimizer_state_dict(self.model, self.optimizer, state, options=_SHARDED)


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
