"""LoRA on every layout trains exactly like one process, and its adapter is a valid PEFT adapter.

Only adapters (and modules_to_save) train; the base weights must come out bit-for-bit unchanged.
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.scenarios import (
    assert_parity,
    make_batches,
    make_model,
    train_parallel,
    train_reference,
    train_reference_peft,
    world_size,
)

from ndparallel.adapters.lora import LoraSpec
from ndparallel.testing.ranks import run_ranks

STEPS = 5
SPEC_QV = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], seed=3)
SPEC_ALL = LoraSpec(r=4, alpha=16, target_linear=True, modules_to_save=["lm_head"], seed=3)


@functools.lru_cache(maxsize=None)
def _batches(data: str):
    return make_batches(steps=STEPS, micro=1, rows=4, seq=64, pad=data == "pad", packed=data == "packed", seed=11)


@functools.lru_cache(maxsize=None)
def _reference(family: str, data: str, spec_name: str):
    spec = {"qv": SPEC_QV, "all": SPEC_ALL}[spec_name]
    return train_reference(make_model(family), _batches(data), lora=spec)


def L(r, s, c, t, method="allgather"):
    return dict(dp_replicate_size=r, dp_shard_size=s, cp_size=c, tp_size=t, cp_comm_strategy=method)


CASES = [
    pytest.param(L(1, 2, 2, 2, "ring"), "llama", "packed", "qv", id="fsdp2-cp2-tp2-ring"),
    pytest.param(L(2, 1, 1, 2), "qwen3", "pad", "all", id="ddp2-tp2-all-linear"),
    pytest.param(L(2, 2, 2, 1, "alltoall"), "mistral", "packed", "qv", id="hsdp2x2-cp2-alltoall"),
    pytest.param(L(1, 4, 1, 1), "llama", "pad", "all", id="fsdp4-all-linear"),
    pytest.param(L(1, 1, 1, 2), "llama", "pad", "qv", id="tp2"),
]


@pytest.mark.parametrize("layout, family, data, spec_name", CASES)
def test_lora_layout_matches_one_process(layout, family, data, spec_name, parity_record):
    spec = {"qv": SPEC_QV, "all": SPEC_ALL}[spec_name]
    ref = _reference(family, data, spec_name)
    got = run_ranks(world_size(layout), train_parallel, family, layout, _batches(data), lora=spec)[0]
    parity_record(assert_parity(ref, got))
    base = make_model(family).state_dict()
    trained_modules = tuple(f"{m}." for m in spec.modules_to_save)
    for name, value in got["weights"].items():
        if "lora_" in name or any(t in name for t in trained_modules):
            continue
        assert torch.equal(value, base[name]), f"frozen weight {name} changed"


@pytest.mark.parametrize("family, data, spec_name", [("llama", "packed", "qv"), ("qwen3", "pad", "all")])
def test_attach_lora_reference_matches_peft(family, data, spec_name, parity_record):
    """The one-process LoRA reference above adds adapters with ndparallel's attach_lora; the same run with
    peft's adapters (plain transformers + torch + peft) gives the same losses, norms and weights, so every
    layout compared with it is compared with peft too."""
    spec = {"qv": SPEC_QV, "all": SPEC_ALL}[spec_name]
    peft = train_reference_peft(make_model(family), _batches(data), spec)
    parity_record(assert_parity(peft, _reference(family, data, spec_name)))
