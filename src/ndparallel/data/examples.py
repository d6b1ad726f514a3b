"""Tokenized examples, and a compact store for many of them.

An ``Example`` is one document: ``input_ids`` and ``labels`` of the same length, labels unshifted with
-100 where no loss is taken (``prepare_batch`` shifts them). Python lists of ints cost about 36 bytes a
token, so ``ExampleStore`` keeps all examples in two flat int32 buffers plus end offsets (8 bytes a token)
and hands out small numpy copies.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from ndparallel.step.batching import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "Example", "ExampleStore", "example_lengths"]


class Example(NamedTuple):
    """One document: token ids and their (unshifted) labels, -100 where no loss is taken."""

    input_ids: Sequence[int]
    labels: Sequence[int]


class ExampleStore(Sequence[Example]):
    """Examples in flat int32 buffers; indexing gives an ``Example`` of int32 numpy arrays (copies)."""

    def __init__(self) -> None:
        self._ids = array("i")
        self._labels = array("i")
        self._ends = array("q")

    @classmethod
    def from_examples(cls, examples: Iterable[Example]) -> ExampleStore:
        store = cls()
        for example in examples:
            store.append(example)
        return store

    def append(self, example: Example) -> None:
        if len(example.input_ids) != len(example.labels):
            raise ValueError(
                f"input_ids ({len(example.input_ids)}) and labels ({len(example.labels)}) differ in length"
            )
        self._ids.extend(_as_int32(example.input_ids))
        self._labels.extend(_as_int32(example.labels))
        self._ends.append(len(self._ids))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> Example:  # type: ignore[override]
        if not isinstance(index, int | np.integer):
            raise TypeError(f"ExampleStore takes one integer index (use subset() for several), not {index!r}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        index %= len(self)
        start = self._ends[index - 1] if index else 0
        end = self._ends[index]
        # Slicing an array copies it: a numpy view of the buffers themselves would stop them from growing.
        return Example(_int32_view(self._ids[start:end]), _int32_view(self._labels[start:end]))

    def __iter__(self) -> Iterator[Example]:
        for index in range(len(self)):
            yield self[index]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per example, (len,) int64."""
        return np.diff(np.array(self._ends, dtype=np.int64), prepend=0)

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def subset(self, indices: Iterable[int]) -> ExampleStore:
        """A new store holding the examples at ``indices``, in that order."""
        return ExampleStore.from_examples(self[int(i)] for i in indices)


def example_lengths(examples: Sequence[Example]) -> list[int]:
    """Tokens per example; an ``ExampleStore`` knows them without copying its examples out."""
    if isinstance(examples, ExampleStore):
        return examples.lengths.tolist()
    return [len(example.input_ids) for example in examples]


def _int32_view(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int32)


def _as_int32(values: Sequence[int]) -> array:
    if isinstance(values, np.ndarray):
        return array("i", values.astype(np.int32, copy=False).tobytes())
    return array("i", values)
