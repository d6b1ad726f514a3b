"""A 2-D tensor of one-byte elements transposed into a new contiguous tensor, in one Triton kernel.

An FP8 base's input gradient multiplies by the weight's e4m3 codes with the weight's rows as the summed
dimension, which the FP8 product wants contiguous: the codes (out, in) are transposed for each backward
(``quantized/fp8.py``), a byte a value read and written, 7e9 values a step for an 8B. torch's copy of a
transposed view moves one byte per thread with strided reads or writes; this kernel moves tiles of 128 x 128
bytes, read along rows and written along rows of the result (Triton stages the tile through shared memory).
On an H100 (2026-12-07, ``benchmarks/diagnostics/fp8_gemm_diag.py``): 0.064 / 0.081 ms for the 8B's gate/up and
down codes against 0.424 / 0.439 for torch's copy (each call timed alone); the same bytes
(``benchmarks/diagnostics/gpu_perf_checks.py``).
"""

from __future__ import annotations

import functools

import torch

from ndparallel.kernels import cdiv

TILE = 128


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def transpose_kernel(src_ptr, dst_ptr, rows, cols, TILE: tl.constexpr):
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        r64, c64 = r.to(tl.int64), c.to(tl.int64)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src_ptr + r64[:, None] * cols + c64[None, :], mask=inside)
        tl.store(dst_ptr + c64[:, None] * rows + r64[None, :], tl.trans(tile), mask=tl.trans(inside))

    return transpose_kernel


def supported(x: torch.Tensor) -> bool:
    """On CUDA, 2-D, contiguous, one byte an element (codes as uint8 or int8)."""
    return x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.element_size() == 1


def transposed(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()``: through the kernel where ``supported``, else torch's copy."""
    if not supported(x):
        return x.t().contiguous()
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        _kernel()[(cdiv(rows, TILE), cdiv(cols, TILE))](x, out, rows, cols, TILE=TILE, num_warps=8)
    return out
