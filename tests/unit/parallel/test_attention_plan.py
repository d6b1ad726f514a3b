"""The attention plan (host side, no kernels): the pieces of every block shape are exactly the rule
"same document, not in the future, within the window", the calls' cumulative lengths read every key at
most once and in order, and a batch's plans go away with the batch."""

from __future__ import annotations

import gc

import pytest
import torch
from support.packed_rows import random_segments

from ndparallel.parallel.attention import plan as ap
from ndparallel.parallel.sequence import segment_ids_from


def _segments(seed: int, batch: int = 3, seq: int = 96) -> torch.Tensor:
    # row 0: one document; the last row ends in 17 tokens of padding
    return random_segments(seed, batch=batch, seq=seq, lengths=(1, 30), whole_first_row=True, padded_tail=17)


def _rule(segments: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, S, S) bool: may the query at position i see the key at position j."""
    i = torch.arange(segments.shape[1])
    ok = (segments[:, :, None] == segments[:, None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        ok &= (i[:, None] - i[None, :]) < window
    return ok


def _visible_from_pieces(p: ap.Pieces, q: ap.Side, k: ap.Side, batch: int, seq: int) -> torch.Tensor:
    """Rebuild (B, S, S) visibility from pieces, reading the window the way the kernels do."""
    out = torch.zeros(batch, seq, seq, dtype=torch.bool)
    for q_row, lq, k_row, lk, left in zip(*(t.tolist() for t in (p.q_row, p.q_len, p.k_row, p.k_len, p.window_left))):
        b, qp = divmod(q_row, q.stride)
        kb, kp = divmod(k_row, k.stride)
        assert b == kb, "a piece never crosses rows"
        qp, kp = qp - q.base + q.lo, kp - k.base + k.lo
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None]
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if k.hi == q.hi:
            seen &= j - i <= lk - lq  # causal, aligned bottom-right
        if left != ap.UNBOUNDED:
            seen &= j - i >= (lk - lq) - left
        block = out[b, qp : qp + lq, kp : kp + lk]
        assert not (block & seen).any(), "pieces overlap"
        block |= seen
    return out


BLOCKS = {
    # (query side, key side) in a row of 96 tokens cut into 4 chunks of 24 (cp 2)
    "whole-row": (ap.Side(0, 96, 96, 0), ap.Side(0, 96, 96, 0)),
    "diagonal-chunk": (ap.Side(48, 72, 48, 24), ap.Side(48, 72, 48, 24)),
    "prefix": (ap.Side(72, 96, 48, 24), ap.Side(0, 96, 96, 0)),
    "earlier-chunk": (ap.Side(72, 96, 48, 24), ap.Side(24, 48, 48, 0)),
    "far-earlier-chunk": (ap.Side(72, 96, 48, 24), ap.Side(0, 24, 48, 0)),
}


@pytest.mark.parametrize("window", [None, 5, 30])
@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_are_exactly_the_attention_rule(block, window, seed):
    segments = _segments(seed)
    q, k = BLOCKS[block]
    pieces = ap.block_pieces(ap.find_documents(segments), q, k, window)
    got = _visible_from_pieces(pieces, q, k, *segments.shape)
    want = torch.zeros_like(got)
    want[:, q.lo : q.hi, k.lo : k.hi] = _rule(segments, window)[:, q.lo : q.hi, k.lo : k.hi]
    assert torch.equal(got, want)
    if k.hi <= q.lo:  # an earlier block: at most one piece per row (documents are contiguous)
        rows = torch.div(pieces.q_row, q.stride, rounding_mode="floor")
        assert rows.unique().numel() == rows.numel()


def test_calls_read_each_key_once_in_order_and_mark_the_rest():
    segments = _segments(3)
    q, k = BLOCKS["prefix"]
    pieces = ap.block_pieces(ap.find_documents(segments), q, k, None)
    num_keys = segments.shape[0] * segments.shape[1]
    (call,) = ap.make_calls(pieces, causal=True, num_keys=num_keys, device=torch.device("cpu"))
    cu_q, cu_k = call.cu_q.long(), call.cu_k.long()
    assert torch.all(cu_q[1:] >= cu_q[:-1]) and torch.all(cu_k[1:] >= cu_k[:-1])
    assert int(cu_q[-1]) == call.num_q == int(pieces.q_len.sum())
    read = torch.zeros(num_keys, dtype=torch.bool)
    for start, length in zip(pieces.k_row.tolist(), pieces.k_len.tolist()):
        assert not read[start : start + length].any()
        read[start : start + length] = True
    assert torch.equal(call.unread_keys, (~read).nonzero().flatten())
    # every piece is one sequence; fillers (no queries) cover the unread keys between pieces
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    assert torch.equal(lengths_q[lengths_q > 0], pieces.q_len)
    assert int(lengths_k[lengths_q == 0].sum()) + int(pieces.k_len.sum()) == int(cu_k[-1])


def test_one_call_per_window_and_none_without_pieces():
    segments = _segments(4)
    q, k = BLOCKS["far-earlier-chunk"]
    pieces = ap.block_pieces(ap.find_documents(segments), q, k, 30)
    calls = ap.make_calls(pieces, causal=False, num_keys=segments.numel(), device=torch.device("cpu"))
    assert sorted(c.window_left for c in calls) == sorted(set(pieces.window_left.tolist()))
    empty = ap.block_pieces(ap.find_documents(segments), q, k, 2)  # a window shorter than the gap
    assert ap.make_calls(empty, causal=False, num_keys=segments.numel(), device=torch.device("cpu")) == []


def test_plans_live_and_die_with_their_batch():
    segments = _segments(5)
    built = []
    for _ in range(3):  # computed once, then reused (all layers, forward and backward)
        ap.cached_plan(segments, ("test",), lambda docs: built.append(docs) or "plan")
    assert len(built) == 1 and segments in ap._PLANS
    del segments
    gc.collect()
    assert len(ap._PLANS) == 0


def test_documents_are_found_in_linear_host_work():
    # 1M tokens in 4,096-token documents: planning stays a few vectorized passes (no per-token Python).
    pos = (torch.arange(1 << 20) % 4096)[None]
    docs = ap.find_documents(segment_ids_from(pos, None))
    assert docs.start.numel() == 256 and int(docs.end[-1]) == 1 << 20
