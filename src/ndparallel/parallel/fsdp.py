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
) -> None:
    """Shard ``parts.model`` in place. ``wrap`` is 'block', 'model' or N (groups of N decoder layers).

    ``inner_units``: (module, mesh) pairs sharded first, on their own meshes (MoE experts and blocks, see
    parallel/expert.py), whatever ``wrap`` is: their gradients must be summed over those meshes.
    """
    shard_size = dp_mesh.size(dp_mesh.ndim - 1)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        if not (1 < reshard_after_forward < shard_size and shard_size % reshard_after_forward == 0):
            raise ConfigError(
                f"reshard_after_forward={reshard_after_forward} must be a divisor of the FSDP shard size "
                f"{shard_size} other than 1 and {shard_size} (or true/false)"
            )
    if dp_mesh.size() == 1:
        # Nothing to gather from other ranks: keep the (mixed-precision) copies from forward to backward
        # instead of casting them again.
        reshard_after_forward = False
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    common = dict(mesh=dp_mesh, mp_policy=mp, offload_policy=offload)

    for module, mesh in inner_units:
        # A partial-reshard rank count belongs to the layers' mesh; these units reshard fully (or not at all).
        fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward is not False and mesh.size() > 1)
    layers = list(parts.layers)
    if wrap == "model":
        groups: list[list[torch.nn.Module]] = []
    elif wrap == "block":
        groups = [[layer] for layer in layers]
    elif isinstance(wrap, int) and wrap >= 1:
        groups = [layers[i : i + wrap] for i in range(0, len(layers), wrap)]
    else:
        raise ConfigError(f"fsdp_wrap={wrap!r} must be 'block', 'model' or a positive number of layers per unit")

    for i, group in enumerate(groups):
        # The last unit runs first in backward: keeping it gathered saves one all-gather.
        last = i == len(groups) - 1
        fully_shard(group[0] if len(group) == 1 else group, reshard_after_forward=reshard_after_forward and not last,
                    **common)
    if groups and not parts.tied:
        # Embedding and head in units of their own, so a large vocabulary is not held gathered all step.
        fully_shard(parts.embed, reshard_after_forward=reshard_after_forward, **common)
        fully_shard([parts.final_norm, parts.lm_head], reshard_after_forward=False, **common)
    fully_shard(parts.model, reshard_after_forward=False, **common)
    for module in parts.model.modules():
        if isinstance(module, FSDPModule):
            _compat.set_gradient_sum(module)
