"""Which gradient reductions each micro-batch's backward runs (FSDP2 and HSDP), for gradient accumulation."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ndparallel.errors import ConfigError

GRADIENT_SYNC_MODES = ("every_micro_batch", "last_micro_batch")


def set_gradient_sync(model: nn.Module, last_micro_batch: bool, *, mode: str = "every_micro_batch") -> None:
    """Call before each backward of a step's micro-batches: which gradient reductions that backward runs.

    ``every_micro_batch`` (default): each backward reduce-scatters its gradients into the sharded fp32
    gradients, so a rank holds 1/shard of them between micro-batches; only the all-reduce across
    ``dp_replicate`` (HSDP, DDP) waits for the last micro-batch.
    ``last_micro_batch``: no reduction until the last micro-batch; meanwhile every rank keeps the full,
    unsharded fp32 gradients of its TP shard (4 bytes x parameters / tp: 32 GB for an 8B model), in
    exchange for one reduce-scatter per step instead of one per micro-batch.
    """
    if mode not in GRADIENT_SYNC_MODES:
        raise ConfigError(f"gradient_sync={mode!r} must be one of {', '.join(GRADIENT_SYNC_MODES)}")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if mode == "every_micro_batch":
                module.set_requires_gradient_sync(True, recurse=False)
                module.set_requires_all_reduce(last_micro_batch, recurse=False)
            else:
                module.set_requires_gradient_sync(last_micro_batch, recurse=False)
