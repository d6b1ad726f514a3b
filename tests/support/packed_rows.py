"""Rows packed with documents of random lengths, as segment ids: the attention plan's and the varlen split's
tests draw them the same way."""

from __future__ import annotations

import torch

from ndparallel.parallel.sequence import segment_ids_from


def random_segments(
    seed: int, *, batch: int, seq: int, lengths: tuple[int, int], whole_first_row: bool = False, padded_tail: int = 0
) -> torch.Tensor:
    """``batch`` rows of ``seq`` tokens, each packed with documents of lengths drawn from [lengths[0], lengths[1])
    (the last one cut at the row's end); ``whole_first_row``: row 0 is one document; ``padded_tail``: the last
    row's final tokens are padding."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.empty(batch, seq, dtype=torch.long)
    for row in range(batch):
        start = 0
        while start < seq:
            n = seq if whole_first_row and row == 0 else int(torch.randint(*lengths, (1,), generator=g))
            pos[row, start : start + n] = torch.arange(min(n, seq - start))
            start += n
    padding = torch.zeros(batch, seq, dtype=torch.bool)
    if padded_tail:
        padding[-1, seq - padded_tail :] = True
    return segment_ids_from(pos, padding)
