"""Examples -> rows: first-fit packing, document boundaries, long documents, padding; padded rows; Rows."""

import numpy as np
import pytest
import torch

from ndparallel import DataError, shift_labels
from ndparallel.data.examples import Example, ExampleStore
from ndparallel.data.packing import pack_examples, pad_examples
from ndparallel.data.rows import Rows

PAD = 999
IGNORE = -100


def doc(index, length, prompt=0):
    """Document ``index``: token j is index*1000 + j, so every token tells where it came from."""
    ids = [index * 1000 + j for j in range(length)]
    return Example(ids, [IGNORE] * prompt + ids[prompt:])


def documents_in(rows):
    """The pieces of each row, split where position_ids restart, as (ids, labels, positions) lists."""
    pieces = []
    for r in range(len(rows)):
        real = rows.attention_mask[r] == 1
        starts = np.flatnonzero((rows.position_ids[r] == 0) & real)
        ends = list(starts[1:]) + [int(real.sum())]
        for s, e in zip(starts, ends):
            pieces.append(
                (rows.input_ids[r, s:e].tolist(), rows.labels[r, s:e].tolist(), rows.position_ids[r, s:e].tolist())
            )
    return pieces


def one_row(rows, r):
    return Rows(
        rows.input_ids[r : r + 1], rows.labels[r : r + 1], rows.position_ids[r : r + 1], rows.attention_mask[r : r + 1]
    )


def docs_per_row(rows):
    """Which documents each row holds, in row order (from their first token)."""
    return [[ids[0] // 1000 for ids, _, _ in documents_in(one_row(rows, r))] for r in range(len(rows))]


def test_packing_keeps_every_document_intact_with_positions_restarting_at_each_start():
    lengths = [5, 3, 7, 2, 8, 1, 4, 6, 3]
    examples = [doc(i, n, prompt=n // 2) for i, n in enumerate(lengths)]
    rows = pack_examples(examples, seq_len=8, pad_id=PAD)
    assert rows.input_ids.shape == (len(rows), 8)
    pieces = documents_in(rows)
    assert len(pieces) == len(examples)  # none longer than seq_len: nothing split, nothing merged
    for ids, labels, positions in pieces:
        original = examples[ids[0] // 1000]
        assert ids == list(original.input_ids) and labels == list(original.labels)
        assert positions == list(range(len(ids)))
    # first-fit keeps document order inside each row
    assert all(row == sorted(row) for row in docs_per_row(rows))
    assert rows.num_real_tokens == sum(lengths)
    assert rows.efficiency == pytest.approx(sum(lengths) / rows.input_ids.size)


def test_first_fit_places_each_document_in_the_first_row_with_room():
    rows = pack_examples([doc(i, n) for i, n in enumerate([3, 3, 1, 2, 4])], seq_len=4, pad_id=PAD)
    assert docs_per_row(rows) == [[0, 2], [1], [3], [4]]


def test_a_long_document_is_cut_into_seq_len_pieces_that_restart_positions():
    rows = pack_examples([doc(0, 10), doc(1, 2)], seq_len=4, pad_id=PAD)
    pieces = documents_in(rows)
    assert [ids for ids, _, _ in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [1000, 1001]]
    assert all(positions == list(range(len(ids))) for ids, _, positions in pieces)
    assert len(rows) == 3 and rows.efficiency == 1.0


def test_row_tails_are_padding_masked_out_of_loss_and_attention():
    rows = pack_examples([doc(0, 5), doc(1, 4)], seq_len=6, pad_id=PAD)
    assert rows.input_ids.tolist() == [[0, 1, 2, 3, 4, PAD], [1000, 1001, 1002, 1003, PAD, PAD]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert rows.labels[1, 4:].tolist() == [IGNORE, IGNORE]
    assert rows.position_ids[1].tolist() == [0, 1, 2, 3, 0, 1]  # padding is a "document" of its own
    assert rows.efficiency == pytest.approx(9 / 12)


def test_packed_rows_feed_shift_labels_without_crossing_documents():
    rows = pack_examples([doc(0, 3), doc(1, 3)], seq_len=6, pad_id=PAD)
    batch = rows.batch([0])
    assert all(t.dtype == torch.int64 for t in batch.values())
    targets = shift_labels(batch["labels"], batch["position_ids"])
    assert targets.tolist() == [[1, 2, IGNORE, 1001, 1002, IGNORE]]


def test_packing_an_example_store_equals_packing_the_list():
    examples = [doc(i, n, prompt=1) for i, n in enumerate([4, 9, 2, 6])]
    from_list = pack_examples(examples, 5, PAD)
    from_store = pack_examples(ExampleStore.from_examples(examples), 5, PAD)
    for column in ("input_ids", "labels", "position_ids", "attention_mask"):
        np.testing.assert_array_equal(getattr(from_list, column), getattr(from_store, column))


def test_pad_examples_one_per_row_with_positions_arange():
    rows = pad_examples([doc(0, 2, prompt=1), Example([], []), doc(1, 4)], seq_len=4, pad_id=PAD)
    assert rows.input_ids.tolist() == [[0, 1, PAD, PAD], [1000, 1001, 1002, 1003]]  # the empty example is skipped
    assert rows.labels.tolist() == [[IGNORE, 1, IGNORE, IGNORE], [1000, 1001, 1002, 1003]]
    assert rows.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    with pytest.raises(DataError, match="an example of 4 tokens does not fit sequence_len=3; .*long_rows"):
        pad_examples([doc(0, 4)], seq_len=3, pad_id=PAD)


def test_bad_seq_len_is_refused():
    with pytest.raises(DataError, match="sequence_len=0 must be a whole number >= 1"):
        pack_examples([doc(0, 1)], 0, PAD)


def test_rows_items_are_int64_tensors():
    rows = pad_examples([doc(0, 2), doc(1, 3)], seq_len=3, pad_id=PAD)
    item = rows[1]
    assert item["input_ids"].tolist() == [1000, 1001, 1002] and item["input_ids"].dtype == torch.int64
    assert set(item) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert rows.batch([1, 0])["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_example_store_round_trips_examples():
    store = ExampleStore.from_examples([doc(0, 3, prompt=2), doc(1, 1)])
    first = store[0]
    store.append(doc(2, 2))  # growing after handing out an example is allowed
    assert (list(first.input_ids), list(first.labels)) == ([0, 1, 2], [IGNORE, IGNORE, 2])
    assert list(store.lengths) == [3, 1, 2] and store.num_tokens == 6
    assert [list(e.input_ids) for e in store.subset([2, 0])] == [[2000, 2001], [0, 1, 2]]
    with pytest.raises(ValueError, match="differ in length"):
        store.append(Example([1, 2], [1]))
