"""AdamW of one fp32 master from a gradient in the compute dtype, as one Triton kernel (CUDA).

``FlatAdamW`` with ``master_grads=False`` reads autograd's bf16 gradients where autograd left them, one
tensor each, so its update runs per tensor: each launch reads the bf16 gradient (2 bytes), master and
both moments (12) and writes master, moments and the bf16 compute copy (14). 28 bytes per parameter
instead of 40 (the upcast into an fp32 gradient buffer: 6, the norm reading it: 4, the update reading
it: 30). The gradient is upcast in registers (exact: every bf16 value is a float32), so the numbers are
``adamw_update_``'s on the upcast gradient: the same operations in the same order, IEEE division and
square root (``div_rn``, ``sqrt_rn``), torch's ``lerp`` formula.

A hand-written kernel rather than ``torch.compile``: one compiled function called with ~10 distinct
tensor sizes recompiles per size (and hits dynamo's per-function recompile limit) or, compiled with
dynamic shapes, loses vectorized loads (measured 15.1 vs 8.9 ms per step at 1B).
"""

from __future__ import annotations

import functools

import torch

from ndparallel.kernels import cdiv

BLOCK = 1024  # with 4 warps: the fastest of 7 block x warp choices on the H200 (tests/gpu/gpu_bf16_grad_adamw.py)
NUM_WARPS = 4


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_from_low_precision_grad(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        compute_ptr,
        hyper_ptr,
        scale_ptr,
        offset,
        numel,
        WRITE_COMPUTE: tl.constexpr,
        INDEX_64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # the tensor is elements [offset, offset + numel) of the flat buffers, and the whole gradient
        start = tl.program_id(0).to(tl.int64) * BLOCK if INDEX_64 else tl.program_id(0) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        at = (offset.to(tl.int64) if INDEX_64 else offset) + offs
        # hyper = [1 - lr*wd, 1 - beta1, beta2, 1 - beta2, eps, lr / (1 - beta1^t), sqrt(1 - beta2^t)]
        decay = tl.load(hyper_ptr + 0)
        one_minus_beta1 = tl.load(hyper_ptr + 1)
        beta2 = tl.load(hyper_ptr + 2)
        one_minus_beta2 = tl.load(hyper_ptr + 3)
        eps = tl.load(hyper_ptr + 4)
        step_size = tl.load(hyper_ptr + 5)
        bias2_sqrt = tl.load(hyper_ptr + 6)
        grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
        param = tl.load(param_ptr + at, mask=mask) * decay
        exp_avg = tl.load(exp_avg_ptr + at, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + at, mask=mask)
        # torch.lerp(start, end, w): start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w)
        diff = grad - exp_avg
        exp_avg = tl.where(
            one_minus_beta1 < 0.5, exp_avg + one_minus_beta1 * diff, grad - diff * (1.0 - one_minus_beta1)
        )
        exp_avg_sq = exp_avg_sq * beta2 + grad * grad * one_minus_beta2
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias2_sqrt) + eps
        param = param - tl.div_rn(exp_avg, denom) * step_size
        tl.store(param_ptr + at, param, mask=mask)
        tl.store(exp_avg_ptr + at, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + at, exp_avg_sq, mask=mask)
        if WRITE_COMPUTE:
            tl.store(compute_ptr + at, param.to(compute_ptr.dtype.element_ty), mask=mask)

    return adamw_from_low_precision_grad


def adamw_from_low_precision_grad_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    compute: torch.Tensor | None,
    *,
    offset: int = 0,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """``flat_adamw.adamw_update_`` of elements [offset, offset + grad.numel()) of the flat, contiguous ``param``,
    ``exp_avg``, ``exp_avg_sq`` (and ``compute``) from the contiguous ``grad`` (upcast in the kernel).

    The flat buffers and an element offset rather than views of them: a launch per tensor is host work (a
    3B model has 255 tensors), and five views per tensor cost as much as the launch."""
    numel = grad.numel()
    if numel == 0:
        return
    _kernel()[(cdiv(numel, block),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        compute if compute is not None else param,
        hyper,
        grad_scale,
        offset,
        numel,
        WRITE_COMPUTE=compute is not None,
        INDEX_64=offset + numel + block >= 2**31,
        BLOCK=block,
        num_warps=num_warps,
    )
