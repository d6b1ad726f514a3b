"""Run one planned variable-length call (``plan.VarlenCall``): forward (out, lse), backward.

Two kernels, the same results:
- CUDA in bf16/fp16: FlashAttention's variable-length kernel, which takes the call's cumulative lengths,
  its window and grouped key/value heads as they are (no copies of k/v, no mask);
- elsewhere (CPU, or fp32 on CUDA): the pieces are gathered into a few padded batches of similar size
  (each dimension rounded up by at most ~1/8, keys of a masked batch to a multiple of 8) and run through
  the dense fused kernels with
  log-sum-exp. A batch of square causal pieces needs no mask at all (top-left causal and padding at the
  end); other batches get a visibility mask per piece, O(piece area): the same order as the work.

Shapes (token-major): q (Tq, H, D) with the call's rows selected, k/v (Tk, Hkv, D); out (Tq, H, D) in q's
dtype; lse (Tq, H) float32 (natural log). Rows of the call are exactly the rows of its pieces.
"""

from __future__ import annotations

import torch

from ndparallel import _compat
from ndparallel.parallel.attention.plan import UNBOUNDED, VarlenCall


def select_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def call_forward(q, k, v, call: VarlenCall, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the call's query rows; ``q`` holds exactly those rows."""
    if _compat.flash_varlen_supported(q):
        out, lse = _compat.varlen_attention_forward(
            q,
            k,
            v,
            call.cu_q,
            call.cu_k,
            call.max_q,
            call.max_k,
            causal=call.causal,
            window_left=call.window_left,
            scale=scale,
        )
        return out, lse.t()
    return _dense_forward(q, k, v, call, scale)


def call_backward(grad_out, q, k, v, out, lse, call: VarlenCall, scale: float):
    """(dq, dk, dv) given the MERGED ``out`` and ``lse`` of the call's rows; dk/dv over all key rows."""
    if _compat.flash_varlen_supported(q):
        dq, dk, dv = _compat.varlen_attention_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse.t().contiguous(),
            call.cu_q,
            call.cu_k,
            call.max_q,
            call.max_k,
            causal=call.causal,
            window_left=call.window_left,
            scale=scale,
        )
        if call.unread_keys is not None:  # the kernel need not write the rows of filler sequences
            dk.index_fill_(0, call.unread_keys, 0.0)
            dv.index_fill_(0, call.unread_keys, 0.0)
        return dq, dk, dv
    return _dense_backward(grad_out, q, k, v, out, lse, call, scale)


# ------------------------------------------------------------------------------------------------
# The padded-batch path
# ------------------------------------------------------------------------------------------------


def _round_up(n: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """Padded sizes: multiples of 2^(floor(log2 n) - 3) (<= ~1/8 waste, so few distinct sizes) and of
    ``multiple``."""
    grain = torch.exp2(torch.floor(torch.log2(n.clamp(min=1).double())) - 3).long().clamp(min=1)
    grain = torch.lcm(grain, torch.tensor(multiple))
    return (n + grain - 1) // grain * grain


def _buckets(call: VarlenCall, device: torch.device) -> list[dict]:
    """Per padded size: gather indices (sentinel rows point past the end) and the mask, built once."""
    cached = call.cache.get(("dense", device))
    if cached is not None:
        return cached
    p = call.pieces
    square_causal = call.causal and call.window_left == UNBOUNDED and bool((p.q_len == p.k_len).all())
    q_pad = _round_up(p.q_len)
    # A masked batch's keys are a multiple of 8: the memory-efficient kernel wants its bias rows aligned.
    k_pad = q_pad if square_causal else _round_up(p.k_len, 8)
    buckets = []
    for lq, lk in torch.unique(torch.stack([q_pad, k_pad], 1), dim=0).tolist():
        sel = (q_pad == lq) & (k_pad == lk)
        q_len, k_len = p.q_len[sel, None], p.k_len[sel, None]
        i, j = torch.arange(lq)[None], torch.arange(lk)[None]
        q_index = torch.where(i < q_len, p.q_row[sel, None] + i, call.num_q)
        k_index = torch.where(j < k_len, p.k_row[sel, None] + j, call.num_keys)
        mask = None
        if not square_causal:
            mask = _visibility(q_len, k_len, p.window_left[sel], lq, lk, causal=call.causal).to(device)
        buckets.append(
            {
                "q": q_index.to(device),
                "k": k_index.to(device),
                "mask": mask,
                "q_real": (q_index < call.num_q).flatten().to(device),
            }
        )
    call.cache[("dense", device)] = buckets
    return buckets


def _visibility(q_len, k_len, left, lq: int, lk: int, *, causal: bool) -> torch.Tensor:
    """(P, 1, lq, lk) bool: the call's visibility rule per piece; padded query rows see key 0 only."""
    i = torch.arange(lq)[None, :, None]
    j = torch.arange(lk)[None, None, :]
    diag = (k_len - q_len)[:, :, None]  # bottom-right alignment
    visible = (i < q_len[:, :, None]) & (j < k_len[:, :, None])
    if causal:
        visible &= j - i <= diag
    bounded = (left != UNBOUNDED)[:, None, None]
    visible &= ~bounded | (j - i >= diag - left[:, None, None])
    visible |= (i >= q_len[:, :, None]) & (j == 0)  # keeps padded rows finite; never read
    return visible[:, None]


def _padded(x: torch.Tensor, index: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``index`` (P, L) of ``x`` (T, h, D) plus a zero row at T -> (P, heads, L, D)."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    out = padded[index].transpose(1, 2)
    return out if out.shape[1] == heads else out.repeat_interleave(heads // out.shape[1], dim=1)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _dense_forward(q, k, v, call: VarlenCall, scale: float):
    heads, d = q.shape[1], q.shape[2]
    out = q.new_empty(q.shape)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for bucket in _buckets(call, q.device):
        o, part_lse = _compat.attention_forward_with_lse(
            _padded(q, bucket["q"], heads),
            _padded(k, bucket["k"], heads),
            _padded(v, bucket["k"], heads),
            bias=_bias(bucket["mask"], q.dtype),
            is_causal=bucket["mask"] is None,
            scale=scale,
        )
        real = bucket["q_real"]
        rows = bucket["q"].flatten()[real]
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, heads, d)[real].to(out.dtype))
        lse.index_copy_(0, rows, part_lse.transpose(1, 2).reshape(-1, heads)[real].float())
    return out, lse


def _dense_backward(grad_out, q, k, v, out, lse, call: VarlenCall, scale: float):
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros((call.num_keys + 1, kv_heads, d), dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    # Padded query rows: no gradient and an infinite lse, so they add nothing to dk/dv.
    lse_padded = torch.cat([lse, lse.new_full((1, heads), float("inf"))])
    for bucket in _buckets(call, q.device):
        qi, ki = bucket["q"], bucket["k"]
        g_dq, g_dk, g_dv = _compat.attention_backward(
            _padded(grad_out.to(q.dtype), qi, heads),
            _padded(q, qi, heads),
            _padded(k, ki, heads),
            _padded(v, ki, heads),
            _padded(out.to(q.dtype), qi, heads),
            lse_padded[qi].transpose(1, 2).contiguous(),
            bias=_bias(bucket["mask"], q.dtype),
            is_causal=bucket["mask"] is None,
            scale=scale,
        )
        real = bucket["q_real"]
        dq.index_copy_(0, qi.flatten()[real], g_dq.transpose(1, 2).reshape(-1, heads, d)[real].float())
        group = heads // kv_heads  # GQA: sum the expanded heads back onto their key/value head
        for grad, acc in ((g_dk, dk), (g_dv, dv)):
            grad = grad.float().transpose(1, 2).reshape(-1, kv_heads, group, d).sum(2)
            acc.index_add_(0, ki.flatten(), grad)
    return dq, dk[:-1], dv[:-1]
