"""FSDP2 (``fully_shard``) per wrap unit, on the data-parallel mesh: HSDP when it is 2-D.

The wrap unit is the memory-versus-communication knob: each unit's parameters are all-gathered in one
collective before it runs and freed after (``reshard_after_forward``), so bigger units mean fewer, larger
collectives and more memory held at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.models.decoder import DecoderParts


def apply_fsdp(
    parts: DecoderParts,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    wrap: str | int = "block",
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    inner_units: Sequence[tuple[torch.nn.Module, DeviceMesh]] = (),
    ignored_params: set[torch.nn.Parameter] | None = None,
) -> None:
    """Shard ``parts.model`` in place. ``wrap`` is 'block', 'model' or N (groups of N decoder layers).

    ``inner_units``: (module, mesh) pairs sharded first, on their own meshes (MoE experts and blocks, see
    parallel/expert.py), whatever ``wrap`` is: their gradients must be summed over those meshes.
    ``ignored_params``: parameters FSDP leaves as they are (4-bit weights with nothing to shard over).
    """
    _check_reshard(reshard_after_forward, shard_size=dp_mesh.size(dp_mesh.ndim - 1), parts=parts)
    if dp_mesh.size() == 1:
        # Nothing to gather from other ranks: keep the (mixed-precision) copies from forward to backward
        # instead of casting them again.
        reshard_after_forward = False
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    common = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored_params)

    for module, mesh in inner_units:
        # A partial-reshard rank count belongs to the layers' mesh; these units reshard fully (or not at all).
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward is not False and mesh.size() > 1,
            ignored_params=ignored_params,
        )
    groups = wrap_units(list(parts.layers), wrap)
    for i, group in enumerate(groups):
        # The last unit runs first in backward: keeping it gathered saves one all-gather. The others keep
        # the setting as given (an int N means: sharded over N ranks between forward and backward).
        last = i == len(groups) - 1
        fully_shard(
            group[0] if len(group) == 1 else group,
            reshard_after_forward=False if last else reshard_after_forward,
            **common,
        )
    if groups and not parts.tied:
        # Embedding and head in units of their own, so a large vocabulary is not held gathered all step.
        fully_shard(parts.embed, reshard_after_forward=reshard_after_forward, **common)
        fully_shard([parts.final_norm, parts.lm_head], reshard_after_forward=False, **common)
    fully_shard(parts.model, reshard_after_forward=False, **common)
    for module in parts.model.modules():
        if isinstance(module, FSDPModule):
            _compat.set_gradient_sum(module)


def _check_reshard(reshard_after_forward: bool | int, *, shard_size: int, parts: DecoderParts) -> None:
    """An int N keeps gathered parameters sharded over N ranks between forward and backward."""
    if not isinstance(reshard_after_forward, int) or isinstance(reshard_after_forward, bool):
        return
    if any(isinstance(p, DTensor) for p in parts.model.parameters()):
        # FSDP2 cannot reshard a tensor-parallel (DTensor) parameter to a smaller group after forward.
        raise ConfigError(
            f"reshard_after_forward={reshard_after_forward} (a number of ranks) cannot be combined with "
            f"tensor_parallel_size > 1; use true or false"
        )
    if not (1 < reshard_after_forward < shard_size and shard_size % reshard_after_forward == 0):
        raise ConfigError(
            f"reshard_after_forward={reshard_after_forward} must be a divisor of the FSDP shard size "
            f"{shard_size} other than 1 and {shard_size} (or true/false)"
        )


def wrap_units(layers: list[torch.nn.Module], wrap: str | int) -> list[list[torch.nn.Module]]:
    """The decoder layers grouped into FSDP units ('model': none, the root unit holds them all)."""
    if wrap == "model":
        return []
    if wrap == "block":
        return [[layer] for layer in layers]
    if isinstance(wrap, int) and not isinstance(wrap, bool) and wrap >= 1:
        return [layers[i : i + wrap] for i in range(0, len(layers), wrap)]
    raise ConfigError(f"fsdp_wrap={wrap!r} must be 'block', 'model' or a positive number of layers per unit")
