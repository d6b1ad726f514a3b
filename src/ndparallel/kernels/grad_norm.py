"""The 2-norm (or max-norm) of many gradients in the compute dtype, as one Triton kernel per tensor (CUDA).

``clip_grad_norm_`` with ``FlatAdamW(master_grads=False)`` measures autograd's bf16 gradients (6.4 GB for a
3B model). torch's multi-tensor norm (``_compat.float32_norms``) took 2.9 ms of GPU time for them on an H200
(2.2 TB/s), this 1.9 ms: each block of a tensor writes its float32 partial (sum of squares, or max of
absolute values) and one reduction of the partials gives the total; deterministic, accumulated in float32.
One launch per tensor: the host's ~10-20 us each overlap the backward's tail when the model is large.
"""

from __future__ import annotations

import functools

import torch

from ndparallel.kernels import cdiv

BLOCK = 4096
NUM_WARPS = 4


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_norms_kernel(
        x_ptr, out_ptr, out_offset, numel, MAX_NORM: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr
    ):
        start = tl.program_id(0).to(tl.int64) * BLOCK if INDEX_64 else tl.program_id(0) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        at = out_ptr + out_offset + tl.program_id(0)
        if MAX_NORM:
            tl.store(at, tl.max(tl.abs(x), axis=0))
        else:
            tl.store(at, tl.sum(x * x, axis=0))

    return partial_norms_kernel


def supported(tensors: list[torch.Tensor], norm_type: float) -> bool:
    return bool(tensors) and norm_type in (2.0, float("inf")) and all(t.is_cuda and t.is_contiguous() for t in tensors)


def total_norm(tensors: list[torch.Tensor], norm_type: float, *, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """The ``norm_type`` (2 or inf) norm of all ``tensors`` together, a float32 0-d tensor on their device."""
    blocks = [cdiv(t.numel(), block) for t in tensors]
    partials = torch.zeros(sum(blocks), dtype=torch.float32, device=tensors[0].device)
    max_norm = norm_type == float("inf")
    at = 0
    for t, count in zip(tensors, blocks):
        if count:
            _kernel()[(count,)](
                t,
                partials,
                at,
                t.numel(),
                MAX_NORM=max_norm,
                INDEX_64=t.numel() + block >= 2**31,
                BLOCK=block,
                num_warps=num_warps,
            )
        at += count
    return partials.max() if max_norm else partials.sum().sqrt()
