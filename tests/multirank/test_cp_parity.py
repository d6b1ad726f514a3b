"""Context parallelism trains exactly like one process, alone and composed with FSDP, HSDP and TP.

Rows are packed (several documents per row, boundaries anywhere, including inside CP chunks) or
right-padded to uneven lengths, or both; every CP method appears on several layouts. Same criteria as
``test_parity.py``: 5 AdamW steps in fp32, loss / grad norm / weights within 1e-5 relative.
"""

from __future__ import annotations

import functools

import pytest
from support.scenarios import assert_parity, make_batches, make_model, train_parallel, train_reference, world_size

from ndparallel.testing.ranks import run_ranks

STEPS = 5


@functools.lru_cache(maxsize=None)
def _batches(data: str, accum: int):
    return make_batches(
        steps=STEPS,
        micro=accum,
        rows=4,
        seq=64,
        pad=data in ("pad", "mixed"),
        packed=data in ("packed", "mixed"),
        seed=7,
    )


@functools.lru_cache(maxsize=None)
def _reference(family: str, data: str, accum: int, model_items: tuple):
    return train_reference(make_model(family, **dict(model_items)), _batches(data, accum))


def L(r, s, c, t, method):
    return dict(dp_replicate_size=r, dp_shard_size=s, cp_size=c, tp_size=t, cp_comm_strategy=method)


CASES = [
    # (dp_replicate, dp_shard, cp, tp): CP alone, without FSDP over data (fsdp = cp only)
    pytest.param(L(1, 1, 2, 1, "allgather"), "llama", "packed", 1, {}, id="cp2-allgather-llama-packed"),
    pytest.param(L(1, 1, 2, 1, "ring"), "qwen3", "pad", 1, {}, id="cp2-ring-qwen3-pad"),
    pytest.param(L(1, 1, 2, 1, "alltoall"), "mistral", "mixed", 1, {}, id="cp2-alltoall-mistral-mixed"),
    pytest.param(L(1, 1, 4, 1, "ring"), "mistral", "packed", 1, {}, id="cp4-ring-mistral-packed"),
    pytest.param(L(1, 1, 4, 1, "alltoall"), "llama", "pad", 1, {}, id="cp4-alltoall-llama-pad"),
    pytest.param(L(1, 1, 4, 1, "allgather"), "qwen3", "mixed", 2, {}, id="cp4-allgather-qwen3-mixed-accum"),
    pytest.param(L(1, 1, 8, 1, "alltoall"), "qwen3", "packed", 1, {}, id="cp8-alltoall-qwen3-packed"),
    pytest.param(L(1, 1, 8, 1, "ring"), "llama", "pad", 1, {}, id="cp8-ring-llama-pad"),
    # sliding-window attention shorter than the row, under CP
    pytest.param(
        L(1, 1, 8, 1, "allgather"), "mistral", "packed", 1, {"sliding_window": 24}, id="cp8-allgather-mistral-window"
    ),
    # composed with FSDP / HSDP and TP
    pytest.param(L(1, 2, 2, 2, "allgather"), "mistral", "packed", 1, {}, id="fsdp2-cp2-tp2-allgather-mistral"),
    pytest.param(L(1, 2, 2, 2, "ring"), "qwen3", "pad", 1, {}, id="fsdp2-cp2-tp2-ring-qwen3"),
    pytest.param(
        L(2, 1, 2, 2, "alltoall"), "llama", "packed", 1, {"tied": True}, id="ddp2-cp2-tp2-alltoall-llama-tied"
    ),
    pytest.param(L(2, 2, 2, 1, "ring"), "qwen3", "mixed", 2, {}, id="hsdp2x2-cp2-ring-qwen3-accum"),
    pytest.param(L(2, 2, 2, 1, "allgather"), "mistral", "pad", 1, {}, id="hsdp2x2-cp2-allgather-mistral"),
    pytest.param(L(1, 1, 4, 2, "ring"), "llama", "packed", 1, {}, id="cp4-tp2-ring-llama"),
    pytest.param(L(1, 1, 4, 2, "alltoall"), "qwen3", "pad", 1, {}, id="cp4-tp2-alltoall-qwen3"),
    # the other ordered factorizations of 8 ranks with cp > 1, two of them with sliding windows (ring, alltoall)
    pytest.param(
        L(2, 1, 4, 1, "ring"), "mistral", "packed", 1, {"sliding_window": 24}, id="ddp2-cp4-ring-mistral-window"
    ),
    pytest.param(
        L(1, 2, 4, 1, "alltoall"), "mistral", "mixed", 1, {"sliding_window": 20}, id="fsdp2-cp4-alltoall-mistral-window"
    ),
    pytest.param(L(4, 1, 2, 1, "allgather"), "qwen3", "pad", 1, {}, id="ddp4-cp2-allgather-qwen3"),
    pytest.param(L(1, 4, 2, 1, "ring"), "llama", "packed", 1, {}, id="fsdp4-cp2-ring-llama"),
    pytest.param(L(1, 1, 2, 4, "allgather"), "llama", "mixed", 1, {}, id="cp2-tp4-allgather-llama"),
]


@pytest.mark.parametrize("layout, family, data, accum, model_kwargs", CASES)
def test_cp_layout_matches_one_process(layout, family, data, accum, model_kwargs, parity_record):
    ref = _reference(family, data, accum, tuple(sorted(model_kwargs.items())))
    results = run_ranks(
        world_size(layout), train_parallel, family, layout, _batches(data, accum), model_kwargs=model_kwargs
    )
    parity_record(assert_parity(ref, results[0]))
