"""Per-block ``torch.compile``: each decoder layer compiled on its own.

Compiling blocks rather than the whole model keeps compile time bounded (one graph, reused by every
layer of the same shape) and leaves FSDP's hooks, which sit on the blocks, outside the graphs.
"""

from __future__ import annotations

from ndparallel.models.decoder import DecoderParts


def apply_compile(parts: DecoderParts) -> None:
    for layer in parts.layers:
        layer.compile()
