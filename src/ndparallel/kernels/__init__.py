"""Triton kernels of the memory-bound parts of a step (CUDA only; triton is imported when one first runs):
``adamw``: the one-rank AdamW from bf16 gradients, ``cross_entropy``: the loss's two passes, ``grad_norm``:
the norm of many gradients. Each module's docstring gives what it replaces and what was measured.

Layer: imports nothing of ndparallel; ``loss`` and ``optim`` call it."""


def cdiv(a: int, b: int) -> int:
    """Blocks of ``b`` that cover ``a`` elements (a launch grid's size)."""
    return (a + b - 1) // b
