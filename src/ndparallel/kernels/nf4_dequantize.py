"""An NF4 weight (torchao's ``NF4Tensor`` parts, double quantization) to the compute dtype in one Triton kernel.

QLoRA dequantizes every frozen weight three times a step under full checkpointing (forward, recompute,
backward): 7e9 values each time for an 8B. Each program reads a run of code bytes (two 4-bit codes each),
their blocks' int8 scales and the scales' int8 factors, and writes the values interleaved (high nibble first,
as torchao packs them). The arithmetic is torchao's, rounding where its eager bf16 ops round: the scale is
``int8 / factor`` rounded to the table's dtype, plus the mean, rounded again; a value is the table's entry
times that scale, rounded. So the result is the same bits as ``NF4Tensor.get_original_weight`` (checked on
the GPU by ``benchmarks/diagnostics/dequant_speed_diag.py``, which also times it against torch.compile's
kernel and bitsandbytes').
"""

from __future__ import annotations

import functools

import torch

from ndparallel.kernels import cdiv

BYTES = 2048  # code bytes a program reads: 4,096 values written
NUM_WARPS = 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_dequantize_kernel(
        codes_ptr,
        scalers_ptr,
        factors_ptr,
        mean_ptr,
        table_ptr,
        out_ptr,
        n_bytes,
        HALF_BLOCK: tl.constexpr,  # code bytes per scale (block_size / 2)
        SCALER_BLOCK: tl.constexpr,  # scales per factor
        INDEX_64: tl.constexpr,
        BYTES: tl.constexpr,
    ):
        start = tl.program_id(0).to(tl.int64) * BYTES if INDEX_64 else tl.program_id(0) * BYTES
        offs = start + tl.arange(0, BYTES)
        mask = offs < n_bytes
        codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        block = offs // HALF_BLOCK
        scaler = tl.load(scalers_ptr + block, mask=mask, other=0).to(tl.float32)
        factor = tl.load(factors_ptr + block // SCALER_BLOCK, mask=mask, other=1.0).to(tl.float32)
        dtype = table_ptr.dtype.element_ty
        scale = tl.math.div_rn(scaler, factor).to(dtype).to(tl.float32)
        scale = (scale + tl.load(mean_ptr).to(tl.float32)).to(dtype).to(tl.float32)
        high = (tl.load(table_ptr + (codes >> 4)).to(tl.float32) * scale).to(dtype)
        low = (tl.load(table_ptr + (codes & 15)).to(tl.float32) * scale).to(dtype)
        out = tl.interleave(high, low)
        out_offs = 2 * start + tl.arange(0, 2 * BYTES)
        tl.store(out_ptr + out_offs, out, mask=out_offs < 2 * n_bytes)

    return nf4_dequantize_kernel


def supported(parts: list[torch.Tensor]) -> bool:
    """The kernel serves these parts: on CUDA, contiguous, a bf16/fp16/fp32 table (torchao's layout)."""
    codes, scalers, factors, mean, table = parts
    return (
        codes.is_cuda
        and codes.dtype == torch.uint8
        and scalers.dtype == torch.int8
        and table.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and all(part.is_contiguous() for part in parts)
    )


def dequantize(parts: list[torch.Tensor], block_size: int, scaler_block_size: int, shape: list[int]) -> torch.Tensor:
    """The weight of ``shape`` in the table's dtype from its parts (``quantized.nf4.nf4_parts``' order)."""
    codes, scalers, factors, mean, table = parts
    out = torch.empty(shape, dtype=table.dtype, device=codes.device)
    n_bytes = codes.numel()
    _kernel()[(cdiv(n_bytes, BYTES),)](
        codes,
        scalers,
        factors,
        mean,
        table,
        out,
        n_bytes,
        HALF_BLOCK=block_size // 2,
        SCALER_BLOCK=scaler_block_size,
        INDEX_64=2 * n_bytes + 2 * BYTES >= 2**31,
        BYTES=BYTES,
        num_warps=NUM_WARPS,
    )
    return out
