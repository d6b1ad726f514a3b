"""8-bit AdamW for sharded parameters: torchao's ``AdamW8bit``.

torchao keeps each optimizer state (exp_avg, exp_avg_sq) as 8-bit codes with one scale per block of 256 values.
A DTensor parameter gets DTensor states holding the codes of its local shard, so FSDP2 and TP shards work as
they are; where a shard starts at a multiple of 256 elements (row-sharded matrices whose row length is a multiple
of 256) the blocks are the full tensor's, and the update is the one a single GPU would make. Tensors under 4096
values keep fp32 states. The update is a ``torch.compile``d kernel, so this is refused on CPU.

bf16 weights (``bf16: full``, no float32 masters): the update is computed in float32 and rounded to bf16
stochastically (torchao's ``bf16_stochastic_round``: up or down with the probabilities that make the rounding
exact on average). Rounded to nearest, an update smaller than half a bf16 step of its weight (lr 2e-5 moves a
weight by ~2e-5 of itself where a bf16 step is 2^-8 of it) would be lost every time.
"""

from __future__ import annotations

import torch
from torch import nn

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.optim.build import decay_groups


def build_adamw_8bit(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device_type: str,
    setting: str = "adamw_8bit",
) -> torch.optim.Optimizer:
    """AdamW8bit over the trainable (sharded) parameters; no weight decay on norms and biases."""
    if device_type != "cuda":
        raise ConfigError(
            f"optimizer: {setting} (8-bit AdamW) needs a CUDA GPU: torchao's AdamW8bit compiles its "
            f"update for the GPU; use optimizer: adamw_torch on {device_type}"
        )
    try:
        adamw_8bit = _compat.adamw_8bit_class()
    except ImportError:
        raise ConfigError(
            f"optimizer: {setting} needs torchao (8-bit AdamW for sharded parameters): pip install "
            f"'torchao>=0.17', or use optimizer: adamw_torch_fused"
        ) from None
    groups = decay_groups(model, weight_decay)
    bf16_weights = any(p.dtype == torch.bfloat16 for group in groups for p in group["params"])
    return adamw_8bit(groups, lr=lr, betas=betas, eps=eps, bf16_stochastic_round=bf16_weights)
