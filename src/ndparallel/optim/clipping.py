"""Gradient clipping to one global norm over gradients that live on different meshes.

An optimizer may own its clipping: one that has a ``clip_grad_norm_(parameters, max_norm, *, norm_type)``
method is handed the call (``FlatAdamW`` folds the coefficient into its update, ``flat_adamw.py``); for any
other optimizer the gradients are scaled here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from ndparallel import _compat
from ndparallel.kernels import grad_norm as triton_norm


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Clip gradients to a global norm; returns the norm before clipping (a tensor, no host sync).

    Parameters may live on different meshes (TP and FSDP DTensors, plain tensors), which
    ``torch.nn.utils.clip_grad_norm_`` cannot combine: each mesh's norm is reduced on its own, the
    norms are combined, and every gradient is scaled by the one coefficient. ``max_norm=None`` only
    measures.

    ``optimizer``: pass the optimizer that steps next. One that owns its clipping (a ``clip_grad_norm_``
    method: the one-rank ``FlatAdamW``) clips instead: it applies the coefficient inside its update (one pass
    over memory less) and the ``.grad`` tensors keep their unclipped values until ``zero_grad``; the updated
    weights are the same.
    """
    parameters = list(parameters)
    own = getattr(optimizer, "clip_grad_norm_", None)
    if own is not None:
        return own(parameters, max_norm, norm_type=norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = total_norm_over_meshes(grads, norm_type)
    if total is None:
        return torch.zeros(())
    if max_norm is not None:
        scale_grads_(grads, clip_coefficient(total, max_norm))
    return total


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What every gradient is multiplied by so that their norm ``total`` becomes at most ``max_norm``."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply ``grads`` (DTensors or plain tensors) in place by ``coef``."""
    _compat.scale_tensors_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)


def _mesh_key(grad: torch.Tensor):
    return grad.device_mesh if isinstance(grad, DTensor) else None


def float32_total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of low-precision gradients (bf16) accumulated in float32, as of their exact float32 upcast (one
    Triton kernel for one rank's CUDA tensors); a DTensor's is a partial norm, as torch's is."""
    if triton_norm.supported(grads, norm_type):
        return triton_norm.total_norm(grads, norm_type)
    return torch.linalg.vector_norm(torch.stack(_compat.float32_norms(grads, norm_type)), norm_type)


def total_norm_over_meshes(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor | None:
    """Each mesh's norm reduced on its own, then combined; None without gradients."""
    by_mesh: dict = defaultdict(list)
    for g in grads:
        by_mesh[_mesh_key(g)].append(g)
    partials = []
    for group in by_mesh.values():
        if all(g.dtype == torch.float32 for g in group):
            norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type)
        else:  # bf16 gradients (bf16: full): torch's would round each tensor's norm, and their norm, to bf16
            norm = float32_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        partials.append(norm.float())
    if not partials:
        return None
    if norm_type == float("inf"):
        return torch.stack(partials).max()
    return torch.stack([p**norm_type for p in partials]).sum() ** (1.0 / norm_type)
