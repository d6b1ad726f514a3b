"""A FlashAttention varlen call too large for the kernel's 32-bit offsets runs as several kernel calls over
groups of whole sequences, and a causal sequence too large alone as chunks of its queries
(``varlen.MAX_KERNEL_ELEMENTS``): the same outputs, log-sum-exps and gradients as one call, every kernel call
within the limit. On CPU the kernel is a reference written here (plain torch,
float32, checked against the dense path); the limit is lowered so that small plans split."""

from __future__ import annotations

import pytest
import torch
from support.packed_rows import random_segments

from ndparallel import _compat
from ndparallel.parallel.attention import plan as ap
from ndparallel.parallel.attention import varlen

H, KV, D = 4, 2, 8
SCALE = D**-0.5


def _sequences(q, k, v, cu_q, cu_k, causal: bool, window_left: int):
    """Reference varlen attention: each sequence alone, causal aligned bottom-right, a query seeing keys at most
    ``window_left`` left of its diagonal (-1: all); (out, lse (H, Tq))."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        if lq == 0:
            continue
        keys = k[ks].repeat_interleave(H // KV, dim=1)
        values = v[ks].repeat_interleave(H // KV, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs], keys) * SCALE
        diagonal = torch.arange(lq)[:, None] + (lk - lq)
        visible = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            visible &= torch.arange(lk)[None, :] <= diagonal
        if window_left >= 0:
            visible &= torch.arange(lk)[None, :] >= diagonal - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[:, qs] = torch.logsumexp(scores, dim=-1)
        out[qs] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    return out, lse


class _FakeKernel:
    """Stands in for FlashAttention on CPU and records the largest q / k tensor it was given."""

    def __init__(self):
        self.largest = (0, 0)
        self.calls = 0

    def _seen(self, q, k):
        self.calls += 1
        self.largest = (max(self.largest[0], q.numel()), max(self.largest[1], k.numel()))

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, window_left, scale):
        self._seen(q, k)
        return _sequences(q, k, v, cu_q.tolist(), cu_k.tolist(), causal, window_left)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, window_left, scale):
        self._seen(q, k)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        again, _ = _sequences(*leaves, cu_q.tolist(), cu_k.tolist(), causal, window_left)
        return torch.autograd.grad(again, leaves, grad_out)


def _segments(seed: int, batch: int = 2, seq: int = 96) -> torch.Tensor:
    return random_segments(seed, batch=batch, seq=seq, lengths=(3, 60))  # some documents cross a chunk


def _with_pieces(q_side: ap.Side, k_side: ap.Side, batch: int, window: int | None):
    """Rows (the first seed that works) in which the block has several pieces, and the pieces."""
    for seed in range(100):
        segments = _segments(seed, batch=batch)
        pieces = ap.block_pieces(ap.find_documents(segments), q_side, k_side, window)
        if pieces.q_len.numel() >= 2:
            return segments, pieces
    raise AssertionError("no rows give this block two pieces")


BLOCKS = {  # (query side, key side) of rows of 96 (see test_attention_plan.py)
    "whole-row": (ap.Side(0, 96, 96, 0), ap.Side(0, 96, 96, 0)),
    "prefix": (ap.Side(72, 96, 48, 24), ap.Side(0, 96, 96, 0)),
    "earlier-chunk": (ap.Side(72, 96, 48, 24), ap.Side(24, 48, 48, 0)),  # filler sequences, unread keys
}


def _run(q_all, k, v, grad_all, call):
    q = varlen.select_rows(q_all, call.q_rows)
    out, lse = varlen.call_forward(q, k, v, call, SCALE)
    grads = varlen.call_backward(varlen.select_rows(grad_all, call.q_rows), q, k, v, out, lse, call, SCALE)
    return out, lse, *grads


@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("limit_rows", [1, 7, 30])
def test_split_calls_give_what_one_call_gives(block, limit_rows, window, monkeypatch):
    q_side, k_side = BLOCKS[block]
    segments, pieces = _with_pieces(q_side, k_side, batch=4, window=window)
    batch = segments.shape[0]
    g = torch.Generator().manual_seed(0)
    q_all = torch.randn(batch * q_side.stride, H, D, generator=g, dtype=torch.float32)
    k, v = (torch.randn(batch * k_side.stride, KV, D, generator=g, dtype=torch.float32) for _ in range(2))
    grad_all = torch.randn(q_all.shape, generator=g, dtype=torch.float32)
    causal, num_keys = k_side.hi == q_side.hi, k.shape[0]

    def calls():
        return ap.make_calls(pieces, causal=causal, num_keys=num_keys, device=torch.device("cpu"))

    dense = [_run(q_all, k, v, grad_all, call) for call in calls()]  # the padded-batch kernels: a check of the fake
    kernel = _FakeKernel()
    monkeypatch.setattr(_compat, "flash_varlen_supported", lambda q: True)
    monkeypatch.setattr(_compat, "varlen_attention_forward", kernel.forward)
    monkeypatch.setattr(_compat, "varlen_attention_backward", kernel.backward)
    whole = [_run(q_all, k, v, grad_all, call) for call in calls()]
    one_call_each, kernel.largest = kernel.calls, (0, 0)
    monkeypatch.setattr(varlen, "MAX_KERNEL_ELEMENTS", limit_rows * H * D)
    split_calls = calls()
    split = [_run(q_all, k, v, grad_all, call) for call in split_calls]

    assert kernel.calls > one_call_each, "the lowered limit must split the calls"
    longest = 0 if causal else int(pieces.q_len.max())  # a causal sequence is chunked; a rectangle is not
    assert kernel.largest[0] <= max(limit_rows, longest) * H * D
    for reference, one, several in zip(dense, whole, split):
        for a, b, c in zip(reference, one, several):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # the fake kernel is right
            # splitting changes nothing but the order in which chunks' key gradients are summed
            torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6)


def test_a_call_within_the_limit_is_one_kernel_call(monkeypatch):
    segments = _segments(seed=3)
    q_side, k_side = BLOCKS["whole-row"]
    pieces = ap.block_pieces(ap.find_documents(segments), q_side, k_side, None)
    (call,) = ap.make_calls(pieces, causal=True, num_keys=2 * 96, device=torch.device("cpu"))
    kernel = _FakeKernel()
    monkeypatch.setattr(_compat, "flash_varlen_supported", lambda q: True)
    monkeypatch.setattr(_compat, "varlen_attention_forward", kernel.forward)
    monkeypatch.setattr(_compat, "varlen_attention_backward", kernel.backward)
    q = torch.randn(2 * 96, H, D, dtype=torch.float32)
    k, v = torch.randn(2, 2 * 96, KV, D, dtype=torch.float32)
    varlen.call_forward(q, k, v, call, SCALE)
    assert kernel.calls == 1 and "kernel_groups" not in call.cache


def test_one_long_document_runs_as_chunks_of_its_queries(monkeypatch):
    """Rows of one document each: every kernel call within the limit, the same results as one call."""
    segments = torch.zeros(2, 96, dtype=torch.long)
    segments[1] = 1
    side = ap.Side(0, 96, 96, 0)
    pieces = ap.block_pieces(ap.find_documents(segments), side, side, None)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2 * 96, H, D, generator=g)
    k, v = torch.randn(2, 2 * 96, KV, D, generator=g)
    grad = torch.randn(q.shape, generator=g)
    kernel = _FakeKernel()
    monkeypatch.setattr(_compat, "flash_varlen_supported", lambda q: True)
    monkeypatch.setattr(_compat, "varlen_attention_forward", kernel.forward)
    monkeypatch.setattr(_compat, "varlen_attention_backward", kernel.backward)
    (whole,) = ap.make_calls(pieces, causal=True, num_keys=2 * 96, device=torch.device("cpu"))
    expected = _run(q, k, v, grad, whole)
    monkeypatch.setattr(varlen, "MAX_KERNEL_ELEMENTS", 10 * H * D)
    kernel.calls, kernel.largest = 0, (0, 0)
    (chunked,) = ap.make_calls(pieces, causal=True, num_keys=2 * 96, device=torch.device("cpu"))
    got = _run(q, k, v, grad, chunked)
    assert len(chunked.cache["kernel_groups"]) == 2 * 10  # ceil(96 / 10) chunks per document
    assert kernel.largest[0] <= 10 * H * D and kernel.calls == 2 * 20
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
