"""Gradient accumulation: both reduction modes train exactly like one process, and each really reduces
when it says (``every_micro_batch``, the default: reduce-scatter after each micro-batch, sharded gradients
in between; ``last_micro_batch``: nothing until the last micro-batch). The default mode is also the one
every ``-accum`` case of test_parity.py runs."""

from __future__ import annotations

import functools

import pytest
import torch
from support.scenarios import assert_parity, make_batches, make_model, train_parallel, train_reference
from torch.distributed.tensor import DTensor

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks

HSDP = dict(dp_replicate_size=2, dp_shard_size=2)


@functools.lru_cache(maxsize=None)
def _batches():
    return make_batches(steps=3, micro=3, rows=8, seq=32, pad=True)


# AdamW's eps bounds how much float32 summation-order noise it can turn into weight differences (see
# scenarios.EPS). Here, with the default 1e-5, one element of v_proj.bias whose gradient is ~1e-9 moved by
# 3e-7 (1.1e-5 of the tensor's norm, measured on an AVX-512 Xeon; losses agree to 1e-7). With 1e-4 the same
# comparison is 4.4e-6, while a real reduction error (one micro-batch counted twice) moves the loss by 2e-3.
EPS = 1e-4


@pytest.mark.parametrize("mode", ["every_micro_batch", "last_micro_batch"])
def test_hsdp_accumulation_matches_one_process(mode, parity_record):
    ref = train_reference(make_model("qwen2"), _batches(), eps=EPS)
    got = run_ranks(4, train_parallel, "qwen2", HSDP, _batches(), gradient_sync=mode, eps=EPS)[0]
    parity_record(assert_parity(ref, got))


def _grads_after_first_micro_batch(mode: str) -> tuple[int, int]:
    """(parameters with a sharded gradient, parameters) after the first of two micro-batches, FSDP over 4.

    (Under HSDP FSDP keeps the reduce-scattered, sharded sum in a buffer of its own until the all-reduce;
    benchmarks/components/bench_grad_accumulation.py shows that memory.)"""
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=4))
    model = make_model("llama")
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
    batch = ndp.prepare_batch(_batches()[0][0]["input_ids"], topo)
    ndp.set_gradient_sync(model, False, mode=mode)
    logits = model(**batch.model_inputs()).logits
    logits.float().logsumexp(-1).mean().backward()
    params = list(model.parameters())
    sharded = [
        p
        for p in params
        if p.grad is not None and isinstance(p.grad, DTensor) and p.grad.to_local().shape == p.to_local().shape
    ]
    return len(sharded), len(params)


def test_every_micro_batch_reduce_scatters_before_the_last():
    for with_grad, total in run_ranks(4, _grads_after_first_micro_batch, "every_micro_batch"):
        assert with_grad == total
    for with_grad, _ in run_ranks(4, _grads_after_first_micro_batch, "last_micro_batch"):
        assert with_grad == 0  # held unsharded inside FSDP until the last micro-batch


def test_unknown_mode_is_one_clear_error():
    with pytest.raises(
        ndp.ConfigError, match="gradient_sync='sometimes' must be one of every_micro_batch, last_micro_batch"
    ):
        ndp.set_gradient_sync(torch.nn.Linear(2, 2), True, mode="sometimes")
