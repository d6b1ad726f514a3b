"""The order in which rows are trained: deterministic, split over data-parallel ranks, resumable.

Each epoch is a permutation of the rows seeded with (seed, epoch). It is cut into global batches of
``rows_per_rank * batch_ranks`` rows, and batch rank b takes the contiguous slice [b*r, (b+1)*r) of each,
the slice ``prepare_batch`` would give it from the whole global batch. The last, incomplete global batch
of an epoch is dropped (those rows come at other places in other epochs' permutations), so every rank
makes the same number of steps and no row is seen twice in an epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ndparallel.errors import DataError


class DataOrder:
    """Index lists of this rank's rows, batch by batch; ``state_dict`` resumes at exactly the next batch.

    Iterating goes on epoch after epoch without end, so a step budget ends training
    (``next(batches)`` in a loop over steps); ``rest_of_epoch()`` stops at the epoch's end instead. The
    state counts the batches handed out: a loader that fetches ahead must take its state from the batches
    actually trained.
    """

    def __init__(
        self,
        num_rows: int,
        *,
        rows_per_rank: int,
        batch_rank: int,
        batch_ranks: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if rows_per_rank < 1:
            raise DataError(f"micro_batch_size={rows_per_rank} must be >= 1; fix micro_batch_size")
        if not 0 <= batch_rank < batch_ranks:
            raise DataError(f"batch rank {batch_rank} is not one of the {batch_ranks} data-parallel ranks")
        self.num_rows = num_rows
        self.rows_per_rank = rows_per_rank
        self.batch_rank = batch_rank
        self.batch_ranks = batch_ranks
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch_rows = rows_per_rank * batch_ranks
        self.batches_per_epoch = num_rows // self.global_batch_rows
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the dataset has {num_rows} rows, fewer than one global batch of micro_batch_size={rows_per_rank} "
                f"x {batch_ranks} data-parallel ranks = {self.global_batch_rows} rows; add data, lower "
                f"micro_batch_size or use fewer data-parallel ranks"
            )
        self.epoch = 0
        self.batches_done_in_epoch = 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All row indices of ``epoch`` in training order (the same on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self.rest_of_epoch()

    def rest_of_epoch(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch; afterwards the position is the next epoch's start."""
        if self.batches_done_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batches_done_in_epoch = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        while self.batches_done_in_epoch < self.batches_per_epoch:
            start = self.batches_done_in_epoch * self.global_batch_rows + self.batch_rank * self.rows_per_rank
            # Count the batch before handing it out: a checkpoint taken while it trains must resume after it.
            self.batches_done_in_epoch += 1
            yield order[start : start + self.rows_per_rank].tolist()

    def state_dict(self) -> dict[str, Any]:
        """Where the order stands; ``num_rows`` guards against resuming on other data.

        The permutation of an epoch does not depend on the batch shape, so a caller may resume with another
        ``rows_per_rank * batch_ranks`` by rescaling ``batches_done_in_epoch`` to the same number of rows.
        """
        return {
            "epoch": self.epoch,
            "batches_done_in_epoch": self.batches_done_in_epoch,
            "seed": self.seed,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batch is the one after the last batch handed out before it was taken."""
        for key, mine in (("seed", self.seed), ("num_rows", self.num_rows)):
            if key in state and state[key] != mine:
                raise DataError(
                    f"the checkpoint's data order has {key}={state[key]}, this run {mine}; resume with the same "
                    f"seed and data, or start the data order afresh"
                )
        self.epoch = int(state["epoch"])
        self.batches_done_in_epoch = int(state["batches_done_in_epoch"])
