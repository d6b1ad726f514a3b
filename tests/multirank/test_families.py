"""Every dense decoder family trains like one plain transformers process, on every axis.

Per family: a tiny random-init config from transformers (``family_configs.py``: 2 layers, hidden 64, each
family feature switched on), fp32, 5 AdamW steps on packed rows (documents of random lengths, position
ids restarting at 0, boundaries inside CP chunks), compared with ``train_reference``: one plain process in
which transformers builds every layer's document mask itself (sliding or full) from the position ids.
Criteria as in ``test_parity.py``: per-step loss and gradient norm, and every final weight, within 1e-5.

The optimizer's eps is 1e-4 here (1e-5 elsewhere): these families start some tensors at zero (Gemma's
(1 + w) norm weights, GLM's biases), which move only ~lr per step, so their relative difference is made
of AdamW's amplification of float32 rounding where a gradient is ~eps (measured on Gemma 2, tp 2:
1.5e-5 with eps 1e-5, 2.4e-6 with 1e-4). A real fault moves whole tensors by far more.

Layouts: each run covers several axes at once instead of every product (CI time). The main run of a
family is 3-D on 8 ranks, (dp_replicate 2, cp 2, tp 2): replicas (HSDP), FSDP sharding over the cp ranks,
context parallelism (the three methods rotate over the families) and tensor parallelism with sequence
parallelism. Families that cannot take cp (Gemma 2's soft-capped attention, Falcon's own SDPA call) run
(dp_replicate 2, dp_shard 2, tp 2) instead, and ``test_family_refuses_cp`` checks their one-line refusal.
"""

from __future__ import annotations

import functools

import pytest
import torch

from harness import run_ranks
from scenarios import assert_parity, make_batches, make_model, train_parallel, train_reference, world_size

STEPS = 5
EPS = 1e-4


def L(r, s, c, t, method="allgather"):
    return dict(dp_replicate_size=r, dp_shard_size=s, cp_size=c, tp_size=t, cp_comm_strategy=method)


@functools.lru_cache(maxsize=None)
def _batches(vocab: int = 256):
    batches = make_batches(steps=STEPS, micro=1, rows=4, seq=32, packed=True, seed=11)
    if vocab != 256:  # token ids over the whole vocabulary, the last id included (the last tp rank's slice)
        g = torch.Generator().manual_seed(12)
        for step in batches:
            for mb in step:
                mb["input_ids"] = torch.randint(1, vocab, mb["input_ids"].shape, generator=g)
                mb["input_ids"][0, :3] = vocab - 1
    return batches


@functools.lru_cache(maxsize=None)
def _reference(family: str, model_items: tuple):
    kwargs = dict(model_items)
    return train_reference(make_model(family, **kwargs), _batches(kwargs.get("vocab_size", 256)),
                           transformers_masks=True, eps=EPS)


CASES = [
    pytest.param("gemma2", L(2, 2, 1, 2), {}, id="gemma2-hsdp2x2-tp2"),
    pytest.param("gemma3", L(2, 1, 2, 2, "ring"), {}, id="gemma3-hsdp2-cp2ring-tp2"),
    pytest.param("phi3", L(2, 1, 2, 2, "alltoall"), {}, id="phi3-hsdp2-cp2alltoall-tp2"),
    pytest.param("granite", L(2, 1, 2, 2, "allgather"), {}, id="granite-hsdp2-cp2allgather-tp2"),
    pytest.param("olmo2", L(2, 1, 2, 2, "ring"), {}, id="olmo2-hsdp2-cp2ring-tp2"),
    pytest.param("cohere", L(2, 1, 2, 2, "alltoall"), {}, id="cohere-hsdp2-cp2alltoall-tp2"),
    pytest.param("glm", L(2, 1, 2, 2, "allgather"), {}, id="glm-hsdp2-cp2allgather-tp2"),
    pytest.param("glm4", L(2, 1, 2, 2, "ring"), {}, id="glm4-hsdp2-cp2ring-tp2"),
    pytest.param("falcon", L(2, 2, 1, 2), {}, id="falcon-hsdp2x2-tp2"),
    pytest.param("qwen2", L(2, 1, 2, 2, "alltoall"), {}, id="qwen2-hsdp2-cp2alltoall-tp2"),
    # A vocabulary tp does not divide: rows split 24,578 / 24,577 (torch.chunk), tied and untied.
    pytest.param("llama", L(1, 2, 1, 2), {"vocab_size": 49155}, id="llama-vocab49155-fsdp2-tp2"),
]


@pytest.mark.parametrize("family, layout, model_kwargs", CASES)
def test_family_matches_one_process(family, layout, model_kwargs, parity_record):
    ref = _reference(family, tuple(sorted(model_kwargs.items())))
    batches = _batches(model_kwargs.get("vocab_size", 256))
    results = run_ranks(world_size(layout), train_parallel, family, layout, batches, model_kwargs=model_kwargs,
                        eps=EPS)
    parity_record(assert_parity(ref, results[0]))
