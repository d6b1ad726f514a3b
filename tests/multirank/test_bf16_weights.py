"""bf16 weights with no float32 masters (``bf16: full``, ``ParallelOptions.master_dtype``), forward and backward,
on one rank (flat buffers) and on two ranks of each axis (FSDP, tensor and context parallelism), against plain
transformers in bf16 on one process.

A bf16 model's arithmetic rounds every product to bf16, and ndparallel's loss (the fused head, in token chunks)
and attention sum in another order than transformers' logits and SDPA: the comparison is to bf16's resolution
(relative 2e-2 per gradient tensor; measured at most 1.1e-2, the loss 1.9e-5), not float32's. The update itself
(torchao's AdamW8bit, stochastic rounding) is ``tests/unit/optim/test_adamw_8bit.py`` and, through the trainer,
``test_eight_bit_train.py``.
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


def _ours(sizes: dict) -> dict:
    from ndparallel.parallel.single_rank import single_rank_state

    topo = ndp.Topology.build(ndp.ParallelismConfig(**sizes))
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


LAYOUTS = {"fsdp 2": {"dp_shard_size": 2}, "tp 2": {"tp_size": 2}, "cp 2": {"cp_size": 2}}


def test_bf16_weights_on_every_axis_match_plain_bf16(parity_record):
    ref = _reference()
    runs = {"one rank": run_ranks(1, _ours, {"dp_shard_size": 1})}
    runs.update({label: run_ranks(2, _ours, sizes) for label, sizes in LAYOUTS.items()})
    # the weights and their gradients are bf16 themselves: no float32 master, no compute copy
    assert runs["one rank"][0]["flat"] == (torch.bfloat16, True)
    worst = {}
    for label, ranks in runs.items():
        for result in ranks:
            assert result["dtypes"] == {torch.bfloat16} and result["grad_dtypes"] == {torch.bfloat16}, label
        assert len({r["loss"] for r in ranks}) == 1, label
        got = ranks[0]
        assert abs(got["loss"] - ref["loss"]) <= 1e-2 * ref["loss"], label
        # the clipping norm of bf16 gradients is summed in float32 (torch's rounds each tensor's to bf16: ~1e-3)
        assert got["norm"] == pytest.approx(got["norm_float64"], rel=1e-5), label
        for name, expected in ref["grads"].items():
            worst[f"{label} {name}"] = _rel(got["grads"][name], expected)
    parity_record(
        {
            "loss": max(abs(r[0]["loss"] - ref["loss"]) / ref["loss"] for r in runs.values()),
            "grads": max(worst.values()),
        }
    )
    bad = {k: v for k, v in worst.items() if v > 2e-2}
    assert not bad, bad
