"""Measured memory against the planner's predictions (test and benchmark code; training never uses it).

A measurement row (a dict, as stored in ``benchmarks/results/planner_memory_measurements.json``) names the
case and the quantity measured:

    {"case": "w1-none-bf16", "model": "tiny" | {ModelShape fields or a config.json dict},
     "layout": {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "cp_comm_strategy": "allgather"},
     "seq_len": 64, "micro_batch": 2, "activation_checkpointing": "none", "precision": "bf16",
     "quantity": "activations_retained", "measured_bytes": 868364}

Quantities and the prediction each is compared with:

    activations_retained   bytes alive after forward + loss (``measure.measure_activations``)
                           vs ``activation_bytes(...).retained``
    layer_saved            bytes autograd saves in one decoder layer without checkpointing
                           vs ``activations.layer_none``
    layer_retained         bytes one more decoder layer keeps in any checkpointing mode (the difference
                           of two measurements with different layer counts) vs ``.per_layer``
    loss_peak              peak of logits + loss through forward and backward (``measure.measure_loss_peak``)
                           vs ``activations.loss_peak``; with ``fused_loss``, of the fused lm_head + loss
                           (``measure.measure_fused_loss_peak``, chunks of ``chunk_rows``) vs
                           ``activations.fused_loss_peak`` (its CPU path)
    step_peak              peak of what one step's forward and backward create on one rank, eager, flat path
                           (``measure.measure_step_peak``) vs the largest moment of ``memory_moments`` less
                           what exists before the step there (weights, compute copies, input ids and labels)
    peak_allocated         ``torch.cuda.max_memory_allocated`` over training steps (optimizer step
                           included) vs ``estimate_memory(...).allocated``; optional keys: accumulation,
                           gradient_sync, lora_rank
    peak_total             device memory in use including context (e.g. nvidia-smi)
                           vs ``estimate_memory(...).total``; optional key: overhead_gib

Any row may carry ``lora_rank`` (LoRA on all seven linears of every layer) and the long-row features as the
trainer names them: ``fused_loss`` (default true, the trainer's default: every row measured before the fused
loss existed says false), ``tiled_mlp`` (``tiled_mlp_num_shards``), ``activation_offload_layers``. GPU rows
also say where they come from: ``device``, ``torch``, ``transformers``, ``date``, ``source`` (the results
file). The H200 rows (1B and 3B shapes, world 1) come from ``benchmarks/results/`` through
``benchmarks/planner/planner_measure.py``; the unit tests hold every row to ``TOLERANCE``.
"""

from __future__ import annotations

import json
from typing import Any

from ndparallel.errors import ConfigError
from ndparallel.mesh.layout import Layout
from ndparallel.planner.activations import activation_bytes, fused_loss_peak, layer_none, loss_peak
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import MemoryEstimate, memory_moments
from ndparallel.planner.shapes import load_model_shape
from ndparallel.planner.workload import Workload

TOLERANCE = 0.15
QUANTITIES = (
    "activations_retained",
    "layer_saved",
    "layer_retained",
    "loss_peak",
    "step_peak",
    "peak_allocated",
    "peak_total",
)


def _features(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "fused_loss": row.get("fused_loss", True),
        "tiled": row.get("tiled_mlp", False),
        "offload_layers": row.get("activation_offload_layers", 0),
    }


def predict(row: dict[str, Any]) -> float:
    """The planner's number for the quantity a measurement row measured."""
    quantity = row.get("quantity")
    if quantity not in QUANTITIES:
        raise ConfigError(
            f"measurement {row.get('case')!r}: quantity={quantity!r} must be one of {', '.join(QUANTITIES)}"
        )
    model = load_model_shape(row["model"])
    layout = Layout(**row["layout"])
    seq, b = row["seq_len"], row["micro_batch"]
    precision = row.get("precision", "bf16")
    e = 2 if precision == "bf16" else 4
    mode = row.get("activation_checkpointing", "none")
    features = _features(row)
    if quantity in ("activations_retained", "layer_retained"):
        acts = activation_bytes(model, layout, seq, b, mode, e, row.get("lora_rank"), **features)
        return acts.retained if quantity == "activations_retained" else acts.per_layer
    if quantity == "layer_saved":
        return layer_none(model, layout, seq, b, e, row.get("lora_rank"), tiled=features["tiled"])
    if quantity == "loss_peak" and features["fused_loss"]:
        return fused_loss_peak(model, layout, seq, b, e, device="cpu", chunk_rows=row["chunk_rows"])
    if quantity == "loss_peak":
        return loss_peak(model, layout, seq, b, e)
    if quantity == "step_peak":
        return step_peak(row)
    memory = predict_memory(row)
    return memory.allocated if quantity == "peak_allocated" else memory.total


def step_peak(row: dict[str, Any]) -> float:
    """The planner's ``step_peak``: the largest moment's gradients, activations and transients, less the input
    ids and labels (16 bytes per token) that exist before the measured step."""
    existing = 16 * row["micro_batch"] * row["seq_len"]
    moments = predict_moments(row)
    return max(m.grads + m.accumulated_grads + m.activations + m.transient - existing for m in moments.values())


def predict_memory(row: dict[str, Any]) -> MemoryEstimate:
    """The planner's itemized peak for a ``peak_allocated`` / ``peak_total`` row's configuration."""
    return max(predict_moments(row).values(), key=lambda m: m.allocated)


def predict_moments(row: dict[str, Any]) -> dict[str, MemoryEstimate]:
    """The planner's moments (``memory_moments``) for a row's configuration."""
    model = load_model_shape(row["model"])
    layout = Layout(**row["layout"])
    seq, b = row["seq_len"], row["micro_batch"]
    mode = row.get("activation_checkpointing", "none")
    accumulation = row.get("accumulation", 1)
    workload = Workload(
        seq_len=seq,
        global_batch_rows=b * accumulation * layout.batch_size,
        micro_batch_sizes=(b,),
        precision=row.get("precision", "bf16"),
        activation_checkpointing=mode,
        lora_rank=row.get("lora_rank"),
        quantized_base=row.get("quantized_base"),
        compile=row.get("compile", False),
        single_rank_fsdp=row.get("single_rank_fsdp", False),
        master_grads=row.get("master_grads", False),
        fused_loss=row.get("fused_loss", True),
        tiled_mlp=row.get("tiled_mlp", False),
        tiled_mlp_num_shards=row.get("tiled_mlp_num_shards"),
        activation_offload=bool(row.get("activation_offload_layers")),
        activation_offload_layers=row.get("activation_offload_layers"),
    )
    cluster = Cluster(overhead_gib=row.get("overhead_gib", Cluster.overhead_gib))
    return memory_moments(
        model,
        layout,
        workload,
        micro_batch=b,
        activation_checkpointing=mode,
        accumulation=accumulation,
        gradient_sync=row.get("gradient_sync", "every_micro_batch"),
        cluster=cluster,
    )


def compare_to_measurements(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, float]]:
    """(case, predicted bytes, measured bytes, relative error (predicted - measured) / measured) per row."""
    out = []
    for row in rows:
        predicted = predict(row)
        measured = float(row["measured_bytes"])
        out.append((row["case"], predicted, measured, (predicted - measured) / measured))
    return out


def load_measurements(path: str) -> list[dict[str, Any]]:
    """The measurement rows of a measurements file (the repository keeps them in
    ``benchmarks/results/planner_memory_measurements.json``, written by ``benchmarks/planner/planner_measure.py``)."""
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data
