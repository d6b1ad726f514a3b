"""CUDA out-of-memory during training: one line naming the step, the layout and what to change (the
planner's suggestion for this model, GPU count and GPU size), and optionally the allocator's snapshot.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from ndparallel import _compat
from ndparallel.errors import NdParallelError
from ndparallel.mesh.layout import Layout
from ndparallel.planner.plan import best_layout
from ndparallel.planner.request import layout_request


class DeviceMemoryError(NdParallelError):
    """The run needs more GPU memory than the device has (raised on the rank that ran out)."""

    rank_specific = True  # the CLI prints it from the rank that raised it, not from rank 0 only


def layout_text(layout: Layout) -> str:
    text = f"dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} x cp {layout.cp} x tp {layout.tp}"
    return text + (f" ({layout.cp_comm_strategy})" if layout.cp > 1 else "")


def planner_advice(cfg, model_config, layout: Layout, device_memory_gib: float) -> str:
    """What the planner would run instead on these GPUs, or why it cannot say: a layout, and the long-row
    features to turn on when the run as configured fits nowhere (``planner.plan.best_layout``)."""

    # the run's settings (request.py), checkpointing left to the planner: the advice may change it
    request = {**layout_request(cfg), "activation_checkpointing": "auto"}
    try:
        choice = best_layout(model_config, layout.world_size, device_memory_gib=device_memory_gib, **request)
    except NdParallelError as exc:
        return f"the planner has no layout for it ({exc})"
    return f"the planner suggests {choice.reason} (or set dp_shard_size: auto)"


def oom_message(
    *, step: int, rank: int, cfg, model_config, layout: Layout, used_gib: float, total_gib: float, snapshot: Path | None
) -> str:
    where = (
        f"step {step}: CUDA out of memory on rank {rank} ({used_gib:.1f} of {total_gib:.1f} GiB in use) with "
        f"{layout_text(layout)}, micro_batch_size {cfg.micro_batch_size}, sequence_len {cfg.sequence_len}, "
        f"activation_checkpointing {cfg.ac_mode}"
    )
    advice = planner_advice(cfg, model_config, layout, total_gib)
    fixes = "; lower micro_batch_size (raise gradient_accumulation_steps to keep the batch)"
    if cfg.ac_mode != "full":
        fixes += ", set activation_checkpointing: full"
    shot = f"; memory snapshot: {snapshot}" if snapshot else "; set cuda_memory_snapshot: true for a memory snapshot"
    return f"{where}. {advice[0].upper()}{advice[1:]}{fixes}{shot}"


@contextlib.contextmanager
def memory_history(enabled: bool, device: torch.device) -> Iterator[None]:
    """Record CUDA allocations (stack traces included) inside the block when ``enabled`` on a GPU."""
    if not (enabled and device.type == "cuda"):
        yield
        return
    _compat.record_memory_history(True)
    try:
        yield
    finally:
        _compat.record_memory_history(False)


def write_snapshot(output_dir: Path, rank: int, device: torch.device, enabled: bool) -> Path | None:
    if not (enabled and device.type == "cuda"):
        return None
    path = output_dir / "logs" / f"memory-snapshot-rank{rank}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    _compat.dump_memory_snapshot(path)
    return path


def device_memory_gib(device: torch.device) -> tuple[float, float]:
    """(reserved by PyTorch, total) GiB of a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_reserved(device) / 2**30, total / 2**30
