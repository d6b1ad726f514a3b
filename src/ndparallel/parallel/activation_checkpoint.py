"""Activation checkpointing of decoder layers: none, full, or selective (op-level).

'full' keeps only each layer's input and recomputes the layer in backward. 'selective' saves the outputs
of the expensive ops (matrix products, attention kernels) and recomputes the cheap, memory-hungry ones
(norms, activations, rotary embeddings, casts, residual adds): most of full's memory saving on the
elementwise temporaries at a fraction of its recompute.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ndparallel import _compat
from ndparallel.errors import ConfigError
from ndparallel.models.decoder import DecoderParts
from ndparallel.parallel.offload import apply_offloaded_checkpointing

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
_SAVE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, *_compat.SDPA_KERNEL_OPS}


def _save_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(parts: DecoderParts, mode: str, *, offload_layers: int = 0) -> None:
    """Wrap each decoder layer; ``offload_layers``: with 'full', the inputs of the first that many layers wait
    for their backward in host memory (``offload.py``)."""
    if mode not in MODES:
        raise ConfigError(f"activation_checkpointing={mode!r} must be one of {', '.join(MODES)}")
    if offload_layers and mode != "full":
        raise ConfigError(
            f"activation_offloading moves the inputs that full activation checkpointing keeps; it needs "
            f"activation_checkpointing: full (got {mode!r})"
        )
    if mode == "none":
        return
    if offload_layers:
        apply_offloaded_checkpointing(parts, offload_layers)
        return
    kwargs = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_expensive)
    for i, layer in enumerate(list(parts.layers)):
        parts.layers[i] = _compat.checkpoint_wrapper(layer, **kwargs)
