"""Which queries attend to which keys, as a few fused variable-length attention calls planned on the host.

A row holds documents back to back (packed), then maybe padding (a document of its own). A query attends
to the keys of its own document at or before it; with a sliding window W, only to the last W of them.
Context parallelism looks at a row in chunks. For a block of query positions [q.lo, q.hi) against key
positions [k.lo, k.hi) there are two shapes:

- ``k.hi == q.hi`` (a causal block: a chunk against itself, or against its whole prefix): every document
  that meets the query range gives one piece, its queries in the range against its keys from
  max(document start, k.lo) to the end of those queries: causal attention aligned bottom-right (the last
  query sees the last key);
- ``k.hi <= q.lo`` (an earlier block): documents are contiguous, so only the one document that runs from
  the key range into the query range sees anything: one dense rectangle of its tail keys against its head
  queries, with no mask (under a window: a band, clipped to the queries that still see a key).

A fused variable-length kernel (FlashAttention's varlen interface: cumulative lengths, not a mask) takes
all pieces of a block in one call. No (L x S) mask exists anywhere; planning costs O(documents) per batch
plus O(tokens) vectorized host work to find the documents, and is done once per batch (cached on the
batch's host segment tensor) for all layers, forward and backward.

Tensors here are token-major: row b, position p of a block side lives at ``b * stride + base + (p - lo)``.
Keys are read in place: the key rows between the pieces of a call become "filler" sequences without
queries, so no key or value is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

UNBOUNDED = -1
"""A window side without a limit (FlashAttention's convention)."""


@dataclass(frozen=True)
class Documents:
    """Maximal runs of one segment id per row: documents and padding runs. Host int64 tensors (N,)."""

    row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    """One past the document's last position."""


def find_documents(segments: torch.Tensor) -> Documents:
    """The documents of ``segments`` (B, S), host; vectorized, O(B*S)."""
    batch, seq = segments.shape
    starts = torch.ones(batch, seq, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    row, start = starts.nonzero(as_tuple=True)
    end = torch.empty_like(start)
    end[:-1] = start[1:]
    last_of_row = torch.ones_like(row, dtype=torch.bool)
    last_of_row[:-1] = row[1:] != row[:-1]
    end[last_of_row] = seq
    return Documents(row=row, start=start, end=end)


@dataclass(frozen=True)
class Side:
    """Row positions [lo, hi) of one side of a block, and where they sit in a token-major tensor."""

    lo: int
    hi: int
    stride: int
    """Tokens per row in the tensor."""
    base: int
    """Offset of position ``lo`` inside a row of the tensor."""

    def offset(self, row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return row * self.stride + self.base + (pos - self.lo)


@dataclass(frozen=True)
class Pieces:
    """One (queries, keys) piece per document, host int64 tensors (P,) in increasing tensor order."""

    q_row: torch.Tensor
    q_len: torch.Tensor
    k_row: torch.Tensor
    k_len: torch.Tensor
    window_left: torch.Tensor
    """How far left of the bottom-right diagonal a query still sees keys (UNBOUNDED: no limit)."""

    def select(self, keep: torch.Tensor) -> "Pieces":
        return Pieces(*(t[keep] for t in (self.q_row, self.q_len, self.k_row, self.k_len, self.window_left)))


def block_pieces(docs: Documents, q: Side, k: Side, window: int | None) -> Pieces:
    """The pieces of the block (queries ``q``, keys ``k``); see the module docstring for the two shapes."""
    causal = k.hi == q.hi
    if not causal and k.hi > q.lo:
        raise AssertionError(f"a block's keys end at its queries' end or before its start: {q}, {k}")
    meets = (docs.end > q.lo) & (docs.start < q.hi)
    row, start, end = docs.row[meets], docs.start[meets], docs.end[meets]
    q_start, q_end = start.clamp(min=q.lo), end.clamp(max=q.hi)
    k_start, k_end = start.clamp(min=k.lo), end.clamp(max=k.hi)
    if window is not None:
        k_start = torch.maximum(k_start, q_start - window + 1)  # keys the first query can still see
        if not causal:
            q_end = torch.minimum(q_end, k_end - 1 + window)  # queries that still see the last key
    keep = (q_end > q_start) & (k_end > k_start)
    row, q_start, q_end, k_start, k_end = (t[keep] for t in (row, q_start, q_end, k_start, k_end))
    if window is None:
        left = torch.full_like(row, UNBOUNDED)
    elif causal:
        left = torch.full_like(row, window - 1)  # q_end == k_end: the diagonal is the query's own position
    else:
        # Key j is visible to query i iff j - i >= (Lk - Lq) - left, i.e. key position > query position - W.
        left = k_end - q_end + window - 1
        left = left.masked_fill((q_end - 1) - k_start < window, UNBOUNDED)  # the band covers the rectangle
    return Pieces(
        q_row=q.offset(row, q_start),
        q_len=q_end - q_start,
        k_row=k.offset(row, k_start),
        k_len=k_end - k_start,
        window_left=left,
    )


@dataclass
class VarlenCall:
    """One fused variable-length attention call over a query tensor and a key/value tensor.

    ``q_rows`` picks the call's query rows (a slice: a view; or an index); the call's sequences are the
    pieces, with filler sequences (no queries) over key rows no piece reads. ``pieces`` is in call
    coordinates (query rows counted within the call). ``cache`` holds what a kernel derives once per batch.
    """

    causal: bool
    window_left: int
    q_rows: slice | torch.Tensor
    num_q: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    unread_keys: torch.Tensor | None
    """Key rows no piece reads, on the device (their gradients must be zero), or None."""
    num_keys: int
    pieces: Pieces
    cache: dict = field(default_factory=dict, repr=False)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _query_rows(p: Pieces) -> slice | torch.Tensor:
    stops = p.q_row + p.q_len
    if bool((p.q_row[1:] == stops[:-1]).all()):
        return slice(int(p.q_row[0]), int(stops[-1]))
    shift = p.q_row - _exclusive_cumsum(p.q_len)  # concatenated aranges, vectorized
    return torch.arange(int(p.q_len.sum())) + torch.repeat_interleave(shift, p.q_len)


def _unread_keys(p: Pieces, num_keys: int) -> torch.Tensor:
    marks = torch.zeros(num_keys + 1, dtype=torch.long)
    marks.index_add_(0, p.k_row, torch.ones_like(p.k_row))
    marks.index_add_(0, p.k_row + p.k_len, -torch.ones_like(p.k_row))
    return (torch.cumsum(marks[:-1], 0) == 0).nonzero().flatten()


def make_call(p: Pieces, *, causal: bool, window_left: int, num_keys: int, device: torch.device) -> VarlenCall:
    """The call for pieces ``p`` (all with this ``window_left``)."""
    k_prev_end = torch.cat([torch.zeros(1, dtype=torch.long), (p.k_row + p.k_len)[:-1]])
    gap = p.k_row - k_prev_end
    if bool((gap < 0).any()):
        raise AssertionError("pieces of one call must read keys in increasing, disjoint ranges")
    # Sequences: (filler: no queries, `gap` keys), (piece) for every piece; empty fillers dropped.
    q_lens = torch.stack([torch.zeros_like(gap), p.q_len], 1).flatten()
    k_lens = torch.stack([gap, p.k_len], 1).flatten()
    used = (q_lens > 0) | (k_lens > 0)
    zero = torch.zeros(1, dtype=torch.long)
    cu_q = torch.cat([zero, torch.cumsum(q_lens[used], 0)]).to(torch.int32)
    cu_k = torch.cat([zero, torch.cumsum(k_lens[used], 0)]).to(torch.int32)
    unread = _unread_keys(p, num_keys)
    pieces = Pieces(
        q_row=_exclusive_cumsum(p.q_len), q_len=p.q_len, k_row=p.k_row, k_len=p.k_len, window_left=p.window_left
    )
    q_rows = _query_rows(p)
    return VarlenCall(
        causal=causal,
        window_left=window_left,
        q_rows=q_rows if isinstance(q_rows, slice) else q_rows.to(device, non_blocking=True),
        num_q=int(p.q_len.sum()),
        cu_q=cu_q.to(device),
        cu_k=cu_k.to(device),
        max_q=int(p.q_len.max()),
        max_k=int(p.k_len.max()),
        unread_keys=unread.to(device) if unread.numel() else None,
        num_keys=num_keys,
        pieces=pieces,
    )


def make_calls(p: Pieces, *, causal: bool, num_keys: int, device: torch.device) -> list[VarlenCall]:
    """One call per distinct window (a kernel call takes one window); none when there are no pieces."""
    calls = []
    for left in torch.unique(p.window_left).tolist():
        calls.append(
            make_call(
                p.select(p.window_left == left), causal=causal, window_left=left, num_keys=num_keys, device=device
            )
        )
    return calls


# ------------------------------------------------------------------------------------------------
# Once per batch
# ------------------------------------------------------------------------------------------------

_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Plans of live batches, keyed by the batch's host segment tensor: they go when the batch goes."""


def cached_plan(segments_host: torch.Tensor, key: tuple, build: Callable[[Documents], object]):
    """``build(documents)`` for this batch and ``key``, computed once for all layers and the backward."""
    per_batch = _PLANS.get(segments_host)
    if per_batch is None:
        per_batch = _PLANS[segments_host] = {"documents": find_documents(segments_host)}
    if key not in per_batch:
        per_batch[key] = build(per_batch["documents"])
    return per_batch[key]
