"""Mixture-of-experts models train exactly like one plain transformers process on every axis.

5 AdamW steps in fp32, the router's load-balancing loss included (weight 0.1, so a wrongly normalized aux
loss would move losses and gradients by far more than the 1e-5 tolerance). The rows of the table cover
each axis and each family once rather than every product (CI time): FSDP, HSDP, CP, TP of the attention,
expert parallelism borrowing dp_shard, cp and tp ranks, HSDP x EP, and gradient accumulation.
"""

from __future__ import annotations

import functools

import pytest
from support.moe_scenarios import make_moe_model, train_parallel_moe, train_reference_moe
from support.scenarios import assert_parity, make_batches, world_size

from ndparallel.testing.ranks import run_ranks

STEPS = 5


@functools.lru_cache(maxsize=None)
def _batches(data: str, accum: int):
    return make_batches(steps=STEPS, micro=accum, rows=8, seq=32, pad=data == "pad", packed=data == "packed")


@functools.lru_cache(maxsize=None)
def _reference(family: str, data: str, accum: int):
    return train_reference_moe(make_moe_model(family), _batches(data, accum))


L = dict
CASES = [
    # FSDP, and the aux loss of two micro-batches per step (each normalized over its own global rows)
    pytest.param(L(dp_shard_size=2), "qwen3_moe", "packed", 2, id="qwen3moe-fsdp2-accum"),
    # HSDP; padded rows (the aux loss counts real tokens only)
    pytest.param(L(dp_replicate_size=2, dp_shard_size=2), "qwen3_moe", "pad", 1, id="qwen3moe-hsdp2x2-pad"),
    # context parallel: each rank routes its two sequence chunks
    pytest.param(L(dp_shard_size=1, cp_size=2), "mixtral", "packed", 1, id="mixtral-cp2"),
    # TP of the attention; the MoE block (with its gated shared expert) runs on each tp rank's tokens
    pytest.param(L(dp_shard_size=2, tp_size=2), "qwen2_moe", "packed", 1, id="qwen2moe-fsdp2-tp2"),
    # gpt-oss: attention sinks split over tp, alternating sliding windows, expert biases
    pytest.param(L(dp_shard_size=2, tp_size=2), "gpt_oss", "packed", 1, id="gptoss-fsdp2-tp2"),
    # expert parallel over dp_shard, with accumulation
    pytest.param(L(dp_shard_size=2, expert_parallel_size=2), "qwen3_moe", "pad", 2, id="qwen3moe-ep2-accum"),
    # expert parallel over cp; DeepSeek-V3 latent attention, dense first layer, shared experts
    pytest.param(
        L(dp_shard_size=1, cp_size=2, expert_parallel_size=2), "deepseek_v3", "packed", 1, id="deepseekv3-cp2-ep2"
    ),
    # expert parallel over dp_shard x tp (4 ranks, 2 experts each)
    pytest.param(
        L(dp_shard_size=2, tp_size=2, expert_parallel_size=4), "qwen3_moe", "packed", 1, id="qwen3moe-fsdp2-tp2-ep4"
    ),
    # HSDP x EP: expert weights on a (replicate, expert-dp, ep) mesh
    pytest.param(
        L(dp_replicate_size=2, dp_shard_size=2, expert_parallel_size=2), "mixtral", "pad", 1, id="mixtral-hsdp2x2-ep2"
    ),
    # expert parallel with expert biases and the clamped SwiGLU; sinks and alternating windows under ring CP
    pytest.param(
        L(dp_shard_size=1, cp_size=2, expert_parallel_size=2, cp_comm_strategy="ring"),
        "gpt_oss",
        "packed",
        1,
        id="gptoss-cp2-ring-ep2",
    ),
]


@pytest.mark.parametrize("layout, family, data, accum", CASES)
def test_moe_layout_matches_one_process(layout, family, data, accum, parity_record):
    ref = _reference(family, data, accum)
    results = run_ranks(world_size(layout), train_parallel_moe, family, layout, _batches(data, accum))
    parity_record(assert_parity(ref, results[0]))
    for other in results[1:]:
        assert other["losses"] == results[0]["losses"]
        assert other["grad_norms"] == results[0]["grad_norms"]
