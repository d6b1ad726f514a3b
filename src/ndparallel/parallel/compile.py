"""Per-block ``torch.compile``: each decoder layer compiled on its own.

Compiling blocks rather than the whole model keeps compile time bounded (one graph, reused by every
layer of the same shape) and leaves FSDP's hooks, which sit on the blocks, outside the graphs.
"""

from __future__ import annotations

from ndparallel import _compat
from ndparallel.models.decoder import DecoderParts


def apply_compile(parts: DecoderParts, *, inside_checkpoint: bool = False) -> None:
    """``inside_checkpoint``: compile the layer inside its checkpoint wrapper (the wrapper, with its nested
    checkpoints, runs eagerly around the graph). Otherwise the wrapper is compiled, checkpoint included; a
    wrapper with activation offloading's hooks has its ``forward`` compiled and the hooks run eagerly."""
    for layer in parts.layers:
        if inside_checkpoint:
            _compat.compile_module(_compat.wrapped_module(layer))
        else:
            _compat.compile_module(layer, hooks_outside=hasattr(layer, "activation_offload"))
