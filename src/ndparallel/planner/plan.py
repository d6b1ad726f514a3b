"""Rank every valid layout of a cluster for a model and workload; pick one for ``dp_shard_size: auto``.

For each valid layout, every micro-batch size that divides a data rank's rows, every checkpointing mode
allowed and both gradient-sync policies (with accumulation) are estimated; the layout keeps its fastest
setting that fits (or, if none fits, its leanest). Layouts are ranked by tokens/s per GPU among those
that fit in ``Cluster.headroom`` x device memory; the ones that do not fit follow, leanest first.

Ranking charges each parallel axis in use beyond the first 1% of its estimated throughput
(``AXIS_PENALTY``): the estimates leave out per-axis costs (smaller kernels, more launches, CP's block
merges), so when two layouts come out within about a percent the simpler one is the better bet.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ndparallel.errors import ConfigError
from ndparallel.layout import AXES, CP_METHODS, Layout
from ndparallel.planner.candidates import Knobs, knob_choices, valid_layouts
from ndparallel.planner.evaluate import PlanRow, evaluate
from ndparallel.planner.gpus import DEFAULT_GPU, GPUS, GpuSpec, gpu_preset, preset_for_device_name
from ndparallel.planner.hardware import GIB, Cluster
from ndparallel.planner.reasons import add_reasons
from ndparallel.planner.shapes import ModelShape, load_model_shape
from ndparallel.planner.workload import Workload

AXIS_PENALTY = 0.01


def _pick(candidates: list[PlanRow]) -> PlanRow:
    fitting = [x for x in candidates if x.fits]
    if fitting:
        return max(fitting, key=lambda x: (x.tokens_per_s_per_gpu, -x.memory.total))
    return min(candidates, key=lambda x: x.memory.total)


def _order(row: PlanRow) -> tuple:
    if row.fits:
        extra_axes = max(sum(size > 1 for size in row.layout.shape) - 1, 0)
        return (0, -row.tokens_per_s_per_gpu * (1 - AXIS_PENALTY * extra_axes))
    return (1 if row.feasible else 2, row.memory.total)


def plan(
    model: ModelShape | str | Any, cluster: Cluster, workload: Workload, *, constraints: dict[str, int] | None = None
) -> list[PlanRow]:
    """All valid layouts of ``cluster``'s GPUs, best first, each with its settings, costs and reasons.

    ``constraints`` fixes axis sizes, e.g. ``{"tp": 2}``.
    """
    model = load_model_shape(model)
    layouts = valid_layouts(model, cluster.world_size, workload.seq_len, workload.cp_methods)
    for axis, size in (constraints or {}).items():
        if axis not in AXES:
            raise ConfigError(f"constraint {axis!r} is not an axis; use {', '.join(AXES)}")
        layouts = [lay for lay in layouts if getattr(lay, axis) == size]
    if workload.quantized_base == "nf4":  # quantized/: an NF4 weight cannot be split by columns
        if layouts and all(lay.tp > 1 for lay in layouts):
            raise ConfigError(
                "--load-in-4bit: NF4 base weights cannot be split by tensor parallelism; plan tp 1 "
                "(--layout R,S,C,1) or use --load-in-8bit"
            )
        layouts = [lay for lay in layouts if lay.tp == 1]
    if not layouts:
        raise ConfigError(
            f"no layout of {cluster.world_size} GPUs splits {model.name} (heads {model.heads}, kv heads "
            f"{model.kv_heads}) at seq_len={workload.seq_len}"
            + (f" with {constraints}" if constraints else "")
            + "; change the sequence length or the GPU count"
        )
    candidates: dict[Layout, list[PlanRow]] = {}
    for layout in layouts:
        feasible = workload.rows % layout.batch_size == 0
        knobs = (
            knob_choices(
                workload.rows // layout.batch_size,
                workload.micro_batch_sizes,
                workload.ac_modes,
                workload.gradient_sync_modes,
            )
            if feasible
            else []
        )
        if not knobs:
            feasible = False
            knobs = [Knobs(1, 1, mode, workload.gradient_sync_modes[0]) for mode in workload.ac_modes]
        candidates[layout] = [evaluate(model, layout, workload, cluster, k, feasible=feasible) for k in knobs]
    rows = sorted((_pick(xs) for xs in candidates.values()), key=_order)
    add_reasons(rows, candidates, model, cluster, workload)
    return rows


class LayoutChoice(NamedTuple):
    layout: Layout
    reason: str


def local_gpu() -> GpuSpec:
    """The preset of this machine's first CUDA device (its memory as reported), else the default preset."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        spec = preset_for_device_name(props.name, props.total_memory / GIB)
        if spec is not None:
            return spec
    return GPUS[DEFAULT_GPU]


def best_layout(
    model: ModelShape | str | Any,
    world_size: int,
    seq_len: int,
    *,
    gpus_per_node: int | None = None,
    device_memory_gib: float | None = None,
    gpu: GpuSpec | str | None = None,
    micro_batch_size: int = 1,
    global_batch_rows: int | None = None,
    precision: str = "bf16",
    activation_checkpointing: str = "auto",
    lora_rank: int | None = None,
    quantized_base: str | None = None,
    compile: bool = False,
    gradient_sync: str = "every_micro_batch",
    cp_methods: tuple[str, ...] = CP_METHODS,
    cp_comm_strategy: str | None = None,
    constraints: dict[str, int] | None = None,
) -> LayoutChoice:
    """The layout to train on ``world_size`` GPUs (for ``dp_shard_size: auto``), and a one-line reason.

    ``model`` is a ModelShape, a preset name, a config path or a transformers config (what the trainer has).
    ``gpu`` is a preset name or spec; None: this machine's CUDA device when it has one (``local_gpu``), else
    the default preset; ``device_memory_gib`` overrides its memory. ``cp_comm_strategy`` is the one CP
    method the run is configured with (the trainer's setting); it replaces ``cp_methods``. ``quantized_base``:
    'nf4' / 'int8' for LoRA on a quantized base (NF4 keeps tp at 1). Always a valid
    layout for ``world_size``: when nothing fits in memory, the leanest one, saying so. ``gpus_per_node``
    defaults to min(world_size, 8); the global batch to ``micro_batch_size`` rows per GPU. Unpacks as
    ``layout, reason``.
    """
    model = load_model_shape(model)
    if cp_comm_strategy is not None:
        if cp_comm_strategy not in CP_METHODS:
            raise ConfigError(f"cp_comm_strategy={cp_comm_strategy!r} must be one of {', '.join(CP_METHODS)}")
        cp_methods = (cp_comm_strategy,)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be a whole number >= 1")
    per_node = math.gcd(world_size, gpus_per_node or min(world_size, 8))
    spec = gpu_preset(gpu) if isinstance(gpu, str) else (gpu or local_gpu())
    cluster = Cluster(
        nodes=world_size // per_node, gpus_per_node=per_node, gpu=spec, device_memory_gib=device_memory_gib
    )
    workload = Workload(
        seq_len=seq_len,
        global_batch_rows=global_batch_rows or micro_batch_size * world_size,
        micro_batch_sizes=(micro_batch_size,),
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        lora_rank=lora_rank,
        quantized_base=quantized_base,
        cp_methods=cp_methods,
        compile=compile,
        gradient_sync=gradient_sync,
    )
    rows = plan(model, cluster, workload, constraints=constraints)
    best = rows[0]
    lay = best.layout
    sizes = f"dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x cp {lay.cp} x tp {lay.tp}"
    if lay.cp > 1:
        sizes += f" ({lay.cp_comm_strategy})"
    setting = f"activation_checkpointing={best.activation_checkpointing}"
    if best.fits:
        reason = (
            f"{sizes}, {setting}: {best.memory.total / GIB:.1f} GiB of {cluster.usable_bytes / GIB:.1f} usable "
            f"on {cluster.gpu.name}, ~{best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, best of {len(rows)} layouts"
        )
    else:
        hint = "" if activation_checkpointing in ("auto", "full") else " or allow activation checkpointing"
        reason = (
            f"{sizes}, {setting}: nothing fits in {cluster.gpu.memory_gib:g} GiB; this is the leanest layout "
            f"({best.memory.total / GIB:.1f} GiB); use more GPUs or a shorter sequence{hint}"
        )
    return LayoutChoice(layout=lay, reason=reason)
