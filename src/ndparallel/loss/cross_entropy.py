"""Token cross-entropy, summed (not averaged) so the caller can divide by the global token count.

Memory: the logits of a 128k vocabulary are large ((N, V) for N tokens), and a plain float32 cross-entropy
keeps two more float32 copies (the upcast and the softmax) alive for backward. This one keeps only the
logits as the model produced them (bf16 under mixed precision) plus one float per token (the
log-sum-exp); the float32 softmax is recomputed chunk by chunk in backward and never exists in full.

Speed: each chunk is read once in forward (row max, sum of exponentials and the target's logit in one
pass) and once in backward (softmax minus one-hot, written as the gradient). With ``compiled=True`` each
pass is one kernel over all rows on CUDA (``kernels/cross_entropy.py``: Triton, no temporaries, so no
chunks); elsewhere the two per-chunk functions are compiled.

Tensor parallelism: the logits are split along the vocabulary, (N, V/t) per rank. Each rank's (max,
sum-exp) pair is combined over tp as in an online softmax, and the target's logit comes from the rank
that holds it: three all-reduces of N floats, never gathering the (N, V) logits. Whatever the model does
to its logits after lm_head (Gemma's final soft-capping, Granite's logits_scaling, Cohere's logit_scale)
is elementwise, so it already happened on each slice before the logits reach this loss.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ndparallel.kernels import cross_entropy as triton_ce

IGNORE_INDEX = -100
"""The label of a token that takes no loss (transformers' convention); the one definition."""
CHUNK_ROWS = 2048


def vocab_offset(local_vocab: int, group: dist.ProcessGroup, rank: int, device: torch.device) -> torch.Tensor:
    """First vocabulary row held by tp rank ``rank`` whose logits are ``local_vocab`` wide.

    The vocabulary splits like ``torch.chunk`` (DTensor's ``Shard``): ceil(V/t) rows on every rank but the
    last, which may hold fewer (V = 49,155 on 2 ranks: 24,578 and 24,577). The widest slice is that
    ceil(V/t), so rank r starts at r * (the largest width): one all-reduce of one number, on the device.
    """
    width = torch.tensor(local_vocab, device=device, dtype=torch.long)
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
    return width * rank


def cross_entropy_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | torch.Tensor = 0,
    chunk_rows: int = CHUNK_ROWS,
    compiled: bool = False,
) -> torch.Tensor:
    """Sum over tokens of -log p(label); labels == -100 add nothing. logits (..., V_local), labels (...)."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    return _ChunkedCrossEntropy.apply(logits, labels, tp_group, vocab_start, chunk_rows, compiled).sum()


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits (the softmax needs it), float64 kept as is."""
    return torch.promote_types(x.dtype, torch.float32)


def _chunk_stats(chunk: torch.Tensor, label: torch.Tensor):
    """Row max, sum of exp(x - max) and the logit at ``label``, in one pass over a (rows, V) chunk."""
    x = chunk.to(_math_dtype(chunk))
    row_max = x.amax(dim=-1)
    sum_exp = (x - row_max[:, None]).exp().sum(dim=-1)
    # gathered from the chunk as it is, then upcast (exact): gathering from ``x`` made the compiled kernel
    # write the whole float32 upcast of the chunk to memory first
    target = chunk.gather(-1, label[:, None]).squeeze(-1).to(x.dtype)
    return row_max, sum_exp, target


def _chunk_grad_(
    out: torch.Tensor,
    chunk: torch.Tensor,
    lse: torch.Tensor,
    label: torch.Tensor,
    scale: torch.Tensor,
    target_scale: torch.Tensor,
) -> None:
    """d loss / d logits of a chunk, written into ``out``: (softmax - one_hot(label)) * scale, in the logits'
    dtype. (On CUDA, compiled, ``kernels/cross_entropy.py`` computes the same in one pass.)"""
    x = chunk.to(lse.dtype)
    grad = (x - lse[:, None]).exp() * scale[:, None]
    out.copy_(grad.scatter_add(-1, label[:, None], -target_scale[:, None]))


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses (N,) from (N, V_local) logits, in row chunks."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, chunk_rows, compiled):
        n, local_vocab = logits.shape
        dtype = _math_dtype(logits)
        stats = _compiled(_chunk_stats) if compiled else _chunk_stats
        local_label = labels - vocab_start
        here = (local_label >= 0) & (local_label < local_vocab)
        safe_label = local_label.clamp(0, local_vocab - 1)
        if compiled and triton_ce.supported(logits):
            logits = logits.contiguous()
            row_max, sum_exp, target = triton_ce.row_stats(logits, safe_label)
        else:
            row_max = torch.empty(n, dtype=dtype, device=logits.device)
            sum_exp = torch.empty(n, dtype=dtype, device=logits.device)
            target = torch.empty(n, dtype=dtype, device=logits.device)
            for rows in _chunks(n, chunk_rows):
                row_max[rows], sum_exp[rows], target[rows] = stats(logits[rows], safe_label[rows])
        target = target * here
        if group is not None:
            # Online-softmax combination of the ranks' vocabulary slices.
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sum_exp = sum_exp * (row_max - global_max).exp()
            dist.all_reduce(sum_exp, group=group)
            dist.all_reduce(target, group=group)
            row_max = global_max
        valid = labels != IGNORE_INDEX
        lse = row_max + sum_exp.log()
        ctx.save_for_backward(logits, lse, safe_label, here & valid, valid)
        ctx.chunk_rows, ctx.compiled = chunk_rows, compiled
        return (lse - target) * valid

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, safe_label, target_here, valid = ctx.saved_tensors
        grad_fn = _compiled(_chunk_grad_) if ctx.compiled else _chunk_grad_
        scale = grad_loss.to(lse.dtype) * valid
        target_scale = scale * target_here
        grad = torch.empty_like(logits)
        if ctx.compiled and triton_ce.supported(logits):
            triton_ce.softmax_grad_(grad, logits, lse, safe_label, scale, target_scale)
            return grad, None, None, None, None, None
        for rows in _chunks(logits.shape[0], ctx.chunk_rows):
            grad_fn(grad[rows], logits[rows], lse[rows], safe_label[rows], scale[rows], target_scale[rows])
        return grad, None, None, None, None, None


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))
