"""Token cross-entropy, summed (not averaged) so the caller can divide by the global token count.

Memory: the logits of a 128k vocabulary are large ((N, V) for N tokens), and a plain float32 cross-entropy
keeps two more float32 copies (the upcast and the softmax) alive for backward. This one keeps only the
logits as the model produced them (bf16 under mixed precision) plus two floats per token (row max and
log-sum-exp); the float32 softmax is recomputed chunk by chunk in backward and never exists in full.

Tensor parallelism: the logits are split along the vocabulary, (N, V/t) per rank. The row max, the
sum of exponentials and the target's logit are reduced over tp (three all-reduces of N floats each),
never gathering the (N, V) logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
CHUNK_ROWS = 2048


def cross_entropy_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    chunk_rows: int = CHUNK_ROWS,
) -> torch.Tensor:
    """Sum over tokens of -log p(label); labels == -100 add nothing. logits (..., V_local), labels (...)."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    return _ChunkedCrossEntropy.apply(logits, labels, tp_group, vocab_start, chunk_rows).sum()


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits (the softmax needs it), float64 kept as is."""
    return torch.promote_types(x.dtype, torch.float32)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses (N,) from (N, V_local) logits, in row chunks."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, chunk_rows):
        n, local_vocab = logits.shape
        dtype = _math_dtype(logits)
        local_label = labels - vocab_start
        here = (local_label >= 0) & (local_label < local_vocab)
        safe_label = local_label.clamp(0, local_vocab - 1)

        row_max = torch.empty(n, dtype=dtype, device=logits.device)
        for rows in _chunks(n, chunk_rows):
            row_max[rows] = logits[rows].to(dtype).amax(dim=-1)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)

        sum_exp = torch.empty(n, dtype=dtype, device=logits.device)
        target = torch.empty(n, dtype=dtype, device=logits.device)
        for rows in _chunks(n, chunk_rows):
            shifted = logits[rows].to(dtype) - row_max[rows, None]
            sum_exp[rows] = shifted.exp().sum(dim=-1)
            target[rows] = shifted.gather(-1, safe_label[rows, None]).squeeze(-1) * here[rows]
        if group is not None:
            dist.all_reduce(sum_exp, group=group)
            dist.all_reduce(target, group=group)

        valid = labels != IGNORE_INDEX
        log_sum = sum_exp.log()
        ctx.save_for_backward(logits, row_max + log_sum, safe_label, here & valid, valid)
        ctx.chunk_rows = chunk_rows
        return (log_sum - target) * valid

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, safe_label, target_here, valid = ctx.saved_tensors
        dtype = lse.dtype
        grad = torch.empty_like(logits)
        scale = (grad_loss.to(dtype) * valid)
        for rows in _chunks(logits.shape[0], ctx.chunk_rows):
            # d loss_i / d logit_ij = softmax_ij - [j == label_i], scaled by the incoming gradient.
            g = (logits[rows].to(dtype) - lse[rows, None]).exp_().mul_(scale[rows, None])
            g.scatter_add_(-1, safe_label[rows, None], -(scale[rows] * target_here[rows])[:, None])
            grad[rows] = g.to(grad.dtype)
        return grad, None, None, None, None


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))
