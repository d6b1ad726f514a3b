"""Each row of a 2-D input to float8 e4m3 with its own scale, ``max |row| / 448``, in one Triton kernel.

An FP8 base (``quantized/fp8.py``) quantizes the input of every frozen linear in every forward pass: for an 8B,
seven inputs a layer (4,096 or 14,336 values per token). torch.compile's kernel for it read ~1 TB/s on an H100
(2026-12-07, each call timed alone, launch latency included), and it did not give the eager code's bits. One
program holds one row: it reads the row once, takes its absolute maximum, multiplies it by 1/448 (the scale,
as the eager code computes it), divides (IEEE, as torch divides two tensors) and rounds to nearest even e4m3
(Triton's default from float32 is toward zero; the values are clamped to +-448 first, as the eager code clamps),
so the codes and scales are meant to be the same bits as ``quantized.fp8.quantize_tokens``. On an H100
(2026-12-07) the first version (division by 448, rounding toward zero) was NOT: scales differed in the last bit
where torch's CUDA division by a number multiplies by the reciprocal, and that moved ties. This version gives
the same bits on an H100 (12 cases, ``benchmarks/diagnostics/gpu_perf_checks.py``, session 15); in a profiled
4-layer step of the 8B its 84 calls took 2.8 ms of kernels (~2 TB/s on average).
"""

from __future__ import annotations

import functools

import torch

MAX_ROW = 16384  # values a program holds in registers (the 8B's widest input: 14,336)
CODE_MAX = 448.0
TINY = float(torch.finfo(torch.float32).tiny)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_quantize_rows_kernel(
        x_ptr,
        col_scale_ptr,
        codes_ptr,
        scale_ptr,
        n_cols,
        x_stride,
        BLOCK: tl.constexpr,
        COL_SCALE: tl.constexpr,
        CODE_MAX: tl.constexpr,
        INV_CODE_MAX: tl.constexpr,
        TINY: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if COL_SCALE:  # each column times its factor first (float32 product, as the eager code multiplies)
            x = x * tl.load(col_scale_ptr + offs, mask=mask, other=0.0)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(amax * INV_CODE_MAX, TINY)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -CODE_MAX), CODE_MAX)
        tl.store(codes_ptr + row * n_cols + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(scale_ptr + row, scale)

    return fp8_quantize_rows_kernel


def supported(x: torch.Tensor) -> bool:
    """The kernel serves ``x``: on CUDA, 2-D with unit stride along rows, bf16/fp16/fp32, rows of <= 16,384."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 0 < x.shape[1] <= MAX_ROW
    )


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes (rows, cols), float32 scales (rows, 1)) of ``x``, or of ``x * col_scale`` (float32, one factor
    per column: an output gradient times the weight's row scales, ``quantized/fp8.py``)."""
    import triton

    rows, cols = x.shape
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        factors = col_scale.float().contiguous() if col_scale is not None else scale  # unread without COL_SCALE
        _kernel()[(rows,)](
            x,
            factors,
            codes,
            scale,
            cols,
            x.stride(0),
            BLOCK=block,
            COL_SCALE=col_scale is not None,
            CODE_MAX=CODE_MAX,
            INV_CODE_MAX=1 / CODE_MAX,
            TINY=TINY,
            num_warps=8 if block >= 4096 else 4,
        )
    return codes, scale
