"""Measured memory against the planner's predictions (test and benchmark code, outside the library).

A measurement row (a dict, as stored in ``measurements.json``) names the case and the quantity measured:

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
                           vs ``activations.loss_peak``
    peak_allocated         ``torch.cuda.max_memory_allocated`` over training steps (optimizer step
                           included) vs ``estimate_memory(...).allocated``; optional keys: accumulation,
                           gradient_sync, lora_rank
    peak_total             device memory in use including context (e.g. nvidia-smi)
                           vs ``estimate_memory(...).total``; optional key: overhead_gib

Any row may carry ``lora_rank`` (LoRA on all seven linears of every layer). GPU rows also say where they
come from: ``device``, ``torch``, ``transformers``, ``date``, ``source`` (the results file). The H200 rows
(1B and 3B shapes, world 1) come from ``benchmarks/results/`` through ``benchmarks/planner_measure.py``;
the unit tests hold every row to ``TOLERANCE``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ndparallel.errors import ConfigError
from ndparallel.layout import Layout
from ndparallel.planner.activations import activation_bytes, layer_none, loss_peak
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import MemoryEstimate, estimate_memory
from ndparallel.planner.shapes import load_model_shape
from ndparallel.planner.workload import Workload

TOLERANCE = 0.15
MEASUREMENTS_PATH = os.path.join(os.path.dirname(__file__), "measurements.json")
QUANTITIES = ("activations_retained", "layer_saved", "layer_retained", "loss_peak", "peak_allocated", "peak_total")


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
    if quantity == "activations_retained":
        return activation_bytes(model, layout, seq, b, mode, e, row.get("lora_rank")).retained
    if quantity == "layer_retained":
        return activation_bytes(model, layout, seq, b, mode, e, row.get("lora_rank")).per_layer
    if quantity == "layer_saved":
        return layer_none(model, layout, seq, b, e, row.get("lora_rank"))
    if quantity == "loss_peak":
        return loss_peak(model, layout, seq, b, e)
    memory = predict_memory(row)
    return memory.allocated if quantity == "peak_allocated" else memory.total


def predict_memory(row: dict[str, Any]) -> MemoryEstimate:
    """The planner's itemized peak for a ``peak_allocated`` / ``peak_total`` row's configuration."""
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
    )
    cluster = Cluster(overhead_gib=row.get("overhead_gib", Cluster.overhead_gib))
    return estimate_memory(
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


def load_measurements(path: str = MEASUREMENTS_PATH) -> list[dict[str, Any]]:
    """The measurement rows of a measurements file (default: the one shipped with the planner)."""
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data
