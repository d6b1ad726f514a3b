"""Context parallelism, part 2: attention over a sequence split across the cp group.

Shapes: q (B, H, L, D) and k, v (B, Hkv, L, D) hold this rank's L = S/cp tokens (two chunks of
n = S/(2cp), see ``context.py``); the output has q's shape. Three ways to exchange keys and values:

- ``allgather``: all-gather k/v over cp (GQA keeps this cheap: Hkv << H), attend each local query chunk
  to the keys it can see in few fused calls (its whole prefix at once, then its own chunk causally),
  merged by log-sum-exp; backward reduce-scatters dk/dv. Memory O(S) for k/v, no (L, S) mask.
- ``ring``: pass k/v blocks around the ring peer to peer; the transfer of the next block overlaps the
  current block's compute; partial results are merged with their log-sum-exp; a custom backward sends
  dk/dv accumulators around the ring after the blocks. Memory O(S/cp).
- ``alltoall`` (Ulysses): all-to-all trades the sequence split for a head split, attention runs on the
  full row for H/cp heads, and a second all-to-all trades back. Needs H divisible by cp (x tp).

All three are exact for causal masks, GQA, padding and packed documents (masks from ``AttentionContext``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.parallel.context import AttentionContext, chunk_ids, natural_order_index
from ndparallel.parallel.cp_blocks import Block, backward_block, cached_plan, classify, expand_heads, forward_block, merge


def context_attention(q, k, v, ctx: AttentionContext, *, scale: float, window: int | None) -> torch.Tensor:
    if ctx.cp_size == 1:
        index = torch.arange(ctx.seq_len, device=q.device)
        mask = None if ctx.is_plain(window) else ctx.allowed(index, index, window)
        return _sdpa(q, k, v, mask, scale)
    if ctx.method == "allgather":
        return _AllGatherAttention.apply(q, k, v, ctx, scale, window)
    if ctx.method == "ring":
        return _RingAttention.apply(q, k, v, ctx, scale, window)
    return _ulysses_attention(q, k, v, ctx, scale, window)


def _sdpa(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Public SDPA. ``mask=None`` means causal with aligned q/k; else a boolean (B, 1, Lq, Lk) mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    # Masked kernels do not all take grouped heads: expand k/v to the query heads.
    k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _cp_peers(ctx: AttentionContext) -> tuple[int, int]:
    """Global ranks of the next and previous cp rank on the ring."""
    nxt = dist.get_global_rank(ctx.cp_group, (ctx.cp_rank + 1) % ctx.cp_size)
    prv = dist.get_global_rank(ctx.cp_group, (ctx.cp_rank - 1) % ctx.cp_size)
    return nxt, prv


# ------------------------------------------------------------------------------------------------
# allgather
# ------------------------------------------------------------------------------------------------


def _allgather_plan(ctx: AttentionContext, window: int | None) -> list[Block]:
    """Blocks of each local query chunk against the whole row, consecutive 'full' chunks fused into one."""
    n = ctx.chunk_len

    def build():
        blocks = []
        for qi, gq in enumerate(chunk_ids(ctx.cp_rank, ctx.cp_size)):
            for g in range(gq + 1):
                kind = classify(ctx, gq, g, window)
                if kind is None:
                    continue
                last = blocks[-1] if blocks else None
                if kind[0] == "full" and last and last.q_slot == qi and last.kind == "full" and last.k_end == g * n:
                    blocks[-1] = Block(qi, last.k_start, (g + 1) * n, "full")
                else:
                    blocks.append(Block(qi, g * n, (g + 1) * n, kind[0], kind[1]))
        return blocks

    return cached_plan(ctx, "allgather", window, build)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, scale, window):
        b, h, local_len, d = q.shape
        hkv, n, cp = k.shape[1], ctx.chunk_len, ctx.cp_size
        gathered = q.new_empty((cp * b, 2 * hkv, local_len, d))
        dist.all_gather_into_tensor(gathered, torch.cat([k, v], dim=1).contiguous(), group=ctx.cp_group)
        kv = gathered.view(cp, b, 2 * hkv, local_len, d).permute(1, 2, 0, 3, 4).reshape(b, 2 * hkv, cp * local_len, d)
        order = natural_order_index(cp, n, q.device)
        kv = kv.index_select(2, order)                                    # (B, 2Hkv, S, D) in row order
        plan = _allgather_plan(ctx, window)
        out = torch.zeros(b, h, local_len, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, local_len), float("-inf"), dtype=torch.float32, device=q.device)
        for block in plan:
            rows = slice(block.q_slot * n, (block.q_slot + 1) * n)
            keys = kv[:, :, block.k_start:block.k_end]
            o, l = forward_block(q[:, :, rows], keys[:, :hkv], keys[:, hkv:], block, scale)
            merge(out[:, :, rows], lse[:, :, rows], o, l)
        out = out.to(q.dtype)
        fctx.save_for_backward(q, kv, out, lse, order)
        fctx.plan, fctx.ctx, fctx.scale, fctx.hkv = plan, ctx, scale, hkv
        return out

    @staticmethod
    def backward(fctx, grad_out):
        q, kv, out, lse, order = fctx.saved_tensors
        ctx, hkv, n, cp = fctx.ctx, fctx.hkv, fctx.ctx.chunk_len, fctx.ctx.cp_size
        b, _, local_len, d = q.shape
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for block in fctx.plan:
            rows, keys = slice(block.q_slot * n, (block.q_slot + 1) * n), slice(block.k_start, block.k_end)
            k_blk, v_blk = kv[:, :hkv, keys], kv[:, hkv:, keys]
            dq_b, dk_b, dv_b = backward_block(grad_out[:, :, rows], q[:, :, rows], k_blk, v_blk, out[:, :, rows],
                                              lse[:, :, rows], block, fctx.scale)
            dq[:, :, rows] += dq_b.float()
            dkv[:, :hkv, keys] += dk_b.float()
            dkv[:, hkv:, keys] += dv_b.float()
        # Back to rank-major order, then each rank receives the sum of its own chunks' gradients.
        dkv = dkv.index_select(2, torch.argsort(order)).view(b, 2 * hkv, cp, local_len, d)
        dkv = dkv.permute(2, 0, 1, 3, 4).reshape(cp * b, 2 * hkv, local_len, d).contiguous()
        mine = dkv.new_empty((b, 2 * hkv, local_len, d))
        dist.reduce_scatter_tensor(mine, dkv, group=ctx.cp_group)
        dk, dv = mine.split(hkv, dim=1)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None


# ------------------------------------------------------------------------------------------------
# alltoall (Ulysses)
# ------------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Slot i of dim 0 goes to cp rank i; slot i of the result came from cp rank i. Self-inverse."""

    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        out = x.new_empty(x.shape)  # contiguous (empty_like would copy x's permuted strides)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(fctx, grad):
        out = grad.new_empty(grad.shape)
        dist.all_to_all_single(out, grad.contiguous(), group=fctx.group)
        return out, None


def _heads_to_sequence(x, ctx, order):
    """(B, h, L, D) with the local tokens -> (B, h/cp, S, D) with the whole row, in row order."""
    b, h, local_len, d = x.shape
    cp = ctx.cp_size
    x = x.reshape(b, cp, h // cp, local_len, d).transpose(0, 1)
    x = _AllToAll.apply(x, ctx.cp_group)                       # (cp_src, B, h/cp, L, D)
    x = x.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * local_len, d)
    return x.index_select(2, order)


def _sequence_to_heads(x, ctx, inverse_order):
    """Inverse of ``_heads_to_sequence``."""
    b, hg, seq, d = x.shape
    cp = ctx.cp_size
    x = x.index_select(2, inverse_order).reshape(b, hg, cp, seq // cp, d).permute(2, 0, 1, 3, 4)
    x = _AllToAll.apply(x, ctx.cp_group)                       # (head group, B, h/cp, L, D)
    return x.transpose(0, 1).reshape(b, cp * hg, seq // cp, d)


def _ulysses_attention(q, k, v, ctx, scale, window):
    heads = q.shape[1]
    if k.shape[1] % ctx.cp_size:
        # Too few key/value heads to split over cp: give every query head its own copy first.
        k, v = expand_heads(k, heads), expand_heads(v, heads)
    order = natural_order_index(ctx.cp_size, ctx.chunk_len, q.device)
    inverse = torch.argsort(order)
    qs, ks, vs = (_heads_to_sequence(t, ctx, order) for t in (q, k, v))
    index = torch.arange(ctx.seq_len, device=q.device)
    mask = None if ctx.is_plain(window) else ctx.allowed(index, index, window)
    return _sequence_to_heads(_sdpa(qs, ks, vs, mask, scale), ctx, inverse)


# ------------------------------------------------------------------------------------------------
# ring
# ------------------------------------------------------------------------------------------------


def _ring_plan(ctx: AttentionContext, window: int | None) -> list[list[Block]]:
    """For ring step s (holding the k/v of cp rank ``cp_rank - s``, two chunks): the blocks to compute,
    with key ranges into the held (B, Hkv, 2n, D) k/v."""
    n = ctx.chunk_len

    def build():
        plan = []
        for step in range(ctx.cp_size):
            src = (ctx.cp_rank - step) % ctx.cp_size
            blocks = []
            for qi, gq in enumerate(chunk_ids(ctx.cp_rank, ctx.cp_size)):
                for kj, gk in enumerate(chunk_ids(src, ctx.cp_size)):
                    kind = classify(ctx, gq, gk, window)
                    if kind is not None:
                        blocks.append(Block(qi, kj * n, (kj + 1) * n, kind[0], kind[1]))
            plan.append(blocks)
        return plan

    return cached_plan(ctx, "ring", window, build)


def _exchange(tensor: torch.Tensor, ctx: AttentionContext):
    """Send ``tensor`` to the next cp rank and receive the previous rank's; returns (requests, received)."""
    nxt, prv = _cp_peers(ctx)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, nxt, ctx.cp_group), dist.P2POp(dist.irecv, received, prv, ctx.cp_group)]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, scale, window):
        b, h, local_len, d = q.shape
        hkv, n = k.shape[1], ctx.chunk_len
        plan = _ring_plan(ctx, window)
        out = torch.zeros(b, h, local_len, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, local_len), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=1).contiguous()
        for step, blocks in enumerate(plan):
            pending = _exchange(kv, ctx) if step < ctx.cp_size - 1 else None  # overlaps this step's compute
            for block in blocks:
                rows, keys = slice(block.q_slot * n, (block.q_slot + 1) * n), slice(block.k_start, block.k_end)
                o, l = forward_block(q[:, :, rows], kv[:, :hkv, keys], kv[:, hkv:, keys], block, scale)
                merge(out[:, :, rows], lse[:, :, rows], o, l)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        out = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.plan, fctx.ctx, fctx.scale = plan, ctx, scale
        return out

    @staticmethod
    def backward(fctx, grad_out):
        q, k, v, out, lse = fctx.saved_tensors
        plan, ctx, scale = fctx.plan, fctx.ctx, fctx.scale
        hkv, n = k.shape[1], ctx.chunk_len
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=1).contiguous()
        dkv_pending = None
        for step, blocks in enumerate(plan):
            kv_pending = _exchange(kv, ctx) if step < ctx.cp_size - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for block in blocks:
                rows, keys = slice(block.q_slot * n, (block.q_slot + 1) * n), slice(block.k_start, block.k_end)
                dq_b, dk_b, dv_b = backward_block(grad_out[:, :, rows], q[:, :, rows], kv[:, :hkv, keys],
                                                  kv[:, hkv:, keys], out[:, :, rows], lse[:, :, rows], block, scale)
                dq[:, :, rows] += dq_b.float()
                dkv[:, :hkv, keys] += dk_b.float()
                dkv[:, hkv:, keys] += dv_b.float()
            if dkv_pending is not None:
                # Add what the block's earlier holders accumulated, then pass it on with ours.
                _wait(dkv_pending[0])
                dkv += dkv_pending[1]
            dkv_pending = _exchange(dkv, ctx)
            if kv_pending is not None:
                _wait(kv_pending[0])
                kv = kv_pending[1]
        _wait(dkv_pending[0])  # the last hop brings our own block's gradient home
        dk, dv = dkv_pending[1].split(hkv, dim=1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
