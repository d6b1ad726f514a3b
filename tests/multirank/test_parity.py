"""Every layout trains exactly like one process: 5 AdamW steps in fp32 on the same global batches.

Compared per step: the loss and the gradient norm (relative difference <= 1e-5); at the end: every
weight, gathered (relative Frobenius difference per tensor <= 1e-5). The weight criterion is a norm,
not an element maximum, and the optimizer's eps is 1e-6 (scenarios.EPS), on purpose: AdamW divides by
sqrt(v), so an element whose gradient is ~0 turns float32 rounding noise (~1e-7 relative, different
summation orders) into a visible update difference; a real bug (a missing shard, a wrong scale) moves
whole tensors by far more.
"""

from __future__ import annotations

import functools

import pytest
from support.scenarios import (
    assert_parity,
    make_batches,
    make_model,
    max_rel_diff,
    train_parallel,
    train_reference,
    world_size,
)

from ndparallel.testing.ranks import run_ranks

STEPS = 5


@functools.lru_cache(maxsize=None)
def _batches(data: str, accum: int):
    return make_batches(steps=STEPS, micro=accum, rows=8, seq=32, pad=data == "pad", packed=data == "packed")


@functools.lru_cache(maxsize=None)
def _reference(family: str, tied: bool, data: str, accum: int):
    return train_reference(make_model(family, tied=tied), _batches(data, accum))


L = dict  # a layout row, for readability below
CASES = [
    # --- world 8: every ordered factorization over (dp_replicate, dp_shard, tp) -------------------------
    pytest.param(L(dp_replicate_size=1, dp_shard_size=8, tp_size=1), "llama", False, "pad", 1, {}, id="fsdp8"),
    pytest.param(L(dp_replicate_size=8, dp_shard_size=1, tp_size=1), "llama", True, "pad", 1, {}, id="ddp8-tied"),
    pytest.param(L(dp_replicate_size=1, dp_shard_size=1, tp_size=8), "llama", False, "pad", 1, {}, id="tp8"),
    pytest.param(L(dp_replicate_size=2, dp_shard_size=4, tp_size=1), "qwen3", False, "pad", 2, {}, id="hsdp2x4-accum"),
    pytest.param(L(dp_replicate_size=4, dp_shard_size=2, tp_size=1), "mistral", True, "pad", 1, {}, id="hsdp4x2-tied"),
    pytest.param(L(dp_replicate_size=1, dp_shard_size=2, tp_size=4), "qwen3", False, "pad", 1, {}, id="fsdp2-tp4"),
    pytest.param(
        L(dp_replicate_size=1, dp_shard_size=4, tp_size=2), "mistral", False, "pad", 2, {}, id="fsdp4-tp2-accum"
    ),
    # TP with plain replicas (no sharding): Accelerate refuses this layout.
    pytest.param(L(dp_replicate_size=2, dp_shard_size=1, tp_size=4), "qwen3", True, "pad", 1, {}, id="ddp2-tp4-tied"),
    pytest.param(
        L(dp_replicate_size=4, dp_shard_size=1, tp_size=2), "llama", True, "pad", 2, {}, id="ddp4-tp2-tied-accum"
    ),
    pytest.param(
        L(dp_replicate_size=2, dp_shard_size=2, tp_size=2), "qwen2", False, "pad", 2, {}, id="hsdp2x2-tp2-accum"
    ),
    # --- world 4 and 2, with the FSDP and checkpointing knobs --------------------------------------------
    pytest.param(L(dp_shard_size=4), "qwen2", True, "pad", 1, {"fsdp_wrap": "model"}, id="fsdp4-onewrap-tied"),
    pytest.param(
        L(dp_replicate_size=2, dp_shard_size=2),
        "llama",
        False,
        "pad",
        1,
        {"activation_checkpointing": "full"},
        id="hsdp2x2-fullac",
    ),
    pytest.param(
        L(dp_shard_size=2, tp_size=2),
        "qwen3",
        False,
        "pad",
        2,
        {"activation_checkpointing": "selective", "fsdp_wrap": 2},
        id="fsdp2-tp2-selac-accum",
    ),
    pytest.param(
        L(dp_replicate_size=2, tp_size=2, dp_shard_size=1),
        "mistral",
        False,
        "pad",
        1,
        {"reshard_after_forward": False},
        id="ddp2-tp2-noreshard",
    ),
    pytest.param(L(tp_size=4, dp_shard_size=1), "llama", False, "pad", 1, {}, id="tp4"),
    pytest.param(L(dp_shard_size=4), "llama", False, "pad", 1, {"reshard_after_forward": 2}, id="fsdp4-reshard2"),
    pytest.param(L(dp_shard_size=2), "llama", True, "pad", 2, {}, id="fsdp2-tied-accum"),
    pytest.param(
        L(dp_shard_size=2, tp_size=2), "qwen3", False, "pad", 1, {"cpu_offload": True}, id="fsdp2-tp2-offload"
    ),
    pytest.param(L(dp_replicate_size=2, dp_shard_size=1), "qwen3", False, "pad", 1, {}, id="ddp2"),
    pytest.param(L(tp_size=2, dp_shard_size=1), "mistral", True, "pad", 1, {}, id="tp2-tied"),
    pytest.param(L(dp_shard_size=1), "llama", False, "pad", 2, {"activation_checkpointing": "full"}, id="single-accum"),
    # packed documents without CP: the attention masks come from ndparallel's batch, not transformers'.
    pytest.param(L(dp_shard_size=2, tp_size=2), "llama", False, "packed", 1, {}, id="fsdp2-tp2-packed"),
]


@pytest.mark.parametrize("layout, family, tied, data, accum, options", CASES)
def test_layout_matches_one_process(layout, family, tied, data, accum, options, parity_record):
    ref = _reference(family, tied, data, accum)
    results = run_ranks(
        world_size(layout),
        train_parallel,
        family,
        layout,
        _batches(data, accum),
        model_kwargs={"tied": tied},
        options=options,
    )
    parity_record(assert_parity(ref, results[0]))
    # Every rank reports the same loss and grad norm (they are reduced, not local).
    for other in results[1:]:
        assert other["losses"] == results[0]["losses"]
        assert other["grad_norms"] == results[0]["grad_norms"]


# bf16 keeps 8 significant bits: each rounding is off by at most U (relative).
U = 2.0**-8


def bf16_differences(ref: dict, got: dict, initial: dict) -> dict:
    """How far a bf16 run is from the fp32 one: per-step loss and grad norm (relative), and for the weights
    the largest over tensors of |W_bf16 - W_fp32| / |W_fp32 - W_initial| (Frobenius): the error of the
    update relative to the update itself, 1.0 for a run that did not train."""
    update = max(
        float((got["weights"][name].to(r.dtype) - r).norm() / (r - initial[name]).norm().clamp(min=1e-30))
        for name, r in ref["weights"].items()
    )
    return {
        "loss": max_rel_diff(got["losses"], ref["losses"]),
        "grad_norm": max_rel_diff(got["grad_norms"], ref["grad_norms"]),
        "update": update,
    }


def test_bf16_mixed_precision_tracks_fp32(parity_record):
    """bf16 compute with fp32 master weights and fp32 gradient reduction against the fp32 run, bounded by
    bf16's rounding U = 2^-8:

    - loss <= U/16: at random init the logits are ~0.1 and the loss ~log(vocab) = 5.5, so a relative
      rounding U of the logits moves the loss by ~U x 0.1 / 5.5 (measured 6.2e-5, CPU, torch 2.13);
    - grad norm <= 4U: the gradients are sums of products of bf16-rounded activations and weights
      (2U each), whose errors largely cancel in the norm (measured 1.0U);
    - weights: the update error / the update <= 32U (= 0.125): AdamW's update m/sqrt(v) is scale-free, so a
      relative gradient error e moves it by ~e, and elements whose gradients cancel carry e of ~10U
      (measured 0.042, the embedding). A run that does not train scores 1.0, checked below.
    """
    layout = L(dp_shard_size=2, tp_size=2)
    ref = _reference("llama", False, "pad", 1)
    initial = make_model("llama").state_dict()
    got = run_ranks(4, train_parallel, "llama", layout, _batches("pad", 1), options={"param_dtype": "bfloat16"})[0]
    diffs = bf16_differences(ref, got, initial)
    parity_record(diffs)
    assert diffs["loss"] <= U / 16, f"bf16 loss differs from fp32 by {diffs['loss']:.2e}"
    assert diffs["grad_norm"] <= 4 * U, f"bf16 grad norm differs from fp32 by {diffs['grad_norm']:.2e}"
    assert diffs["update"] <= 32 * U, f"bf16 weight update differs from fp32's by {diffs['update']:.2f} of it"
    # The criterion fails a run that did not train (lr 0 or no optimizer step): its weights are the initial ones.
    untrained = bf16_differences(ref, {**got, "weights": initial}, initial)
    assert untrained["update"] > 32 * U
