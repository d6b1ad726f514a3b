"""Document-aware attention over this rank's tokens: cp = 1 and the three context-parallel methods.

transformers gives q (B, H, L, D) and k, v (B, Hkv, L, D); under CP, L = S/cp local tokens (two chunks of
n = S/(2cp), see ``parallel/sequence.py``). Work is token-major, (B*L, H, D); the output is (B, L, H, D), the
layout transformers wants back. Which keys each query sees is planned once per batch as fused
variable-length calls (``parallel/attention/plan.py``), run by ``parallel/attention/varlen.py``:

- cp = 1: one causal call over the whole rows (one sequence per document);
- ``allgather``: all-gather k/v over cp (GQA keeps this cheap: Hkv << H); each local query chunk is one
  causal call against its whole prefix (documents' keys up to the query); backward reduce-scatters dk/dv.
  Memory O(S) for k/v, no (L, S) mask;
- ``ring``: k/v blocks travel the ring peer to peer; the transfer of the next block overlaps the current
  block's calls (the diagonal block is causal; an earlier block is at most one rectangle per row);
  partial results merge by log-sum-exp; in backward dk/dv accumulators travel the ring after the blocks.
  Memory O(S/cp);
- ``alltoall`` (Ulysses): all-to-all trades the sequence split for a head split; attention runs on whole
  rows for H/cp heads (as cp = 1), and a second all-to-all trades back. Needs H divisible by cp (x tp).

Backward gives every call the MERGED output and log-sum-exp of its rows (as flash attention's own
backward does), so each call's gradients are exact on their own. Attention sinks (``s_aux``: a learned
logit per head for a key with value 0) merge as one more block of lse = sink, and get their gradient
-sum(p_sink * rowsum(dO * O)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndparallel.parallel.attention.plan import Side, block_pieces, cached_plan, make_calls
from ndparallel.parallel.attention.varlen import call_backward, call_forward, select_rows
from ndparallel.parallel.comm import all_to_all
from ndparallel.parallel.sequence import chunk_ids, natural_order_index


def context_attention(q, k, v, ctx, *, scale: float, window: int | None, sinks: torch.Tensor | None = None):
    """Attention of this rank's queries, exact for packed/padded rows and CP; returns (B, L, H, D)."""
    b, h, local_len, d = q.shape
    if ctx.method == "alltoall" and ctx.cp > 1:
        return _ulysses_attention(q, k, v, ctx, scale, window, sinks)
    qt, kt, vt = (_tokens(t) for t in (q, k, v))
    if ctx.cp == 1:
        calls = _local_plan(ctx, window, q.device)
        out = _LocalAttention.apply(qt, kt, vt, calls, scale, sinks)
    elif ctx.method == "allgather":
        out = _AllGatherAttention.apply(qt, kt, vt, ctx, scale, window, sinks)
    else:
        out = _RingAttention.apply(qt, kt, vt, ctx, scale, window, sinks)
    return out.view(b, local_len, h, d)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, h, L, D) -> (B*L, h, D); free when x is a transposed view of (B, L, h, D), as transformers' are."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


# ------------------------------------------------------------------------------------------------
# Plans (cached per batch)
# ------------------------------------------------------------------------------------------------


def _local_plan(ctx, window, device):
    """cp = 1 (or after Ulysses' exchange): the whole rows, one causal call per window."""
    seq = ctx.seq_len
    whole = Side(lo=0, hi=seq, stride=seq, base=0)
    keys = ctx.batch_size * seq
    return cached_plan(
        ctx.segment_ids_host,
        ("local", window, device),
        lambda docs: make_calls(block_pieces(docs, whole, whole, window), causal=True, num_keys=keys, device=device),
    )


def _query_side(ctx, slot: int, chunk: int) -> Side:
    n = ctx.chunk_len
    return Side(lo=chunk * n, hi=(chunk + 1) * n, stride=2 * n, base=slot * n)


def _allgather_plan(ctx, window, device):
    """Per local query chunk: one causal call against its prefix in the gathered, row-ordered k/v."""

    def build(docs):
        calls = []
        for slot, chunk in enumerate(chunk_ids(ctx.cp_rank, ctx.cp)):
            q = _query_side(ctx, slot, chunk)
            prefix = Side(lo=0, hi=q.hi, stride=ctx.seq_len, base=0)
            calls += make_calls(
                block_pieces(docs, q, prefix, window), causal=True, num_keys=ctx.batch_size * ctx.seq_len, device=device
            )
        return calls

    return cached_plan(ctx.segment_ids_host, ("allgather", ctx.cp, ctx.cp_rank, window, device), build)


def _ring_plan(ctx, window, device):
    """For ring step s (holding the two chunks of cp rank ``cp_rank - s``): its calls."""

    def build(docs):
        plan = []
        for step in range(ctx.cp):
            source = (ctx.cp_rank - step) % ctx.cp
            calls = []
            for q_slot, q_chunk in enumerate(chunk_ids(ctx.cp_rank, ctx.cp)):
                for k_slot, k_chunk in enumerate(chunk_ids(source, ctx.cp)):
                    if k_chunk <= q_chunk:
                        calls += make_calls(
                            block_pieces(
                                docs, _query_side(ctx, q_slot, q_chunk), _query_side(ctx, k_slot, k_chunk), window
                            ),
                            causal=k_chunk == q_chunk,
                            num_keys=ctx.batch_size * 2 * ctx.chunk_len,
                            device=device,
                        )
            plan.append(calls)
        return plan

    return cached_plan(ctx.segment_ids_host, ("ring", ctx.cp, ctx.cp_rank, window, device), build)


# ------------------------------------------------------------------------------------------------
# Running calls, merging, sinks
# ------------------------------------------------------------------------------------------------


def _new_accumulator(q):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _merge(acc_out, acc_lse, rows, out, lse) -> None:
    """Fold one call's (out, lse) into the running (out, lse) of ``rows``, by log-sum-exp."""
    o = acc_out[rows] if isinstance(rows, slice) else acc_out.index_select(0, rows)
    old_lse = acc_lse[rows] if isinstance(rows, slice) else acc_lse.index_select(0, rows)
    new = torch.logaddexp(old_lse, lse)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    merged = o * torch.exp(old_lse - safe).unsqueeze(-1) + out.float() * torch.exp(lse - safe).unsqueeze(-1)
    if isinstance(rows, slice):
        acc_out[rows], acc_lse[rows] = merged, new
    else:
        acc_out.index_copy_(0, rows, merged)
        acc_lse.index_copy_(0, rows, new)


def _forward_calls(q, k, v, calls, scale, acc) -> None:
    for call in calls:
        out, lse = call_forward(select_rows(q, call.q_rows), k, v, call, scale)
        _merge(*acc, call.q_rows, out, lse)


def _add_rows(acc: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        acc[rows] += value
    else:
        acc.index_add_(0, rows, value.float())


def _backward_calls(grad_out, q, k, v, out, lse, calls, scale, dq, dk, dv) -> None:
    """Accumulate every call's gradients (float32) into dq (query rows) and dk/dv (key rows)."""
    for call in calls:
        rows = call.q_rows
        g_dq, g_dk, g_dv = call_backward(
            select_rows(grad_out, rows),
            select_rows(q, rows),
            k,
            v,
            select_rows(out, rows),
            select_rows(lse, rows),
            call,
            scale,
        )
        _add_rows(dq, rows, g_dq.float())
        dk += g_dk
        dv += g_dv


def _with_sinks(out, lse, sinks):
    """Merge a key of value 0 and logit ``sinks`` (H,) into every row: out (T, H, D) f32, lse (T, H)."""
    if sinks is None:
        return out, lse
    sink = sinks.detach().float()[None, :]
    new = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - new).unsqueeze(-1), new


def _sink_grad(grad_out, out, lse, sinks):
    """d loss / d sink_h = -sum over rows of p_sink * rowsum(dO * O), with the final out and lse."""
    if sinks is None:
        return None
    p_sink = torch.exp(sinks.detach().float()[None, :] - lse)
    delta = (grad_out.float() * out.float()).sum(-1)
    return (-(p_sink * delta).sum(0)).to(sinks.dtype)


# ------------------------------------------------------------------------------------------------
# cp = 1 (and the attention part of Ulysses)
# ------------------------------------------------------------------------------------------------


class _LocalAttention(torch.autograd.Function):
    """q (T, H, D), k/v (T, Hkv, D) of whole rows; ``calls`` from ``_local_plan``."""

    @staticmethod
    def forward(fctx, q, k, v, calls, scale, sinks):
        whole = len(calls) == 1 and calls[0].q_rows == slice(0, q.shape[0])
        if whole and sinks is None:  # one call covers every row: nothing to merge
            out, lse = call_forward(q, k, v, calls[0], scale)
        else:
            acc = _new_accumulator(q)
            _forward_calls(q, k, v, calls, scale, acc)
            out, lse = _with_sinks(*acc, sinks)
            out = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse, sinks)
        fctx.calls, fctx.scale = calls, scale
        return out

    @staticmethod
    def backward(fctx, grad_out):
        q, k, v, out, lse, sinks = fctx.saved_tensors
        grad_out = grad_out.contiguous()
        if len(fctx.calls) == 1 and fctx.calls[0].q_rows == slice(0, q.shape[0]):
            dq, dk, dv = call_backward(grad_out, q, k, v, out, lse, fctx.calls[0], fctx.scale)
        else:
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros_like(dk)
            _backward_calls(grad_out, q, k, v, out, lse, fctx.calls, fctx.scale, dq, dk, dv)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, _sink_grad(grad_out, out, lse, sinks))


# ------------------------------------------------------------------------------------------------
# allgather
# ------------------------------------------------------------------------------------------------


def _gather_kv(k, v, ctx):
    """All-gather local k/v (B*L, Hkv, D) over cp -> (B*S, 2*Hkv, D) in row order, and the order used."""
    hkv, d, local_len = k.shape[1], k.shape[2], 2 * ctx.chunk_len
    gathered = k.new_empty((ctx.cp * k.shape[0], 2 * hkv, d))
    dist.all_gather_into_tensor(gathered, torch.cat([k, v], dim=1), group=ctx.cp_group)
    b = ctx.batch_size
    kv = gathered.view(ctx.cp, b, local_len, 2 * hkv, d).transpose(0, 1).reshape(b, -1, 2 * hkv, d)
    order = natural_order_index(ctx.cp, ctx.chunk_len, k.device)
    return kv.index_select(1, order).reshape(-1, 2 * hkv, d), order


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, scale, window, sinks):
        hkv = k.shape[1]
        kv, order = _gather_kv(k, v, ctx)
        calls = _allgather_plan(ctx, window, q.device)
        acc = _new_accumulator(q)
        _forward_calls(q, kv[:, :hkv], kv[:, hkv:], calls, scale, acc)
        out, lse = _with_sinks(*acc, sinks)
        out = out.to(q.dtype)
        fctx.save_for_backward(q, kv, out, lse, order, sinks)
        fctx.calls, fctx.ctx, fctx.scale = calls, ctx, scale
        return out

    @staticmethod
    def backward(fctx, grad_out):
        q, kv, out, lse, order, sinks = fctx.saved_tensors
        ctx, hkv, d = fctx.ctx, kv.shape[1] // 2, kv.shape[2]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros((kv.shape[0], hkv, d), dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        _backward_calls(grad_out, q, kv[:, :hkv], kv[:, hkv:], out, lse, fctx.calls, fctx.scale, dq, dk, dv)
        # Back to rank-major order; each rank receives the sum of its own tokens' gradients.
        b, cp, local_len = ctx.batch_size, ctx.cp, 2 * ctx.chunk_len
        dkv = torch.cat([dk, dv], dim=1).view(b, -1, 2 * hkv, d).index_select(1, torch.argsort(order))
        dkv = dkv.view(b, cp, local_len, 2 * hkv, d).transpose(0, 1).reshape(cp * b * local_len, 2 * hkv, d)
        mine = dkv.new_empty((b * local_len, 2 * hkv, d))
        dist.reduce_scatter_tensor(mine, dkv.contiguous(), group=ctx.cp_group)
        dk, dv = mine.split(hkv, dim=1)
        return (dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None, _sink_grad(grad_out, out, lse, sinks))


# ------------------------------------------------------------------------------------------------
# ring
# ------------------------------------------------------------------------------------------------


def _exchange(tensor: torch.Tensor, ctx):
    """Send ``tensor`` to the next cp rank and receive the previous rank's; returns (requests, received)."""
    nxt = dist.get_global_rank(ctx.cp_group, (ctx.cp_rank + 1) % ctx.cp)
    prv = dist.get_global_rank(ctx.cp_group, (ctx.cp_rank - 1) % ctx.cp)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, nxt, ctx.cp_group), dist.P2POp(dist.irecv, received, prv, ctx.cp_group)]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, scale, window, sinks):
        hkv = k.shape[1]
        plan = _ring_plan(ctx, window, q.device)
        acc = _new_accumulator(q)
        kv = torch.cat([k, v], dim=1)
        for step, calls in enumerate(plan):
            pending = _exchange(kv, ctx) if step < ctx.cp - 1 else None  # overlaps this step's calls
            _forward_calls(q, kv[:, :hkv], kv[:, hkv:], calls, scale, acc)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        out, lse = _with_sinks(*acc, sinks)
        out = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse, sinks)
        fctx.plan, fctx.ctx, fctx.scale = plan, ctx, scale
        return out

    @staticmethod
    def backward(fctx, grad_out):
        q, k, v, out, lse, sinks = fctx.saved_tensors
        ctx, hkv = fctx.ctx, k.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=1)
        dkv_pending = None
        for step, calls in enumerate(fctx.plan):
            kv_pending = _exchange(kv, ctx) if step < ctx.cp - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            dk, dv = dkv[:, :hkv], dkv[:, hkv:]
            _backward_calls(grad_out, q, kv[:, :hkv], kv[:, hkv:], out, lse, calls, fctx.scale, dq, dk, dv)
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
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, _sink_grad(grad_out, out, lse, sinks))


# ------------------------------------------------------------------------------------------------
# alltoall (Ulysses)
# ------------------------------------------------------------------------------------------------


def _heads_to_sequence(x, ctx, order):
    """(B, h, L, D) with the local tokens -> (B*S, h/cp, D): the whole rows, in row order, token-major."""
    b, h, local_len, d = x.shape
    cp = ctx.cp
    x = x.reshape(b, cp, h // cp, local_len, d).transpose(0, 1)
    x = all_to_all(x, ctx.cp_group)  # (cp_src, B, h/cp, L, D)
    x = x.permute(1, 0, 3, 2, 4).reshape(b, cp * local_len, h // cp, d)
    return x.index_select(1, order).reshape(-1, h // cp, d)


def _sequence_to_heads(x, ctx, inverse_order, batch):
    """(B*S, h/cp, D) whole rows -> (B, L, h, D) with this rank's tokens and all heads."""
    _, hg, d = x.shape
    cp = ctx.cp
    x = x.view(batch, -1, hg, d).index_select(1, inverse_order)
    x = x.view(batch, cp, -1, hg, d).transpose(0, 1)  # (destination rank, B, L, h/cp, D)
    x = all_to_all(x, ctx.cp_group)  # (head group, B, L, h/cp, D)
    return x.permute(1, 2, 0, 3, 4).reshape(batch, x.shape[2], cp * hg, d)


def _ulysses_attention(q, k, v, ctx, scale, window, sinks):
    heads, batch = q.shape[1], q.shape[0]
    if k.shape[1] % ctx.cp:
        # Too few key/value heads to split over cp: give every query head its own copy first.
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    order = natural_order_index(ctx.cp, ctx.chunk_len, q.device)
    qs, ks, vs = (_heads_to_sequence(t, ctx, order) for t in (q, k, v))
    if sinks is not None:  # this rank's head group
        group = heads // ctx.cp
        sinks = sinks[ctx.cp_rank * group : (ctx.cp_rank + 1) * group]
    calls = _local_plan(ctx, window, q.device)
    out = _LocalAttention.apply(qs, ks, vs, calls, scale, sinks)
    return _sequence_to_heads(out, ctx, torch.argsort(order), batch)
