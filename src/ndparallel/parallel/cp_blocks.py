"""Blockwise attention with log-sum-exp merging: the shared core of the ring and allgather CP methods.

A block is (a query chunk, a key/value range, a kind): 'full' (every key visible: no mask), 'causal'
(query and key chunk are the same chunk of one document: the fused causal kernel), or 'masked' (an
explicit boolean mask, for document boundaries, padding and sliding windows). Blocks whose keys are all
hidden are not computed. Which blocks exist is decided on the host from the segment ids (no device
sync) once per batch, and cached in the run's ``CPSetup``.

Forward runs the fused kernel of each block (``_compat.attention_forward_with_lse``) and merges the
partial outputs by their log-sum-exp. Backward gives each block the merged output and log-sum-exp, as
flash attention's backward does, so each block's gradients are exact on their own.
Shapes: q (B, H, n, D) per query chunk; k/v (B, Hkv, m, D) per block; GQA heads are expanded per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ndparallel import _compat
from ndparallel.parallel.context import AttentionContext


@dataclass(frozen=True)
class Block:
    q_slot: int          # 0 or 1: which of this rank's two query chunks
    k_start: int         # key range within the key tensor the block is computed against
    k_end: int
    kind: str            # 'full' | 'causal' | 'masked'
    mask: torch.Tensor | None = None   # (B, 1, n, k_end - k_start) bool on the device, for 'masked'


def classify(ctx: AttentionContext, q_chunk: int, k_chunk: int, window: int | None) -> tuple[str, torch.Tensor | None] | None:
    """Kind of the (query chunk, key chunk) pair in global chunk indices; None when nothing is visible."""
    if k_chunk > q_chunk:
        return None
    if ctx.is_plain(window):
        return ("causal", None) if k_chunk == q_chunk else ("full", None)
    n = ctx.chunk_len
    mask = ctx.allowed(torch.arange(q_chunk * n, (q_chunk + 1) * n), torch.arange(k_chunk * n, (k_chunk + 1) * n),
                       window, host=True)
    if not bool(mask.any()):
        return None
    if bool(mask.all()):
        return "full", None
    return "masked", mask.to(ctx.segment_ids.device, non_blocking=True)


def cached_plan(ctx: AttentionContext, name: str, window: int | None, build):
    """The plan ``build()`` makes for this batch, computed once for all layers (and reused in backward)."""
    key = (name, id(ctx.segment_ids_host), window)
    cached = ctx.setup.plans.get(key)
    if cached is not None and cached[0] is ctx.segment_ids_host:
        return cached[1]
    if any(entry[0] is not ctx.segment_ids_host for entry in ctx.setup.plans.values()):
        ctx.setup.plans.clear()  # a new batch: forget the previous one's plans
    plan = build()
    ctx.setup.plans[key] = (ctx.segment_ids_host, plan)
    return plan


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running (out, lse), in place; -inf means 'nothing yet'."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def forward_block(q_chunk, k, v, block: Block, scale: float):
    """(out, lse) of one block; k/v are the block's keys/values (B, Hkv, m, D)."""
    heads = q_chunk.shape[1]
    out, lse = _compat.attention_forward_with_lse(
        q_chunk, expand_heads(k, heads), expand_heads(v, heads),
        bias=_bias(block.mask, q_chunk.dtype) if block.kind == "masked" else None,
        is_causal=block.kind == "causal", scale=scale)
    if block.kind == "masked":  # rows with no visible key in this block contribute nothing
        has_key = block.mask.any(-1)                                    # (B, 1, n)
        lse = lse.masked_fill(~has_key, float("-inf"))
        out = out.masked_fill(~has_key.unsqueeze(-1), 0.0)
    return out, lse


def backward_block(grad_out, q_chunk, k, v, out, lse, block: Block, scale: float):
    """(dq, dk, dv) of one block given the merged out/lse; dk/dv summed back to the key/value heads."""
    heads, kv_heads = q_chunk.shape[1], k.shape[1]
    dq, dk, dv = _compat.attention_backward(
        grad_out, q_chunk, expand_heads(k, heads), expand_heads(v, heads), out, lse.contiguous(),
        bias=_bias(block.mask, q_chunk.dtype) if block.kind == "masked" else None,
        is_causal=block.kind == "causal", scale=scale)
    if heads != kv_heads:
        b, _, m, d = dk.shape
        dk = dk.float().view(b, kv_heads, heads // kv_heads, m, d).sum(2)
        dv = dv.float().view(b, kv_heads, heads // kv_heads, m, d).sum(2)
    return dq, dk, dv
