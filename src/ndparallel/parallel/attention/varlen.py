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

from dataclasses import dataclass

import torch

from ndparallel import _compat
from ndparallel.parallel.attention.plan import UNBOUNDED, VarlenCall


def select_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


MAX_KERNEL_ELEMENTS = 2**31
"""The most elements of a query or key tensor one FlashAttention varlen call is given. Past 2^31 the kernel
PyTorch ships returns wrong numbers without an error (H200, ``benchmarks/diagnostics/varlen_int32_diag.py``:
72% relative error at 1,572,864 tokens of the 1B, 0.3% at 1,048,576 = 2^31 / 2,048). Larger calls run as
several kernel calls, each given its own slices of q, k and v: groups of whole sequences (sequences are
independent: the same results), and a causal sequence that alone is too large in chunks of its queries, each
against the keys up to its last query (every query sees the keys it saw; the chunks' key gradients are summed
in float32). A non-causal sequence (a context-parallel rectangle) above the limit is not split."""


@dataclass(frozen=True)
class _Group:
    """A run of the call's sequences: its query rows [q0, q1), key rows [k0, k1) and cumulative lengths."""

    q0: int
    q1: int
    k0: int
    k1: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def _kernel_groups(call: VarlenCall, q: torch.Tensor, k: torch.Tensor) -> list[_Group]:
    """The call's sequences in groups whose q and k slices stay within ``MAX_KERNEL_ELEMENTS`` (host
    work, once per call: cached)."""
    per_q, per_k = q[0].numel(), k[0].numel()
    if call.num_q * per_q <= MAX_KERNEL_ELEMENTS and call.num_keys * per_k <= MAX_KERNEL_ELEMENTS:
        return []
    if "kernel_groups" not in call.cache:
        call.cache["kernel_groups"] = _split_sequences(call, per_q, per_k)
    return call.cache["kernel_groups"]


def _split_sequences(call: VarlenCall, per_q: int, per_k: int) -> list[_Group]:
    cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
    bounds, start = [0], 0  # indices into cu: a group is the sequences between two bounds
    for i in range(2, len(cu_q)):
        fits = (cu_q[i] - cu_q[start]) * per_q <= MAX_KERNEL_ELEMENTS
        fits &= (cu_k[i] - cu_k[start]) * per_k <= MAX_KERNEL_ELEMENTS
        if not fits and i - 1 > start:  # sequences start .. i-2 form a group; i-1 starts the next
            bounds.append(i - 1)
            start = i - 1
    bounds.append(len(cu_q) - 1)
    # A group of filler sequences only (no queries) adds nothing: its keys are unread, their gradients zero.
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if cu_q[b] > cu_q[a]]
    groups = []
    for a, b in spans:
        too_many = (cu_q[b] - cu_q[a]) * per_q > MAX_KERNEL_ELEMENTS
        if b == a + 1 and too_many and call.causal:
            groups += _query_chunks(cu_q[a], cu_q[b], cu_k[a], cu_k[b], max(1, MAX_KERNEL_ELEMENTS // per_q), call)
        else:
            groups.append(_group(cu_q, cu_k, a, b, call.cu_q.device))
    return groups


def _query_chunks(q0: int, q1: int, k0: int, k1: int, rows: int, call: VarlenCall) -> list[_Group]:
    """One causal sequence (queries [q0, q1), keys [k0, k1), aligned bottom-right) as chunks of ``rows``
    queries, each against the keys up to its last query: a query keeps its distance to the diagonal."""
    shift = (k1 - k0) - (q1 - q0)  # keys before the first query's diagonal
    chunks = []
    for a in range(0, q1 - q0, rows):
        b = min(a + rows, q1 - q0)
        cu = [[0, b - a], [0, shift + b]]
        chunks.append(_Group(q0 + a, q0 + b, k0, k0 + shift + b, *(_cumulative(c, call.cu_q.device) for c in cu)))
    return chunks


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(lengths, dtype=torch.int32).to(device)


def _group(cu_q: list[int], cu_k: list[int], a: int, b: int, device: torch.device) -> _Group:
    def rebased(cu: list[int]) -> torch.Tensor:
        return _cumulative([x - cu[a] for x in cu[a : b + 1]], device)

    return _Group(cu_q[a], cu_q[b], cu_k[a], cu_k[b], rebased(cu_q), rebased(cu_k))


def call_forward(q, k, v, call: VarlenCall, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the call's query rows; ``q`` holds exactly those rows."""
    if not _compat.flash_varlen_supported(q):
        return _dense_forward(q, k, v, call, scale)
    groups = _kernel_groups(call, q, k)
    if not groups:
        out, lse = _flash_forward(q, k, v, call.cu_q, call.cu_k, call, scale)
        return out, lse.t()
    parts = [
        _flash_forward(q[g.q0 : g.q1], k[g.k0 : g.k1], v[g.k0 : g.k1], g.cu_q, g.cu_k, call, scale) for g in groups
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], dim=1).t()


def _flash_forward(q, k, v, cu_q, cu_k, call: VarlenCall, scale: float):
    kernel_args = dict(causal=call.causal, window_left=call.window_left, scale=scale)
    return _compat.varlen_attention_forward(q, k, v, cu_q, cu_k, call.max_q, call.max_k, **kernel_args)


def call_backward(grad_out, q, k, v, out, lse, call: VarlenCall, scale: float):
    """(dq, dk, dv) given the MERGED ``out`` and ``lse`` of the call's rows; dk/dv over all key rows."""
    if not _compat.flash_varlen_supported(q):
        return _dense_backward(grad_out, q, k, v, out, lse, call, scale)
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.t().contiguous()
    groups = _kernel_groups(call, q, k)
    if not groups:
        dq, dk, dv = _flash_backward(grad_out, q, k, v, out, lse, call.cu_q, call.cu_k, call, scale)
    else:
        # chunks of one sequence share keys: their key gradients are summed, in float32
        shared = any(later.k0 < earlier.k1 for earlier, later in zip(groups, groups[1:]))
        sums = torch.float32 if shared else k.dtype
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(k.shape, dtype=sums, device=k.device) for _ in range(2))
        for g in groups:
            qs, ks = slice(g.q0, g.q1), slice(g.k0, g.k1)
            dq[qs], g_dk, g_dv = _flash_backward(
                grad_out[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs].contiguous(), g.cu_q, g.cu_k, call, scale
            )
            dk[ks] += g_dk
            dv[ks] += g_dv
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    if call.unread_keys is not None:  # the kernel need not write the rows of filler sequences
        dk.index_fill_(0, call.unread_keys, 0.0)
        dv.index_fill_(0, call.unread_keys, 0.0)
    return dq, dk, dv


def _flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, call: VarlenCall, scale: float):
    kernel_args = dict(causal=call.causal, window_left=call.window_left, scale=scale)
    return _compat.varlen_attention_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, call.max_q, call.max_k, **kernel_args
    )


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
