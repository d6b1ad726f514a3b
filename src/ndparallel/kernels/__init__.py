"""Triton kernels of the memory-bound parts of a step (CUDA only; triton is imported when one first runs):
``adamw``: the one-rank AdamW from bf16 gradients, ``cross_entropy``: the loss's two passes, ``grad_norm``:
the norm of many gradients, ``nf4_dequantize``: an NF4 weight to bf16, ``fp8_quantize``: rows to e4m3 with row
scales, ``transpose``: a byte matrix transposed. Each module's docstring gives what it replaces and what was measured.

Layer: imports nothing of ndparallel; ``loss`` and ``optim`` call it."""


def cdiv(a: int, b: int) -> int:
    """Blocks of ``b`` that cover ``a`` elements (a launch grid's size)."""
    return (a + b - 1) // b
