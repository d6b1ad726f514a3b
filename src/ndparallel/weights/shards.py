"""A rank's part of a parameter: what it holds of the global tensor, and filling it from the whole."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ndparallel import _compat


def copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Fill this rank's part of ``target`` (a DTensor or a plain tensor) from ``full``, the whole tensor."""
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        # Slices locally (src_data_rank=None): every rank holds ``full`` already, no communication.
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """This rank's storage of ``param`` and the index of the global tensor it holds (None: not one box)."""
    if not isinstance(param, DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    local = param.to_local()
    offsets, sizes = _compat.local_region(param)
    if tuple(sizes) != tuple(local.shape):
        return local, None
    return local, tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
