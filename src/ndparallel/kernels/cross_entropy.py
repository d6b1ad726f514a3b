"""The chunked cross-entropy's two passes as Triton kernels (CUDA; ``loss/cross_entropy.py`` holds the math and
the eager version).

The loss is memory-bound: the logits of one 1B/3B step (8192 tokens x 128,256) are 2.1 GB in bf16. The
floor is reading them once in forward and once in backward and writing their gradient once. The
``torch.compile``d chunk functions took 1.7 ms (forward) and 3.5 ms (backward) on an H200, ~1.2 TB/s;
these read each row once in forward (an online max and sum of exponentials) and once in backward.

* ``row_stats(logits, labels)``: each row's max, sum of exp(x - max) and the logit at its label, float32.
* ``softmax_grad_(out, logits, lse, labels, scale, target_scale)``: ``out = exp(x - lse) * scale`` minus
  ``target_scale`` at the label, in ``out``'s dtype.

Rows are contiguous (stride 1 along the vocabulary); the caller passes ``logits.contiguous()`` otherwise.
"""

from __future__ import annotations

import functools

import torch

from ndparallel.kernels import cdiv

STATS_BLOCK = 4096
GRAD_BLOCK = 2048


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(logits_ptr, labels_ptr, max_ptr, sum_ptr, target_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            # -inf lanes (masked, or a -inf logit) add nothing and must not make exp(-inf - -inf) = nan
            rescale = tl.where(run_max == new_max, 1.0, tl.exp(run_max - new_max))
            run_sum = run_sum * rescale + tl.where(x == float("-inf"), 0.0, tl.exp(x - new_max))
            run_max = new_max
        row_max = tl.max(run_max, axis=0)
        lane_scale = tl.where(run_max == row_max, 1.0, tl.exp(run_max - row_max))
        row_sum = tl.sum(run_sum * lane_scale, axis=0)
        label = tl.load(labels_ptr + row)
        tl.store(max_ptr + row, row_max)
        tl.store(sum_ptr + row, row_sum)
        tl.store(target_ptr + row, tl.load(base + label).to(tl.float32))

    @triton.jit
    def softmax_grad_kernel(
        out_ptr, logits_ptr, lse_ptr, labels_ptr, scale_ptr, target_scale_ptr, n_cols, row_stride, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        grad = tl.exp(x - lse) * tl.load(scale_ptr + row)
        grad = tl.where(cols == tl.load(labels_ptr + row), grad - tl.load(target_scale_ptr + row), grad)
        tl.store(out_ptr + row * row_stride + cols, grad.to(out_ptr.dtype.element_ty), mask=mask)

    return row_stats_kernel, softmax_grad_kernel


def supported(logits: torch.Tensor) -> bool:
    """CUDA logits in a dtype whose softmax is computed in float32 (bf16, fp16, fp32)."""
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and logits.dim() == 2


def row_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of (N, V) ``logits``: max, sum of exp(x - max), the logit at ``labels`` (in [0, V)); float32."""
    n, v = logits.shape
    stats = [torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3)]
    if n:
        _kernels()[0][(n,)](logits, labels, *stats, v, logits.stride(0), BLOCK=STATS_BLOCK, num_warps=8)
    return stats[0], stats[1], stats[2]


def softmax_grad_(
    out: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    target_scale: torch.Tensor,
) -> None:
    """``out`` (like ``logits``) = (softmax - target_scale/scale at the label) * scale, row by row."""
    n, v = logits.shape
    if n:
        grid = (n, cdiv(v, GRAD_BLOCK))
        _kernels()[1][grid](out, logits, lse, labels, scale, target_scale, v, logits.stride(0), BLOCK=GRAD_BLOCK)
