"""The optimizer of a parallelized model: AdamW over its trainable (sharded) parameters, two weight-decay
groups, ``FlatAdamW`` on one rank."""

from __future__ import annotations

import torch
from torch import nn

from ndparallel.optim.flat_adamw import FlatAdamW
from ndparallel.parallel.float8 import fp8_post_step_hook
from ndparallel.parallel.single_rank import single_rank_state


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    fused: bool | None = None,
    master_grads: bool = True,
) -> torch.optim.AdamW:
    """AdamW over the trainable (sharded) parameters; no weight decay on norms and biases (1-D tensors).

    Build it after ``parallelize`` so it holds the sharded parameters. On one rank (no FSDP) it is
    ``ndparallel.optim.flat_adamw.FlatAdamW``: the same math and state, one fused update per group. ``fused=False``
    asks for torch's unfused AdamW everywhere.

    ``master_grads=False`` (one rank; what the trainer uses): the optimizer reads autograd's bf16 gradients
    where autograd left them instead of their fp32 upcast in the parameters' ``.grad``, which stay None:
    10 bytes per parameter less memory traffic a step, the same updates. Clip with
    ``clip_grad_norm_(..., optimizer=)``. No effect on FSDP layouts.
    """
    groups = decay_groups(model, weight_decay)
    flat = single_rank_state(model)
    if flat is not None and fused is not False:
        optimizer = FlatAdamW(groups, flat=flat, lr=lr, betas=betas, eps=eps, master_grads=master_grads)
    else:
        params = [p for group in groups for p in group["params"]]
        if fused is None:
            fused = all(p.is_cuda for p in params) and bool(params)
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    scales = fp8_post_step_hook(model)  # float8 all-gather: every weight's scale in one all-reduce per step
    if scales is not None:
        optimizer.register_step_post_hook(scales)
    return optimizer


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two optimizer groups: matrices with ``weight_decay``, norms and biases
    (1-D tensors) without."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
