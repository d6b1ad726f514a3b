"""DataOrder: every row once per epoch over all ranks, deterministic, resumable at exactly the next batch."""

import itertools

import pytest

from ndparallel import DataError
from ndparallel.data.sampler import DataOrder


def orders(num_rows, rows_per_rank, ranks, seed=0, **kwargs):
    return [
        DataOrder(num_rows, rows_per_rank=rows_per_rank, batch_rank=b, batch_ranks=ranks, seed=seed, **kwargs)
        for b in range(ranks)
    ]


@pytest.mark.parametrize("num_rows, rows_per_rank, ranks", [(12, 1, 1), (23, 2, 3), (40, 3, 4), (17, 4, 2), (8, 1, 8)])
def test_each_epoch_covers_whole_global_batches_once_over_all_ranks(num_rows, rows_per_rank, ranks):
    per_rank = orders(num_rows, rows_per_rank, ranks)
    global_rows = rows_per_rank * ranks
    for epoch in range(2):
        epoch_batches = [list(order.rest_of_epoch()) for order in per_rank]
        assert all(
            len(batches) == num_rows // global_rows == per_rank[0].batches_per_epoch for batches in epoch_batches
        )
        seen = [i for step in zip(*epoch_batches) for batch in step for i in batch]
        assert len(seen) == len(set(seen)) == (num_rows // global_rows) * global_rows
        # rank b's rows are slice b of the global batch: the epoch order cut into global batches
        order = per_rank[0].epoch_order(epoch).tolist()
        assert seen == order[: len(seen)]
        assert all(len(batch) == rows_per_rank for batches in epoch_batches for batch in batches)


def test_order_is_deterministic_and_changes_with_epoch_and_seed():
    first = list(itertools.islice(iter(orders(50, 2, 2, seed=7)[1]), 5))
    assert first == list(itertools.islice(iter(orders(50, 2, 2, seed=7)[1]), 5))
    assert first != list(itertools.islice(iter(orders(50, 2, 2, seed=8)[1]), 5))
    order = orders(50, 2, 2, seed=7)[0]
    assert order.epoch_order(0).tolist() != order.epoch_order(1).tolist()
    assert sorted(order.epoch_order(1).tolist()) == list(range(50))


def test_without_shuffle_rows_come_in_order():
    (order,) = orders(7, 3, 1, shuffle=False)
    assert list(order.rest_of_epoch()) == [[0, 1, 2], [3, 4, 5]]  # row 6 does not fill a global batch: dropped


def take(order, count):
    """The next ``count`` batches (iterating goes on over epochs without end)."""
    return list(itertools.islice(iter(order), count))


def test_iteration_runs_on_across_epochs():
    order = orders(10, 2, 2, seed=1)[1]
    batches = take(order, 5)  # 2 global batches of 4 rows per epoch; rank 1 takes rows [2, 4) of each
    positions = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]  # (epoch, batch)
    assert batches == [order.epoch_order(e)[4 * k + 2 : 4 * k + 4].tolist() for e, k in positions]
    assert order.state_dict()["epoch"] == 2 and order.state_dict()["batches_done_in_epoch"] == 1


def test_resume_mid_epoch_gives_the_identical_continuation():
    expected = take(orders(30, 2, 3, seed=3)[2], 12)  # 5 batches per epoch: crosses two epoch ends

    interrupted = orders(30, 2, 3, seed=3)[2]
    taken = take(interrupted, 3)
    state = interrupted.state_dict()
    assert state["epoch"] == 0 and state["batches_done_in_epoch"] == 3 and state["seed"] == 3

    resumed = orders(30, 2, 3, seed=3)[2]
    resumed.load_state_dict(state)
    assert taken + take(resumed, 9) == expected
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["batches_done_in_epoch"] == 2


def test_resume_after_the_last_batch_of_an_epoch_starts_the_next_epoch():
    order = orders(10, 5, 1)[0]
    first_epoch = take(order, 2)  # the generator is left before it rolls over
    assert order.state_dict()["batches_done_in_epoch"] == 2
    resumed = orders(10, 5, 1)[0]
    resumed.load_state_dict(order.state_dict())
    assert list(resumed.rest_of_epoch()) == [order.epoch_order(1)[:5].tolist(), order.epoch_order(1)[5:].tolist()]
    assert first_epoch == [order.epoch_order(0)[:5].tolist(), order.epoch_order(0)[5:].tolist()]


def test_resuming_with_another_seed_or_other_data_is_refused():
    state = orders(30, 2, 3, seed=3)[0].state_dict()
    with pytest.raises(DataError, match="has seed=3, this run 4; resume with the same seed and data"):
        orders(30, 2, 3, seed=4)[0].load_state_dict(state)
    with pytest.raises(DataError, match="has num_rows=30, this run 31"):
        orders(31, 2, 3, seed=3)[0].load_state_dict(state)


def test_another_batch_shape_resumes_at_the_same_row_when_the_position_is_rescaled():
    before = orders(40, 2, 2, seed=5)  # 4 rows per global batch
    for order in before:
        take(order, 3)  # 12 rows of epoch 0 done
    state = before[0].state_dict()
    after = orders(40, 2, 3, seed=5)  # 6 rows per global batch: 12 rows are 2 batches
    for order in after:
        order.load_state_dict({**state, "batches_done_in_epoch": 12 // 6})
    next_global_batch = [i for order in after for i in take(order, 1)[0]]
    assert next_global_batch == before[0].epoch_order(0)[12:18].tolist()


def test_too_small_dataset_names_micro_batch_size_ranks_and_size():
    with pytest.raises(
        DataError,
        match=r"the dataset has 7 rows, fewer than one global batch of micro_batch_size=2 "
        r"x 4 data-parallel ranks = 8 rows",
    ):
        DataOrder(7, rows_per_rank=2, batch_rank=0, batch_ranks=4, seed=0)
