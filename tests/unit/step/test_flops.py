"""MFU's FLOPs: attention counted as computed (per document, causal, windows, each CP rank's share), checked
against a brute-force count of (query, key) pairs; and a packed long row never above 100% MFU. No processes."""

from types import SimpleNamespace

import pytest
import torch

from ndparallel.mesh.layout import Layout
from ndparallel.parallel.sequence import chunk_ids
from ndparallel.step.batching import prepare_batch
from ndparallel.step.flops import (
    AttentionFlops,
    flops_per_token,
    layer_windows,
    mfu,
    packed_row_pairs,
    visible_pairs,
)
from ndparallel.weights.meta import model_config_for

H200_PEAK = 989e12


def brute_force_pairs(segments: torch.Tensor, window: int | None, cp: int = 1, rank: int = 0) -> int:
    """Every (query, key) pair of the same real document, key at or before the query, inside the window, with
    the query on cp rank ``rank`` (its two load-balanced chunks)."""
    rows, seq = segments.shape
    chunk = seq // (2 * cp)
    mine = {p for c in chunk_ids(rank, cp) for p in range(c * chunk, (c + 1) * chunk)} if cp > 1 else set(range(seq))
    count = 0
    for b in range(rows):
        for q in mine:
            for k in range(q + 1):
                same = segments[b, q] == segments[b, k] != -1
                if same and (window is None or q - k < window):
                    count += 1
    return count


def test_visible_pairs_closed_form_matches_counting():
    for n in range(0, 12):
        for window in (None, 1, 3, 5, 20):
            expect = sum(min(i + 1, window or n + 1) for i in range(n))
            assert visible_pairs(n, window) == expect
            assert int(visible_pairs(torch.tensor([n]), window)[0]) == expect
    assert packed_row_pairs(10, 4) == 2 * visible_pairs(4) + visible_pairs(2)


def packed_segments(rows: int, seq: int, seed: int) -> torch.Tensor:
    """Rows of random-length documents (segment ids from 1), then padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    segments = torch.full((rows, seq), -1, dtype=torch.long)
    for b in range(rows):
        at, doc = 0, 1
        end = seq - int(torch.randint(0, seq // 4, (1,), generator=gen))
        while at < end:
            n = min(int(torch.randint(1, seq // 2, (1,), generator=gen)), end - at)
            segments[b, at : at + n] = doc
            at, doc = at + n, doc + 1
    return segments


def batch_of(segments: torch.Tensor, cp: int, rank: int):
    """The batch prepare_batch makes on cp rank ``rank`` from packed rows (positions restart per document)."""
    position_ids = torch.zeros_like(segments)
    for b in range(segments.shape[0]):
        for p in range(1, segments.shape[1]):
            same = segments[b, p] == segments[b, p - 1]
            position_ids[b, p] = position_ids[b, p - 1] + 1 if same else 0
    topo = SimpleNamespace(layout=Layout(cp=cp), batch_rank=0, cp_rank=rank, device=torch.device("cpu"))
    return prepare_batch(
        segments.clamp(min=0), topo, attention_mask=(segments != -1).long(), position_ids=position_ids, local=True
    )


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_batch_count_equals_brute_force_on_every_cp_rank(cp, window):
    segments = packed_segments(rows=2, seq=36, seed=cp)
    config = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=2, hidden_size=8, head_dim=4, sliding_window=window, layer_types=None
    )
    counter = AttentionFlops(config)
    per_pair = 12 * 2 * 4 * 2  # 12 FLOPs per query dimension, 2 layers
    shares = []
    for rank in range(cp):
        batch = batch_of(segments, cp, rank)
        padded = batch.segments_host  # rows padded to a multiple of 2 x cp (padding: -1)
        assert counter.of_batch(batch, cp=cp, cp_rank=rank) == per_pair * brute_force_pairs(padded, window, cp, rank)
        shares.append(counter.of_batch(batch, cp=cp, cp_rank=rank))
    assert sum(shares) == per_pair * brute_force_pairs(segments, window)  # the ranks' shares add up to the row's


def test_whole_rows_and_per_layer_windows():
    config = SimpleNamespace(
        num_hidden_layers=3,
        num_attention_heads=2,
        hidden_size=8,
        head_dim=None,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    assert layer_windows(config) == (4, None, 4)
    counter = AttentionFlops(config)
    row = 12 * 8 * (2 * visible_pairs(10, 4) + visible_pairs(10))
    assert counter.of_row(10) == row
    whole = SimpleNamespace(segments_host=None, input_ids=torch.zeros(3, 10, dtype=torch.long))  # cp 1, no plan
    assert counter.of_batch(whole) == 3 * row


@pytest.mark.parametrize("seq_len", [16384, 32768, 65536, 131072, 196608])
def test_packed_long_rows_never_show_mfu_above_100_percent(seq_len):
    """1B on one H200, rows packed with 4,096-token documents, at the speed measured for them (95% of the
    59.8k tokens/s of 4,096-token rows, README). The count of one causal document per row gave 130% and more."""
    config = model_config_for(base_model=None, model_shape="1b", overrides={}, max_position_embeddings=seq_len)
    segments = torch.arange(seq_len).div(4096, rounding_mode="floor")[None] + 1
    batch = SimpleNamespace(segments_host=segments, input_ids=segments)
    attention = AttentionFlops(config).of_batch(batch)
    seconds = seq_len / (0.95 * 59802)
    dense = flops_per_token(config)
    measured = mfu(flops=seq_len * dense + attention, seconds=seconds, peak=H200_PEAK)
    assert 0.40 < measured < 0.60
    whole_row = 12 * config.num_hidden_layers * config.hidden_size * seq_len  # the old per-token attention term
    old = mfu(flops=seq_len * (dense + whole_row), seconds=seconds, peak=H200_PEAK)
    assert old > measured * (1.5 if seq_len < 32768 else 2)
    if seq_len >= 65536:
        assert old > 1.0


def test_a_frozen_base_counts_no_weight_gradient_gemms():
    """LoRA: forward and input gradients over the base (4 N), all three GEMMs for the adapters (6 each). Before,
    an 8B LoRA step showed 55.5% MFU on the H200 where its model FLOPs were 38.4%."""
    config = SimpleNamespace(
        hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000,
    )  # fmt: skip
    attention = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2  # q, o and k, v (head_dim 16)
    weights = 3 * (attention + 3 * 64 * 160) + 64 * 1000
    assert flops_per_token(config) == 6 * weights
    assert flops_per_token(config, frozen_base=True, adapter_params=500) == 4 * weights + 6 * 500
