"""Planner output: an aligned text table with the reasons of the leading rows, or JSON."""

from __future__ import annotations

from typing import Any

from ndparallel.planner.evaluate import PlanRow
from ndparallel.planner.gpus import DEFAULT_GPU
from ndparallel.planner.hardware import GIB, Cluster
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload

_COLUMNS = (
    "#",
    "dp_rep",
    "dp_shard",
    "cp",
    "tp",
    "cp method",
    "micro x acc",
    "AC (+ long-row features)",
    "sync",
    "GiB/GPU",
    "fits",
    "step s",
    "tok/s/GPU",
    "exposed comm s",
)


def _cells(i: int, row: PlanRow) -> list[str]:
    lay = row.layout
    exposed = sum(row.time.exposed_comm_s.values())
    fits = "yes" if row.fits else ("no" if row.feasible else "batch")
    return [
        str(i),
        str(lay.dp_replicate),
        str(lay.dp_shard),
        str(lay.cp),
        str(lay.tp),
        lay.cp_comm_strategy if lay.cp > 1 else "-",
        f"{row.micro_batch} x {row.accumulation}",
        row.activation_checkpointing
        + (" +tiled" if row.tiled_mlp else "")
        + (f" +offload {row.offload_layers}" if row.offload_layers else ""),
        row.gradient_sync.split("_")[0] if row.accumulation > 1 else "-",  # every / last
        f"{row.memory.total / GIB:.1f}",
        fits,
        f"{row.step_s:.2f}",
        f"{row.tokens_per_s_per_gpu:,.0f}",
        f"{exposed:.2f}",
    ]


def header(model: ModelShape, cluster: Cluster, workload: Workload, *, gpu_given: bool = True) -> str:
    """What was planned for, and where the speeds come from (and what is assumed)."""
    gpu = cluster.gpu
    options = [workload.precision] + [name for name, on in (("compile", workload.compile), ("fp8", workload.fp8)) if on]
    if workload.lora_rank:
        bases = {"nf4": " on an NF4 base", "int8": " on an int8 base", "fp8": " on an FP8 base"}
        base = bases.get(workload.quantized_base or "", "")
        options.append(f"LoRA r={workload.lora_rank}{base}")
    if workload.doc_len:
        options.append(f"packed documents of {workload.doc_len} tokens")
    if model.experts:
        options.append(
            f"mixture of experts ({model.active_experts} of {model.experts} per token; expert parallelism not weighed)"
        )
    if not workload.fused_loss:
        options.append("unfused loss")
    for name, setting in (("tiled MLP", workload.tiled_mlp), ("activation offload", workload.activation_offload)):
        options.append(f"{name} {'where nothing fits without' if setting == 'auto' else 'on' if setting else 'off'}")
    lines = [
        f"{model.name}: {model.params / 1e9:.2f}B parameters on {cluster.nodes} x {cluster.gpus_per_node} "
        f"{gpu.name} ({gpu.memory_gib:g} GiB), {workload.rows} rows x {workload.seq_len} tokens per step, "
        + ", ".join(options)
    ]
    if cluster.measured:
        lines.append(f"kernel speeds: {cluster.efficiency.source}")
    else:
        lines.append(
            f"kernel speeds: fractions of the datasheet peaks measured on our H200 ({cluster.efficiency.source})"
        )
        if not gpu_given:
            lines.append(f"no --gpu given: assuming {DEFAULT_GPU} ({GPUS_NOTE}); name yours with --gpu or --measure")
        if gpu.arch != "hopper":
            lines.append(f"{gpu.name} is not a Hopper GPU: those fractions are a guess there; --measure on one")
    return "\n".join(lines)


GPUS_NOTE = "8 per node on NVLink, 400 Gb/s network per GPU"


def format_table(rows: list[PlanRow], top: int = 10, reasons_for: int = 3) -> str:
    """The first ``top`` rows as an aligned table, then the reasons of the first ``reasons_for`` rows."""
    shown = rows[:top]
    table = [list(_COLUMNS)] + [_cells(i + 1, row) for i, row in enumerate(shown)]
    widths = [max(len(r[k]) for r in table) for k in range(len(_COLUMNS))]
    left = (5, 7)  # text columns: cp method, AC
    lines = [
        "  ".join(cell.ljust(w) if k in left else cell.rjust(w) for k, (cell, w) in enumerate(zip(r, widths)))
        for r in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if len(rows) > top:
        lines.append(f"... {len(rows) - top} more layouts ({sum(r.fits for r in rows)} of {len(rows)} fit)")
    for i, row in enumerate(shown[:reasons_for]):
        lines.append("")
        lines.append(f"#{i + 1}:")
        lines.extend(f"  - {reason}" for reason in row.reasons)
    return "\n".join(lines)


def to_json(rows: list[PlanRow]) -> list[dict[str, Any]]:
    """The rows as plain dicts (json-serializable; ``PlanRow.from_dict`` reads them back)."""
    return [row.to_dict() for row in rows]
