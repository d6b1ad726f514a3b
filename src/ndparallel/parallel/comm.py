"""Communication that autograd differentiates: the one all-to-all both expert parallelism (rows of variable
counts per peer) and Ulysses context parallelism (equal slots per peer) use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    send: list[int] | None = None,
    recv: list[int] | None = None,
) -> torch.Tensor:
    """Slice i of ``x``'s dim 0 goes to rank i of ``group``; slice i of the result came from rank i. ``send`` /
    ``recv``: rows sent to and received from each rank (None: dim 0 split evenly, the result shaped as ``x``).
    Its backward sends the gradients back the same way."""
    return _AllToAll.apply(x, group, send, recv)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _exchange(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def _exchange(x: torch.Tensor, group, send: list[int] | None, recv: list[int] | None) -> torch.Tensor:
    rows = x.shape[0] if recv is None else sum(recv)
    out = x.new_empty((rows, *x.shape[1:]))  # contiguous (empty_like would copy x's permuted strides)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out
