"""bf16 weights with no float32 masters (``bf16: full``, ``ParallelOptions.master_dtype``), forward and backward,
on one rank (flat buffers) and on FSDP over two ranks, against plain transformers in bf16 on one process.

A bf16 model's arithmetic rounds every product to bf16, and ndparallel's loss (the fused head, in token chunks)
and attention sum in another order than transformers' logits and SDPA: the comparison is to bf16's resolution
(relative 2e-2 per gradient tensor, measured below 1e-2), not float32's. The update itself (torchao's AdamW8bit,
stochastic rounding) is checked on the GPU (``tests/gpu/gpu_eight_bit_adamw.py``).
"""

from __future__ import annotations

import pytest
import torch
from support.scenarios import make_batches, make_model, reference_mask
from torch.distributed.tensor import DTensor

import ndparallel as ndp
from ndparallel import _compat
from ndparallel.testing.ranks import run_ranks

BATCH = make_batches(steps=1, micro=1, rows=4, seq=32, pad=True)[0][0]


def _reference() -> dict:
    model = make_model("llama", tied=True, dtype=torch.bfloat16)
    logits = model(**reference_mask(BATCH)).logits.float()
    labels = BATCH["input_ids"].clone()
    labels[BATCH["attention_mask"] == 0] = -100
    labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = loss / (labels != -100).sum()
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads}


def _ours(shard: int) -> dict:
    from ndparallel.parallel.single_rank import single_rank_state

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=shard))
    model = make_model("llama", tied=True)  # float32, as the trainer builds it: parallelize stores it in bf16
    options = ndp.ParallelOptions(param_dtype="bfloat16", master_dtype="bfloat16", activation_checkpointing="full")
    ndp.parallelize(model, topo, options=options)
    dtypes = {p.dtype for p in model.parameters()}
    batch = ndp.prepare_batch(topology=topo, **BATCH)
    n = ndp.count_tokens(batch.num_tokens, topo)
    loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
    loss.backward()
    flat = single_rank_state(model)
    if flat is not None:
        flat.finish_backward()
    norm = float(ndp.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], None))
    grads, grad_dtypes = {}, set()
    for name, param in model.named_parameters():
        grad = param.grad
        grad_dtypes.add(grad.dtype)
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        grads[_compat.canonical_name(name)] = full.float()
    return {
        "loss": float(ndp.reduce_loss(loss.detach(), topo)),
        "grads": grads if topo.rank == 0 else None,
        "norm": norm,
        "norm_float64": float(torch.cat([g.double().flatten() for g in grads.values()]).norm()),
        "dtypes": dtypes,
        "grad_dtypes": grad_dtypes,
        "flat": None if flat is None else (flat.master_flat.dtype, flat.compute_flat is None),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def test_bf16_weights_one_rank_and_fsdp_match_plain_bf16(parity_record):
    ref = _reference()
    one = run_ranks(1, _ours, 1)[0]
    two = run_ranks(2, _ours, 2)
    # the weights and their gradients are bf16 themselves: no float32 master, no compute copy
    assert one["flat"] == (torch.bfloat16, True)
    for result in (one, *two):
        assert result["dtypes"] == {torch.bfloat16} and result["grad_dtypes"] == {torch.bfloat16}
    assert two[0]["loss"] == two[1]["loss"]
    # the clipping norm of bf16 gradients is summed in float32 (torch's rounds each tensor's norm to bf16: ~1e-3)
    for result in (one, two[0]):
        assert result["norm"] == pytest.approx(result["norm_float64"], rel=1e-5)
    worst = {}
    for name, expected in ref["grads"].items():
        for label, got in (("one rank", one), ("fsdp 2", two[0])):
            worst[f"{label} {name}"] = _rel(got["grads"][name], expected)
    parity_record({"loss": abs(one["loss"] - ref["loss"]) / ref["loss"], "grads": max(worst.values())})
    assert abs(one["loss"] - ref["loss"]) <= 1e-2 * ref["loss"]
    assert abs(two[0]["loss"] - ref["loss"]) <= 1e-2 * ref["loss"]
    bad = {k: v for k, v in worst.items() if v > 2e-2}
    assert not bad, bad
