"""Context parallelism, part 2: attention over a sequence split across the cp group.

Shapes: q (B, H, L, D) and k, v (B, Hkv, L, D) hold this rank's L = S/cp tokens (two chunks of
n = S/(2cp), see ``context.py``); the output has q's shape. Three ways to exchange keys and values:

- ``allgather``: all-gather k/v over cp (GQA keeps this cheap: Hkv << H), attend the local queries to
  the whole row with an exact mask; backward reduce-scatters dk/dv. Memory O(S) for k/v.
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

from ndparallel import _compat
from ndparallel.parallel.context import AttentionContext, chunk_ids, natural_order_index


def context_attention(q, k, v, ctx: AttentionContext, *, scale: float, window: int | None) -> torch.Tensor:
    if ctx.cp_size == 1:
        index = torch.arange(ctx.seq_len, device=q.device)
        mask = None if ctx.is_plain(window) else ctx.allowed(index, index, window)
        return _sdpa(q, k, v, mask, scale)
    if ctx.method == "allgather":
        return _allgather_attention(q, k, v, ctx, scale, window)
    if ctx.method == "ring":
        return _RingAttention.apply(q, k, v, ctx, scale, window)
    return _ulysses_attention(q, k, v, ctx, scale, window)


def _sdpa(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Public SDPA. ``mask=None`` means causal with aligned q/k; else a boolean (B, 1, Lq, Lk) mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    # Masked kernels do not all take grouped heads: expand k/v to the query heads.
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _cp_peers(ctx: AttentionContext) -> tuple[int, int]:
    """Global ranks of the next and previous cp rank on the ring."""
    nxt = dist.get_global_rank(ctx.cp_group, (ctx.cp_rank + 1) % ctx.cp_size)
    prv = dist.get_global_rank(ctx.cp_group, (ctx.cp_rank - 1) % ctx.cp_size)
    return nxt, prv


# ------------------------------------------------------------------------------------------------
# allgather
# ------------------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """(B, C, L, D) on each rank -> (cp, B, C, L, D); backward sums the gradients back to their owners."""

    @staticmethod
    def forward(fctx, x, group, cp_size):
        fctx.group = group
        out = x.new_empty((cp_size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(cp_size, *x.shape)

    @staticmethod
    def backward(fctx, grad):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=fctx.group)
        return out, None, None


def _allgather_attention(q, k, v, ctx, scale, window):
    b, hkv, local_len, d = k.shape
    kv = _GatherSequence.apply(torch.cat([k, v], dim=1), ctx.cp_group, ctx.cp_size)  # (cp, B, 2Hkv, L, D)
    kv = kv.permute(1, 2, 0, 3, 4).reshape(b, 2 * hkv, ctx.cp_size * local_len, d)    # rank-major sequence
    kv = kv.index_select(2, natural_order_index(ctx.cp_size, ctx.chunk_len, kv.device))
    k_full, v_full = kv.split(hkv, dim=1)
    q_index = ctx.token_index()
    k_index = torch.arange(ctx.seq_len, device=q.device)
    if ctx.is_plain(window):
        mask = (k_index.unsqueeze(0) <= q_index.unsqueeze(1)).view(1, 1, local_len, ctx.seq_len)
    else:
        mask = ctx.allowed(q_index, k_index, window)
    return _sdpa(q, k_full, v_full, mask, scale)


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
        k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    order = natural_order_index(ctx.cp_size, ctx.chunk_len, q.device)
    inverse = torch.argsort(order)
    qs, ks, vs = (_heads_to_sequence(t, ctx, order) for t in (q, k, v))
    index = torch.arange(ctx.seq_len, device=q.device)
    mask = None if ctx.is_plain(window) else ctx.allowed(index, index, window)
    return _sequence_to_heads(_sdpa(qs, ks, vs, mask, scale), ctx, inverse)


# ------------------------------------------------------------------------------------------------
# ring
# ------------------------------------------------------------------------------------------------


def _ring_plan(ctx: AttentionContext, window: int | None) -> list[list[tuple]]:
    """For ring step s (holding the k/v of cp rank ``cp_rank - s``): the (q slot, kv slot, kind, mask)
    pairs to compute. kind: 'full' (no mask), 'causal' (same chunk, plain), 'masked' (bool mask).

    Decided on the host copy of the segment ids (no device sync), once per batch and window."""
    key = (id(ctx.segment_ids_host), window)
    cached = ctx.setup.plans.get(key)
    if cached is not None and cached[0] is ctx.segment_ids_host:  # every layer of a batch: plan once
        return cached[1]
    plain = ctx.is_plain(window)
    n = ctx.chunk_len
    plan = []
    for step in range(ctx.cp_size):
        src = (ctx.cp_rank - step) % ctx.cp_size
        pairs = []
        for qi, gq in enumerate(chunk_ids(ctx.cp_rank, ctx.cp_size)):
            for kj, gk in enumerate(chunk_ids(src, ctx.cp_size)):
                if gk > gq:
                    continue  # keys entirely after the queries
                if plain:
                    pairs.append((qi, kj, "causal" if gk == gq else "full", None))
                    continue
                q_index = torch.arange(gq * n, (gq + 1) * n)
                k_index = torch.arange(gk * n, (gk + 1) * n)
                mask = ctx.allowed(q_index, k_index, window, host=True)
                if not bool(mask.any()):
                    continue
                if bool(mask.all()):
                    pairs.append((qi, kj, "full", None))
                else:
                    pairs.append((qi, kj, "masked", mask.to(ctx.segment_ids.device, non_blocking=True)))
        plan.append(pairs)
    ctx.setup.plans.clear()  # keep the current batch's plans only
    ctx.setup.plans[key] = (ctx.segment_ids_host, plan)
    return plan


def _exchange(tensor: torch.Tensor, ctx: AttentionContext):
    """Send ``tensor`` to the next cp rank and receive the previous rank's; returns (requests, received)."""
    nxt, prv = _cp_peers(ctx)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, nxt, ctx.cp_group), dist.P2POp(dist.irecv, received, prv, ctx.cp_group)]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running (out, lse), in place; -inf means 'nothing yet'."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, scale, window):
        b, h, local_len, d = q.shape
        hkv, n = k.shape[1], ctx.chunk_len
        plan = _ring_plan(ctx, window)
        out = torch.zeros(b, h, local_len, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, local_len), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=1).contiguous()
        for step, pairs in enumerate(plan):
            pending = _exchange(kv, ctx) if step < ctx.cp_size - 1 else None
            k_cur, v_cur = kv.split(hkv, dim=1)
            for qi, kj, kind, mask in pairs:
                qs, ks = slice(qi * n, (qi + 1) * n), slice(kj * n, (kj + 1) * n)
                o_blk, l_blk = _compat.attention_forward_with_lse(
                    q[:, :, qs], _expand_heads(k_cur[:, :, ks], h), _expand_heads(v_cur[:, :, ks], h),
                    bias=_bias(mask, q.dtype) if kind == "masked" else None, is_causal=kind == "causal", scale=scale,
                )
                if kind == "masked":  # rows with no visible key in this block contribute nothing
                    has_key = mask.any(-1)                                  # (B, 1, n)
                    l_blk = l_blk.masked_fill(~has_key, float("-inf"))
                    o_blk = o_blk.masked_fill(~has_key.unsqueeze(-1), 0.0)
                _merge(out[:, :, qs], lse[:, :, qs], o_blk, l_blk)
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
        b, h, local_len, d = q.shape
        hkv, n, rep = k.shape[1], ctx.chunk_len, q.shape[1] // k.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=1).contiguous()
        dkv_pending = None
        for step, pairs in enumerate(plan):
            kv_pending = _exchange(kv, ctx) if step < ctx.cp_size - 1 else None
            k_cur, v_cur = kv.split(hkv, dim=1)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for qi, kj, kind, mask in pairs:
                qs, ks = slice(qi * n, (qi + 1) * n), slice(kj * n, (kj + 1) * n)
                dq_b, dk_b, dv_b = _compat.attention_backward(
                    grad_out[:, :, qs], q[:, :, qs], _expand_heads(k_cur[:, :, ks], h),
                    _expand_heads(v_cur[:, :, ks], h), out[:, :, qs], lse[:, :, qs].contiguous(),
                    bias=_bias(mask, q.dtype) if kind == "masked" else None, is_causal=kind == "causal", scale=scale,
                )
                dq[:, :, qs] += dq_b.float()
                dkv[:, :hkv, ks] += dk_b.float().view(b, hkv, rep, n, d).sum(2)
                dkv[:, hkv:, ks] += dv_b.float().view(b, hkv, rep, n, d).sum(2)
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
