"""Per-block ``torch.compile``: each decoder layer compiled on its own.

Compiling blocks rather than the whole model keeps compile time bounded (one graph, reused by every
layer of the same shape) and leaves FSDP's hooks, which sit on the blocks, outside the graphs.
"""

from __future__ import annotations

from ndparallel import _compat
from ndparallel.models.decoder import DecoderParts


def apply_compile(parts: DecoderParts, *, inside_checkpoint: bool = False) -> None:
    """``inside_checkpoint``: compile the layer inside its checkpoint wrapper (the wrapper's own Python, such
    as activation offloading's stream and storage handling, then runs eagerly around the graph)."""
    for layer in parts.layers:
        _compat.compile_module(_compat.wrapped_module(layer) if inside_checkpoint else layer)
