"""``Rows``: the training rows, four (N, seq_len) columns, ready for ``prepare_batch``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ndparallel.loss.cross_entropy import IGNORE_INDEX

COLUMNS = ("input_ids", "labels", "position_ids", "attention_mask")


@dataclass(frozen=True, eq=False)  # == on arrays is elementwise: compare columns explicitly
class Rows:
    """Rows of exactly ``seq_len`` tokens, stored compactly (int32; the arrays may be memory-mapped).

    ``labels`` are unshifted with -100 where no loss is taken, ``attention_mask`` is 1 on real tokens,
    ``position_ids`` restart at 0 where a packed document starts. Indexing gives int64 tensors named as
    ``prepare_batch``'s arguments.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray

    def __post_init__(self) -> None:
        shapes = {name: getattr(self, name).shape for name in COLUMNS}
        if len(set(shapes.values())) != 1 or len(self.input_ids.shape) != 2:
            raise ValueError(f"Rows columns must share one (rows, seq_len) shape, got {shapes}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __repr__(self) -> str:
        return f"Rows({len(self)} x {self.seq_len} tokens, {100 * self.efficiency:.1f}% real)"

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_real_tokens(self) -> int:
        """Tokens that are not padding."""
        return int(self.attention_mask.sum(dtype=np.int64))

    @property
    def efficiency(self) -> float:
        """Real tokens / all tokens (1.0 for no rows)."""
        total = self.input_ids.size
        return self.num_real_tokens / total if total else 1.0

    @property
    def num_target_tokens(self) -> int:
        """Tokens with a label (before ``prepare_batch`` shifts labels and masks document ends)."""
        return int((self.labels != IGNORE_INDEX).sum(dtype=np.int64))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One row: four (seq_len,) int64 tensors."""
        return {name: torch.from_numpy(np.asarray(getattr(self, name)[index], dtype=np.int64)) for name in COLUMNS}

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows at ``indices``: four (len(indices), seq_len) int64 tensors, e.g. ``prepare_batch(**...)``."""
        where = np.asarray(indices, dtype=np.int64)
        return {name: torch.from_numpy(getattr(self, name)[where].astype(np.int64)) for name in COLUMNS}

    @classmethod
    def empty(cls, seq_len: int) -> Rows:
        return cls(*(np.zeros((0, seq_len), dtype=np.int32) for _ in COLUMNS))
