"""Bytes each GPU sends per optimizer step, per parallel axis, and how long that takes.

Ring collectives over n ranks: an all-gather or reduce-scatter of a tensor of M bytes (the full size)
sends (n-1)/n * M from every rank, an all-reduce 2(n-1)/n * M. With m micro-batches per step, b rows
each, s = seq/cp tokens per rank, e bytes per element, h hidden, t = tp, c = cp, f = dp_shard x cp,
r = dp_replicate, P_t the parameters one tp rank holds gathered (P_split/t + P_rep), T_t the trainable
ones (P_t, or the LoRA adapters):

fsdp (dp_shard x cp)   all-gather e*P_t per micro-batch in forward, again in backward for the units
                       resharded after forward (all layers but the last, the untied embedding);
                       reduce-scatter of fp32 gradients 4*T_t: every micro-batch (gradient_sync 'every_micro_batch')
                       or once, on the last micro-batch ('last_micro_batch')
dp_replicate (HSDP)    all-reduce of the fp32 gradient shard 4*T_t/f, once per step on the last
                       micro-batch in both modes
tp (sequence parallel) per layer and micro-batch: all-gather + reduce-scatter of e*b*s*h before/after
                       attention and the MLP, in forward and backward: 8 collectives; 4 more when
                       checkpointing recomputes the forward; 4 for embedding and lm_head; the
                       vocabulary-parallel loss adds 3 all-reduces of b*s floats
cp                     K/V of one rank: kvb = e*2*kv/t*b*s bytes, per layer and micro-batch:
                       allgather: (c-1)*kvb all-gather in forward, (c-1)*kvb reduce-scatter in backward;
                       ring: (c-1) K/V sends forward, (c-1) K/V + c fp32 dK/dV sends backward;
                       alltoall: 4 all-to-alls (q, k, v, out) forward and 4 backward, (c-1)/c of each;
                       checkpointing repeats the forward part

Time per axis = bytes / achieved link bandwidth + collectives * latency, on the in-node links when the
axis' groups stay inside a node and on the network otherwise, where a group with k members per node uses
k NICs (``hardware.group_placement``, ``Cluster.link``); the achieved bandwidth is the links' times
``Efficiency.collective``. ``AxisComm`` keeps apart the traffic of
every micro-batch and the traffic of the last one only, for the overlap rules of ``perf.py``.

One function per axis (``AXIS_TRAFFIC``): a new axis (expert parallelism's all-to-alls) adds its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from ndparallel.mesh.layout import Layout
from ndparallel.planner.activations import kv_width_alltoall
from ndparallel.planner.hardware import Cluster, group_placement, group_size
from ndparallel.planner.memory import lora_params
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload


@dataclass(frozen=True)
class AxisComm:
    """Traffic of one axis in one optimizer step, per GPU."""

    axis: str
    bytes: float
    """Bytes this GPU sends."""
    collectives: int
    crosses_nodes: bool
    seconds: float
    """Transfer time of the whole step's traffic if nothing overlapped it."""
    last_only_s: float = 0.0
    """Part of ``seconds`` sent in the last micro-batch only (reductions deferred to it); the rest is spread
    evenly over the micro-batches."""
    per_node: int = 1
    """Members of the group on one node (NICs it crosses the network on)."""
    pattern: str = "collective"
    """'collective', 'p2p' (ring CP) or 'alltoall': how the traffic uses the links (``Cluster.link``)."""
    size: int = 2
    """Ranks in one of the axis' groups."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepShape:
    """What one step's traffic depends on besides the model and the layout."""

    workload: Workload
    micro_batch: int
    accumulation: int
    activation_checkpointing: str
    gradient_sync: str

    @property
    def recompute(self) -> bool:
        return self.activation_checkpointing != "none"


@dataclass(frozen=True)
class Traffic:
    """What one GPU of an axis sends in one step."""

    every_bytes: float
    """Sent in every micro-batch."""
    every_calls: int
    last_bytes: float = 0.0
    """Sent in the last micro-batch only."""
    last_calls: int = 0
    pattern: str = "collective"
    """'collective', 'p2p' or 'alltoall' (``Cluster.link``)."""


def _ring(n: int) -> float:
    return (n - 1) / n


def _tp_params(model: ModelShape, layout: Layout) -> float:
    return model.split_params() / layout.tp + model.replicated_params()


def _trainable_tp(model: ModelShape, layout: Layout, workload: Workload) -> float:
    if workload.lora_rank:
        return lora_params(model, workload.lora_rank) / layout.tp
    return _tp_params(model, layout)


def _units(model: ModelShape) -> int:
    return model.layers + 1 + (0 if model.tied else 2)  # layers, root, and (untied) embedding + [norm, lm_head]


def fsdp_traffic(model: ModelShape, layout: Layout, step: StepShape) -> Traffic | None:
    f, L, t = layout.fsdp_size, model.layers, layout.tp
    if f == 1:
        return None
    e = step.workload.compute_bytes
    layer_t = model.layer_split_params() / t + model.layer_replicated_params()
    regather = (L - 1) * layer_t + (0 if model.tied else model.vocab * model.hidden / t)
    gather = e * (_tp_params(model, layout) + regather) * _ring(f)
    scatter = 4 * _trainable_tp(model, layout, step.workload) * _ring(f)
    units = _units(model)
    if step.gradient_sync == "every_micro_batch" or step.accumulation == 1:
        return Traffic(gather + scatter, units + L + units)
    return Traffic(gather, units + L, scatter, units)


def replicate_traffic(model: ModelShape, layout: Layout, step: StepShape) -> Traffic | None:
    r, f = layout.dp_replicate, layout.fsdp_size
    if r == 1:
        return None
    all_reduce = 4 * _trainable_tp(model, layout, step.workload) / f * 2 * _ring(r)
    return Traffic(0.0, 0, all_reduce, _units(model))


def tp_traffic(model: ModelShape, layout: Layout, step: StepShape) -> Traffic | None:
    t = layout.tp
    if t == 1:
        return None
    e, b, s = step.workload.compute_bytes, step.micro_batch, step.workload.seq_len // layout.cp
    per_collective = e * b * s * model.hidden * _ring(t)
    n = model.layers * (8 + (4 if step.recompute else 0)) + 4
    loss = 3 * 4 * b * s * 2 * _ring(t)
    return Traffic(n * per_collective + loss, n + 3)


def cp_traffic(model: ModelShape, layout: Layout, step: StepShape) -> Traffic | None:
    c, t = layout.cp, layout.tp
    if c == 1:
        return None
    e, b, s, passes = step.workload.compute_bytes, step.micro_batch, step.workload.seq_len // c, 2 + step.recompute
    kvb = e * 2 * model.kv_dim / t * b * s
    method = layout.cp_comm_strategy
    if method == "allgather":
        per_layer, calls, pattern = (c - 1) * kvb * passes, passes, "collective"
    elif method == "ring":
        per_layer, calls, pattern = (c - 1) * kvb * passes + c * kvb * 4 / e, (c - 1) * passes + c, "p2p"
    else:
        sizes = e * b * s * (2 * model.q_dim + 2 * kv_width_alltoall(model, layout)) / t
        per_layer, calls, pattern = sizes * _ring(c) * passes, 4 * passes, "alltoall"
    return Traffic(model.layers * per_layer, model.layers * calls, pattern=pattern)


# axis name -> its traffic; the group each axis talks over is hardware.GROUP_AXES[name].
AXIS_TRAFFIC: dict[str, Callable[[ModelShape, Layout, StepShape], Traffic | None]] = {
    "fsdp": fsdp_traffic,
    "dp_replicate": replicate_traffic,
    "tp": tp_traffic,
    "cp": cp_traffic,
}


def comm_per_step(
    model: ModelShape,
    layout: Layout,
    workload: Workload,
    cluster: Cluster,
    *,
    micro_batch: int,
    accumulation: int,
    activation_checkpointing: str,
    gradient_sync: str = "every_micro_batch",
) -> dict[str, AxisComm]:
    """Per-axis traffic of one optimizer step; axes of size 1 are left out."""
    step = StepShape(workload, micro_batch, accumulation, activation_checkpointing, gradient_sync)
    placement = group_placement(layout, cluster.gpus_per_node)
    out: dict[str, AxisComm] = {}
    for axis, traffic_of in AXIS_TRAFFIC.items():
        got = traffic_of(model, layout, step)
        if got is None:
            continue
        crosses, per_node = placement[axis]
        size = group_size(layout, axis)
        bandwidth, latency = cluster.link(crosses, per_node, got.pattern, size)
        every_s = accumulation * (got.every_bytes / bandwidth + got.every_calls * latency)
        last_s = got.last_bytes / bandwidth + got.last_calls * latency
        out[axis] = AxisComm(
            axis,
            accumulation * got.every_bytes + got.last_bytes,
            accumulation * got.every_calls + got.last_calls,
            crosses,
            every_s + last_s,
            last_s,
            per_node,
            got.pattern,
            size,
        )
    return out
