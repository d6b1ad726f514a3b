"""Token cross-entropy, summed (not averaged) so the caller can divide by the global token count.

Under tensor parallelism the logits are split along the vocabulary, (N, V/t) per rank: the softmax
normaliser and the target's logit are reduced over tp without ever gathering the full (N, V) logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """Sum over tokens of -log p(label); labels == -100 add nothing. logits (..., V_local), labels (...)."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    if tp_group is None:
        return F.cross_entropy(_at_least_fp32(logits), labels, reduction="sum", ignore_index=IGNORE_INDEX)
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group, vocab_start).sum()


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Loss math in float32 (bf16 logits lose too much in the softmax), float64 kept as is."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocabulary-split logits (N, V/t): max, sum-exp and target logit reduced over tp."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        logits = _at_least_fp32(logits)
        local_vocab = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        local_label = labels - vocab_start
        here = (local_label >= 0) & (local_label < local_vocab)
        safe_label = local_label.clamp(0, local_vocab - 1)
        target = shifted.gather(-1, safe_label.unsqueeze(-1)).squeeze(-1) * here
        dist.all_reduce(target, group=group)

        valid = labels != IGNORE_INDEX
        loss = (sum_exp.log() - target) * valid
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_label, here & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_label, target_here, valid = ctx.saved_tensors
        grad = softmax * (grad_loss * valid).unsqueeze(-1)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_label] -= grad_loss * target_here
        return grad, None, None, None
