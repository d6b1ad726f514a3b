"""One context-parallel rank's attention work in one process, communication replaced by local tensors.

``rank_share`` gives cp rank ``rank`` its local queries (its two chunks) and, at each step, the keys and
values the real method would hold (allgather: the whole row; ring: the two chunks of the rank ``step``
places behind; alltoall: the whole row for its head group), and runs exactly the planned calls of
``cp_methods.py``, forward and backward. Summed over ranks, the returned dk/dv are the full gradients.

Used where several ranks cannot run: the GPU checks (``tests/gpu/gpu_checks.py``: every block shape of every
method through the CUDA kernels, against float64) and ``benchmarks/long_context/bench_cp_rank_share.py`` (one
rank's time and memory at lengths that need many GPUs). Training never calls it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ndparallel.parallel.attention import cp_methods as cpa
from ndparallel.parallel.sequence import chunk_ids, cp_shard


def fake_context(segments: torch.Tensor, cp: int, rank: int, method: str):
    """What the attention functions read from an ``AttentionContext``, without a process group."""
    host = segments.cpu()
    return SimpleNamespace(
        cp=cp,
        cp_rank=rank,
        method=method,
        cp_group=None,
        segment_ids_host=host,
        batch_size=host.shape[0],
        seq_len=host.shape[1],
        chunk_len=host.shape[1] // (2 * cp),
    )


def _tok(x: torch.Tensor) -> torch.Tensor:
    """(B, S, h, D) -> (B*S, h, D)."""
    return x.reshape(-1, *x.shape[2:])


def rank_share(
    q, k, v, grad, segments, *, cp: int, rank: int, method: str, scale: float, window=None, backward: bool = True
):
    """q/grad (B, S, H, D), k/v (B, S, Hkv, D) of whole rows. Returns a dict: ``out`` and ``dq`` of the
    rank's local tokens (B, 2n, h, D), ``dk``/``dv`` (B, S, Hkv, D) contributions, and ``heads`` (the
    query heads the rank computed: all, or its group under alltoall)."""
    b, s, h, d = q.shape
    ctx = fake_context(segments, cp, rank, method)
    if method == "alltoall" and cp > 1:
        heads = slice(rank * h // cp, (rank + 1) * h // cp)
        kv_heads_given = k.shape[2]
        if k.shape[2] % cp:  # as the real method: too few key/value heads to split, one copy per query head
            k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
        group = h // k.shape[2]
        kv_heads = slice(heads.start // group, heads.stop // group)
        ctx = fake_context(segments, 1, 0, method)
        result = _run(
            ctx,
            q[:, :, heads],
            k[:, :, kv_heads],
            v[:, :, kv_heads],
            grad[:, :, heads],
            scale,
            window,
            backward,
            kv_slice=kv_heads,
            hkv=k.shape[2],
        )
        result["heads"] = heads
        if backward and k.shape[2] != kv_heads_given:  # sum the copies back onto their key/value head
            for name in ("dk", "dv"):
                result[name] = result[name].view(b, s, kv_heads_given, -1, d).sum(3)
        return result
    shard = dict(cp=cp, cp_rank=rank, dim=1)
    local_q, local_grad = cp_shard(q, **shard), cp_shard(grad, **shard)
    result = _run(ctx, local_q, k, v, local_grad, scale, window, backward)
    result["heads"] = slice(0, h)
    return result


def _run(ctx, q, k, v, grad, scale, window, backward, kv_slice=None, hkv=None):
    b, local_len, h, d = q.shape
    qt, gt = _tok(q).contiguous(), _tok(grad).contiguous()
    stages = _stages(ctx, k, v, window, q.device)
    acc = cpa._new_accumulator(qt)
    for keys, values, calls, _ in stages:
        cpa._forward_calls(qt, keys, values, calls, scale, acc)
    out32, lse = acc
    out = out32.to(q.dtype)
    result = {"out": out.view(b, local_len, h, d)}
    if not backward:
        return result
    dq = torch.zeros(qt.shape, dtype=torch.float32, device=q.device)
    seq = ctx.seq_len
    dk_full = torch.zeros((b * seq, k.shape[2], d), dtype=torch.float32, device=q.device)
    dv_full = torch.zeros_like(dk_full)
    for keys, values, calls, rows in stages:
        dk = torch.zeros(keys.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        cpa._backward_calls(gt, qt, keys, values, out, lse, calls, scale, dq, dk, dv)
        dk_full.index_add_(0, rows, dk)
        dv_full.index_add_(0, rows, dv)
    result.update(dq=dq.view(b, local_len, h, d), dk=dk_full.view(b, seq, -1, d), dv=dv_full.view(b, seq, -1, d))
    if kv_slice is not None:  # alltoall: place the head group's gradients among all key/value heads
        for name in ("dk", "dv"):
            full = torch.zeros((b, seq, hkv, d), dtype=torch.float32, device=q.device)
            full[:, :, kv_slice] = result[name]
            result[name] = full
    return result


def _stages(ctx, k, v, window, device):
    """(keys, values, calls, row index of those keys in the whole rows) per step of the method."""
    b, seq = ctx.batch_size, ctx.seq_len
    whole_rows = torch.arange(b * seq, device=device)
    if ctx.cp == 1:
        return [(_tok(k).contiguous(), _tok(v).contiguous(), cpa._local_plan(ctx, window, device), whole_rows)]
    if ctx.method == "allgather":
        return [(_tok(k).contiguous(), _tok(v).contiguous(), cpa._allgather_plan(ctx, window, device), whole_rows)]
    plan = cpa._ring_plan(ctx, window, device)
    positions = whole_rows.view(b, seq)
    stages = []
    for step, calls in enumerate(plan):
        source = (ctx.cp_rank - step) % ctx.cp
        shard = dict(cp=ctx.cp, cp_rank=source, dim=1)
        stages.append(
            (
                _tok(cp_shard(k, **shard)).contiguous(),
                _tok(cp_shard(v, **shard)).contiguous(),
                calls,
                cp_shard(positions, **shard).flatten(),
            )
        )
    return stages


def local_rows(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Row positions of rank ``rank``'s local tokens, in local order."""
    n = seq // (2 * cp)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunk_ids(rank, cp)])


def whole_rows(q, k, v, grad, segments, *, cp: int, method: str, scale: float, window=None):
    """Every rank's share, put back together: (out, dq, dk, dv) over the whole rows, float32."""
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    dq = torch.zeros_like(out)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for rank in range(cp):
        r = rank_share(q, k, v, grad, segments, cp=cp, rank=rank, method=method, scale=scale, window=window)
        if method == "alltoall" and cp > 1:
            out[:, :, r["heads"]] = r["out"].float()
            dq[:, :, r["heads"]] = r["dq"]
        else:
            rows = local_rows(s, cp, rank, q.device)
            out[:, rows] = r["out"].float()
            dq[:, rows] = r["dq"]
        dk += r["dk"]
        dv += r["dv"]
    return out, dq, dk, dv
