"""Rank every valid layout of a cluster for a model and workload; pick one for ``dp_shard_size: auto``.

For each valid layout, every micro-batch size that divides a data rank's rows, every checkpointing mode
allowed and both gradient-sync policies (with accumulation) are estimated; the layout keeps its fastest
setting that fits (or, if none fits, its leanest). The long-row features the workload leaves to the planner
('auto': ``Workload.tiled_mlp``, ``Workload.activation_offload``; the fused loss is the trainer's default and
taken as given) are tried only on a layout none of whose settings fits without them: the tiled MLP (with no
checkpointing or full; selective caches the tiles' matmul outputs anyway), the offload of as many first
layers' inputs as the host memory holds (full checkpointing), and both. Offload costs no time when its
copies hide behind compute, so offering it where it is not needed would only trade host memory for nothing.
Layouts are ranked by tokens/s per GPU among those that fit in ``Cluster.headroom`` x device memory (and,
offloading, ``offload.HOST_SHARE`` x host memory); the ones that do not fit follow, leanest first.

Ranking charges each parallel axis in use beyond the first 1% of its estimated throughput
(``AXIS_PENALTY``): the estimates leave out per-axis costs (smaller kernels, more launches, CP's block
merges), so when two layouts come out within about a percent the simpler one is the better bet.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from ndparallel.errors import ConfigError
from ndparallel.mesh.layout import AXES, CP_METHODS, Layout
from ndparallel.planner.candidates import Knobs, knob_choices, valid_layouts
from ndparallel.planner.evaluate import PlanRow, evaluate
from ndparallel.planner.gpus import DEFAULT_GPU, GPUS, GpuSpec, gpu_preset, preset_for_device_name
from ndparallel.planner.hardware import GIB, Cluster
from ndparallel.planner.memory import offload_layers_for
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
    if workload.quantized_base in ("nf4", "fp8"):  # quantized/: neither is split by tensor parallelism
        if layouts and all(lay.tp > 1 for lay in layouts):
            flag, what = ("--load-in-4bit", "NF4") if workload.quantized_base == "nf4" else ("--load-in-fp8", "FP8")
            raise ConfigError(
                f"{flag}: {what} base weights cannot be split by tensor parallelism; plan tp 1 "
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
    candidates = {layout: layout_candidates(model, layout, workload, cluster) for layout in layouts}
    rows = sorted((_pick(xs) for xs in candidates.values()), key=_order)
    add_reasons(rows, candidates, model, cluster, workload)
    return rows


def layout_candidates(model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster) -> list[PlanRow]:
    """Every setting of one layout estimated: the workload's own, then, when none fits, the long-row features
    it leaves to the planner (module docstring)."""
    feasible = workload.rows % layout.batch_size == 0
    modes = ("full",) if workload.activation_offload is True else workload.ac_modes
    knobs = (
        knob_choices(
            workload.rows // layout.batch_size, workload.micro_batch_sizes, modes, workload.gradient_sync_modes
        )
        if feasible
        else []
    )
    if not knobs:
        feasible = False
        knobs = [Knobs(1, 1, mode, workload.gradient_sync_modes[0]) for mode in modes]
    fixed = [
        _features(model, layout, workload, cluster, k, workload.tiled_mlp is True, workload.activation_offload is True)
        for k in knobs
    ]
    rows = [evaluate(model, layout, workload, cluster, k, feasible=feasible) for k in fixed if k is not None]
    if feasible and not any(r.fits for r in rows):
        for tiled in workload.tiled_mlp_modes:
            for offload in workload.offload_modes:
                if (tiled, offload) == (workload.tiled_mlp is True, workload.activation_offload is True):
                    continue
                extra = [_features(model, layout, workload, cluster, k, tiled, offload) for k in knobs]
                rows += [evaluate(model, layout, workload, cluster, k, feasible=True) for k in extra if k is not None]
    return rows


def _features(
    model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, knobs: Knobs, tiled: bool, offload: bool
) -> Knobs | None:
    """``knobs`` with the tiled MLP and offload on as asked, or None where they do not apply (tiling under
    selective checkpointing, offload without full checkpointing or without a layer the host memory holds)."""
    mode = knobs.activation_checkpointing
    if tiled and mode == "selective" and workload.tiled_mlp is not True:  # 'auto': no use trying it
        return None
    layers = 0
    if offload:
        if mode != "full":
            return None
        layers = offload_layers_for(model, layout, workload, cluster, knobs.micro_batch)
        if layers < 1 and workload.activation_offload is not True:
            return None  # 'auto': nothing to try
        if workload.activation_offload_layers is None:
            layers = max(layers, 1)  # the run's setting: one layer, to say the host memory does not hold it
    return dataclasses.replace(knobs, tiled_mlp=tiled, offload_layers=layers)


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
    host_memory_gib: float | None = None,
    gpu: GpuSpec | str | None = None,
    micro_batch_size: int = 1,
    global_batch_rows: int | None = None,
    cp_methods: tuple[str, ...] = CP_METHODS,
    cp_comm_strategy: str | None = None,
    constraints: dict[str, int] | None = None,
    **workload_fields: Any,
) -> LayoutChoice:
    """The layout to train on ``world_size`` GPUs (for ``dp_shard_size: auto``), and a one-line reason.

    ``model``: a ModelShape, preset name, config path or transformers config. ``gpu``: a preset name or spec;
    None: this machine's CUDA device (``local_gpu``), else the default preset; ``device_memory_gib`` overrides
    its memory, ``host_memory_gib`` a node's host memory. ``cp_comm_strategy``: the run's one CP method (replaces
    ``cp_methods``). ``workload_fields``: the rest of ``Workload``'s fields (precision, activation_checkpointing,
    lora_rank, compile, ...), as the run has them (``request.layout_request``); long-row features default off.
    Always a valid layout: the leanest when nothing fits, or the one that fits with the long-row features the
    run leaves off, naming them. ``gpus_per_node``: min(world_size, 8) by default; the global batch:
    ``micro_batch_size`` rows per GPU. Unpacks as ``layout, reason``."""
    if cp_comm_strategy is not None and cp_comm_strategy not in CP_METHODS:
        raise ConfigError(f"cp_comm_strategy={cp_comm_strategy!r} must be one of {', '.join(CP_METHODS)}")
    cluster = _cluster(world_size, gpus_per_node, gpu, device_memory_gib, host_memory_gib)
    defaults = {"gradient_sync": "every_micro_batch", "tiled_mlp": False, "activation_offload": False}
    workload = Workload(
        seq_len=seq_len,
        global_batch_rows=global_batch_rows or micro_batch_size * world_size,
        micro_batch_sizes=(micro_batch_size,),
        cp_methods=(cp_comm_strategy,) if cp_comm_strategy else cp_methods,
        **{**defaults, **workload_fields},
    )
    rows = plan(model, cluster, workload, constraints=constraints)
    if rows[0].fits:
        return LayoutChoice(rows[0].layout, _fitting_reason(rows[0], len(rows), cluster))
    return _nothing_fits(load_model_shape(model), cluster, workload, rows[0], constraints)


def _cluster(
    world_size: int, gpus_per_node: int | None, gpu: GpuSpec | str | None, memory: float | None, host: float | None
) -> Cluster:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be a whole number >= 1")
    per_node = math.gcd(world_size, gpus_per_node or min(world_size, 8))
    spec = gpu_preset(gpu) if isinstance(gpu, str) else (gpu or local_gpu())
    return Cluster(
        nodes=world_size // per_node,
        gpus_per_node=per_node,
        gpu=spec,
        device_memory_gib=memory,
        host_memory_gib=host,
    )


def _sizes(row: PlanRow) -> str:
    lay = row.layout
    sizes = f"dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x cp {lay.cp} x tp {lay.tp}"
    sizes += f" ({lay.cp_comm_strategy})" if lay.cp > 1 else ""
    setting = f"activation_checkpointing={row.activation_checkpointing}"
    if row.tiled_mlp:
        setting += ", tiled_mlp=true"
    if row.offload_layers:
        setting += f", activation_offloading=true ({row.offload_layers} layer{'' if row.offload_layers == 1 else 's'})"
    return f"{sizes}, {setting}"


def _fitting_reason(row: PlanRow, layouts: int, cluster: Cluster) -> str:
    return (
        f"{_sizes(row)}: {row.memory.total / GIB:.1f} GiB of {cluster.usable_bytes / GIB:.1f} usable "
        f"on {cluster.gpu.name}, ~{row.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, best of {layouts} layouts"
    )


def _nothing_fits(
    model: ModelShape, cluster: Cluster, workload: Workload, leanest: PlanRow, constraints: dict[str, int] | None
) -> LayoutChoice:
    """The leanest layout and why nothing fits, or the layout that fits once the long-row features the run
    leaves off are on (the fused loss, the tiled MLP, activation offload), naming the settings."""
    hint = "" if "full" in workload.ac_modes else " or allow activation checkpointing"
    reason = (
        f"{_sizes(leanest)}: nothing fits in {cluster.gpu.memory_gib:g} GiB; this is the leanest layout "
        f"({leanest.memory.total / GIB:.1f} GiB); use more GPUs or a shorter sequence{hint}"
    )
    off = [name for name in ("tiled_mlp", "activation_offload") if getattr(workload, name) is False]
    if workload.fused_loss and not off:
        return LayoutChoice(leanest.layout, reason)
    features = dict.fromkeys(off, "auto")
    ac = "auto" if features.get("activation_offload") else workload.activation_checkpointing
    wider = dataclasses.replace(workload, fused_loss=True, activation_checkpointing=ac, **features)
    best = plan(model, cluster, wider, constraints=constraints)[0]
    settings = [] if workload.fused_loss else ["fused_cross_entropy: true"]
    settings += ["tiled_mlp: true"] if best.tiled_mlp and workload.tiled_mlp is False else []
    if best.offload_layers and workload.activation_offload is False:
        settings.append("activation_offloading: true")
        if "full" not in workload.ac_modes:
            settings.append("activation_checkpointing: full")
    if not best.fits or not settings:
        return LayoutChoice(leanest.layout, reason)
    return LayoutChoice(
        best.layout,
        f"nothing fits as configured (the leanest layout needs {leanest.memory.total / GIB:.1f} GiB of "
        f"{cluster.usable_bytes / GIB:.1f} usable on {cluster.gpu.name}); set {' and '.join(settings)}: "
        f"{_sizes(best)} then needs {best.memory.total / GIB:.1f} GiB, ~{best.tokens_per_s_per_gpu:,.0f} "
        "tokens/s/GPU",
    )
