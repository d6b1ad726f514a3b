"""The dequantization inside a compiled model's quantized-linear operators, compiled on its own.

The forward and the input gradient of a frozen quantized linear are opaque operators (``int8.int8_linear``,
``int8.int8_input_grad``, ``nf4.nf4_linear``, ``nf4.nf4_input_grad``), so that the compiled layer holds no
dequantized weight it could keep from forward to backward. Their bodies are not part of the layer's graph, so
their dequantization would run as eager kernels (for NF4 a dozen full passes over the weight: on the H200 a
compiled 8B QLoRA step took 0.38 s against 0.27 for a bf16 base). When an operator is called from a compiled
layer (``fused``: the layer was traced), it runs the dequantization through a ``torch.compile`` of its own,
one fused kernel per weight shape. An eager model compiles nothing here. NF4 on CUDA takes neither: one
Triton kernel (``kernels/nf4_dequantize.py``, ``nf4.dequantize_for``), a third of the compiled kernel's time
and torchao's bits, which the compiled kernel did not reproduce on an H100 (likely skipped bf16 roundings).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``fn`` compiled once per process (its shapes recompile as torch.compile decides: static first, then
    dynamic)."""
    return torch.compile(fn)


def compiled_if(fn: Callable, fused: bool) -> Callable:
    """``fn`` compiled when ``fused`` (the caller runs inside a compiled layer), else ``fn`` itself: the
    dequantizations here and the LoRA MLP operator's pointwise parts (``adapters/lora_mlp.py``)."""
    return compiled(fn) if fused else fn
