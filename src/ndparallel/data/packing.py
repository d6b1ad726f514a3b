"""Examples -> rows of exactly ``seq_len`` tokens: packed several documents to a row, or one padded per row.

Packing is first-fit: documents are taken in order and each goes to the first row with room for it, so a
row's documents keep their order and the rows fill in order. A document longer than ``seq_len`` is cut
into ``seq_len`` pieces that are packed like documents (each piece's positions restart at 0, so the last
token of a piece predicts nothing: one target lost per cut, the price of not mixing documents). Row tails are
padding: pad id, label -100, attention_mask 0, and positions 0, 1, ... as if the padding were one more
document, so even without the attention mask it could not be mistaken for part of the last document.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence

import numpy as np

from ndparallel.data.examples import IGNORE_INDEX, Example, example_lengths
from ndparallel.data.rows import Rows
from ndparallel.errors import DataError

logger = logging.getLogger(__name__)


def pack_examples(examples: Sequence[Example], seq_len: int, pad_id: int) -> Rows:
    """First-fit packing of ``examples`` into rows of ``seq_len`` tokens (see the module docstring)."""
    _check_seq_len(seq_len)
    lengths = example_lengths(examples)
    # Two passes over the examples (sizes, then tokens) so that no copy of all documents is held at once.
    sizes = [min(seq_len, length - start) for length in lengths for start in range(0, length, seq_len)]
    placement = _first_fit(sizes, seq_len)
    num_rows = max(placement, default=-1) + 1
    row_of_piece = iter(placement)
    rows = _blank(num_rows, seq_len, pad_id)
    filled = np.zeros(num_rows, dtype=np.int64)
    for example in examples:
        length = len(example.input_ids)
        for start in range(0, length, seq_len):
            end = min(start + seq_len, length)
            row = next(row_of_piece)
            at = int(filled[row])
            _write(rows, row, at, example, start, end)
            filled[row] = at + end - start
    for row, used in enumerate(filled):
        rows.position_ids[row, used:] = np.arange(seq_len - used, dtype=np.int32)
    if len(rows):
        logger.info(
            "packed %d documents into %d rows of %d tokens: %.1f%% real tokens",
            len(examples),
            len(rows),
            seq_len,
            100 * rows.efficiency,
        )
    return rows


def pad_examples(examples: Sequence[Example], seq_len: int, pad_id: int) -> Rows:
    """One example per row, right-padded to ``seq_len``; positions are 0..seq_len-1. Empty examples are skipped."""
    _check_seq_len(seq_len)
    lengths = example_lengths(examples)
    longest = max(lengths, default=0)
    if longest > seq_len:
        raise DataError(
            f"an example of {longest} tokens does not fit sequence_len={seq_len}; raise sequence_len, enable "
            f"sample_packing, or set long_rows: truncate|drop"
        )
    rows = _blank(sum(1 for n in lengths if n > 0), seq_len, pad_id)
    rows.position_ids[:] = np.arange(seq_len, dtype=np.int32)
    row = 0
    for example, length in zip(examples, lengths):
        if length:
            _write(rows, row, 0, example, 0, length)
            row += 1
    return rows


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise DataError(f"sequence_len={seq_len!r} must be a whole number >= 1; fix sequence_len")


def _first_fit(sizes: list[int], capacity: int) -> list[int]:
    """For each size in order, the index of the first row with room for it, in O(log rows) per size.

    A max-tree over the free space of as many rows as there are sizes (never more rows are needed): the
    search descends to the leftmost leaf whose free space is at least the size. Rows not used yet have
    the full capacity, so the search always succeeds.
    """
    leaves = 1
    while leaves < max(len(sizes), 1):
        leaves *= 2
    free = array("l", [capacity]) * (2 * leaves)  # node i has children 2i and 2i+1; leaves at [leaves, 2*leaves)
    placement = []
    for size in sizes:
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= size else 2 * node + 1
        placement.append(node - leaves)
        free[node] -= size
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return placement


def _blank(num_rows: int, seq_len: int, pad_id: int) -> Rows:
    """Rows of padding only."""
    return Rows(
        input_ids=np.full((num_rows, seq_len), pad_id, dtype=np.int32),
        labels=np.full((num_rows, seq_len), IGNORE_INDEX, dtype=np.int32),
        position_ids=np.zeros((num_rows, seq_len), dtype=np.int32),
        attention_mask=np.zeros((num_rows, seq_len), dtype=np.int8),
    )


def _write(rows: Rows, row: int, at: int, example: Example, start: int, end: int) -> None:
    """Tokens [start, end) of ``example`` into ``row`` from column ``at``, positions starting at 0."""
    span = slice(at, at + end - start)
    rows.input_ids[row, span] = np.asarray(example.input_ids[start:end])
    rows.labels[row, span] = np.asarray(example.labels[start:end])
    rows.position_ids[row, span] = np.arange(end - start, dtype=np.int32)
    rows.attention_mask[row, span] = 1
