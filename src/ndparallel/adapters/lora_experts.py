"""LoRA on the stacked expert weights of mixture-of-experts models (PEFT's ``target_parameters``).

An adapted expert weight W (E, out, in) — (E, in, out) for families that store it transposed — gains two
3-D parameters on its experts module, named after it:

    <name>_lora_A (E, r, in)    uniform(+-1/sqrt(in)), like PEFT's
    <name>_lora_B (E, out, r)   zeros: training starts at the base model

and the experts compute with W[e] + alpha/r * B[e] @ A[e] (``models/moe_experts.adapted_weight``), the
adapters indexed by expert like the weight: under expert parallelism they are split over ep with it. The
base weight stays frozen and keeps its name, so checkpoints and exports keep transformers' names.

PEFT's format (``ParamWrapper``, peft >= 0.17): per adapted weight ``lora_A.weight`` (E*r, in) is A
flattened expert-major, ``lora_B.weight`` (out, r*E) is B as (out, r, E) flattened; when several weights of
one module are adapted PEFT nests its wrappers, the first one named in ``target_parameters`` innermost
(``experts.base_layer.lora_A`` for the first of two, ``experts.lora_A`` for the last).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.models.moe import moe_blocks
from ndparallel.models.moe_experts import adapted_weight, ensure_ndparallel_experts

ADAPTABLE = ("gate_up_proj", "up_proj", "down_proj")


def expert_targets(
    model: nn.Module, layers: nn.ModuleList, target_parameters: list[str]
) -> list[tuple[str, nn.Module, list[str]]]:
    """(module path, experts module, adapted weight names in PEFT's nesting order) of every MoE block."""
    paths = {id(m): name for name, m in model.named_modules()}
    found = []
    for block in moe_blocks(layers):
        path = paths[id(block.experts)]
        names = [
            name
            for target in target_parameters
            for name in ADAPTABLE
            if isinstance(getattr(block.experts, name, None), nn.Parameter)
            and (target == name or f"{path}.{name}".endswith("." + target))
        ]
        if names:
            found.append((path, block.experts, list(dict.fromkeys(names))))
    if target_parameters and not found:
        raise ConfigError(
            f"lora_target_parameters={target_parameters} matches no expert weight; use names such as "
            f"['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'] on a mixture-of-experts model"
        )
    return found


def attach_expert_lora(
    model: nn.Module,
    layers: nn.ModuleList,
    *,
    target_parameters: list[str],
    r: int,
    scaling: float,
    dropout: float,
    seed: int,
    ep_mesh: DeviceMesh | None,
    init,
) -> None:
    """Add adapters to the targeted expert weights (after expert parallelism, before FSDP)."""
    if dropout:
        raise ConfigError(
            f"lora_dropout={dropout} cannot apply to expert weights (the input of each expert is not "
            f"one tensor); set lora_dropout: 0 with lora_target_parameters"
        )
    for path, experts, names in expert_targets(model, layers, target_parameters):
        for name in names:
            weight = getattr(experts, name)
            num, d1, d2 = weight.shape  # global shape, also for a DTensor
            out_f, in_f = (d2, d1) if experts.is_transposed else (d1, d2)
            device = weight.to_local().device if isinstance(weight, DTensor) else weight.device
            for suffix, shape in (("lora_A", (num, r, in_f)), ("lora_B", (num, out_f, r))):
                tensor = torch.empty(shape, device=device)
                if device.type != "meta":
                    tensor = init(f"{path}.{name}_{suffix}", shape, seed, device)
                if ep_mesh is not None:
                    tensor = distribute_tensor(tensor, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, f"{name}_{suffix}", nn.Parameter(tensor))
        experts.lora_scaling = scaling
    ensure_ndparallel_experts(model)


def adapted_names(experts: nn.Module) -> list[str]:
    return [name for name in ADAPTABLE if hasattr(experts, f"{name}_lora_A")]


def expert_adapter_state(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Full expert adapters in PEFT's layout and names (a collective under DTensor)."""
    out = {}
    for path, experts in model.named_modules():
        names = adapted_names(experts)
        for i, name in enumerate(names):
            a, b = (_full(getattr(experts, f"{name}_lora_{x}")) for x in "AB")
            num, rank, in_f = a.shape
            key = f"{prefix}{_clean(path)}." + "base_layer." * (len(names) - 1 - i)
            out[key + "lora_A.weight"] = a.reshape(num * rank, in_f).contiguous()
            out[key + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * num).contiguous()
    return out


def expert_target_parameters(model: nn.Module) -> list[str]:
    """PEFT's ``target_parameters`` for the adapters present, in their nesting order."""
    found: list[str] = []
    for path, experts in model.named_modules():
        for name in adapted_names(experts):
            entry = f"{_clean(path).split('.layers.', 1)[-1].split('.', 1)[-1]}.{name}"  # e.g. mlp.experts.gate_up_proj
            if entry not in found:
                found.append(entry)
    return found


def merge_expert_lora(model: nn.Module) -> None:
    """Fold expert adapters into their weights and remove them (one process, plain tensors)."""
    with torch.no_grad():
        for _, experts in model.named_modules():
            for name in adapted_names(experts):
                merged = adapted_weight(experts, name).float()
                getattr(experts, name).copy_(merged.to(getattr(experts, name).dtype))
                delattr(experts, f"{name}_lora_A")
                delattr(experts, f"{name}_lora_B")


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().cpu()


def _clean(path: str) -> str:
    return _compat.canonical_name(path)
