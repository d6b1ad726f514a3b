"""Bytes each GPU sends per optimizer step, per parallel axis, and how long that takes.

Ring collectives over n ranks: an all-gather or reduce-scatter of a tensor of M bytes (the full size)
sends (n-1)/n * M from every rank, an all-reduce 2(n-1)/n * M. With m micro-batches per step, b rows
each, s = seq/cp tokens per rank, e bytes per element, h hidden, t = tp, c = cp, f = dp_shard x cp,
r = dp_replicate, P_t the parameters one tp rank holds gathered (P_split/t + P_rep):

fsdp (dp_shard x cp)   all-gather e*P_t per micro-batch in forward, again in backward for the units
                       resharded after forward (all layers but the last, the untied embedding);
                       reduce-scatter of fp32 gradients 4*P_t per reduction (once per step, or per
                       micro-batch when gradients are reduced every micro-batch)
dp_replicate (HSDP)    all-reduce of the fp32 gradient shard 4*P_t/f per reduction
tp (sequence parallel) per layer and micro-batch: all-gather + reduce-scatter of e*b*s*h before/after
                       attention and the MLP, in forward and backward: 8 collectives; 4 more when
                       checkpointing recomputes the forward; 4 for embedding and lm_head; the
                       vocabulary-parallel loss adds 3 all-reduces of b*s floats
cp                     K/V of one rank: kvb = e*2*kv/t*b*s bytes, per layer and micro-batch:
                       allgather: (c-1)*kvb all-gather in forward, (c-1)*kvb reduce-scatter in backward;
                       ring: (c-1) K/V sends forward, (c-1) K/V + c fp32 dK/dV sends backward;
                       alltoall: 4 all-to-alls (q, k, v, out) forward and 4 backward, (c-1)/c of each;
                       checkpointing repeats the forward part

Time per axis = bytes / link bandwidth + collectives * latency, on NVLink when the axis' groups stay
inside a node and on the network otherwise (``hardware.groups_cross_nodes``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndparallel.layout import Layout
from ndparallel.planner.activations import kv_width_alltoall
from ndparallel.planner.hardware import Cluster, groups_cross_nodes
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
    """Transfer time if nothing overlapped it."""

    def to_dict(self) -> dict:
        return asdict(self)


def _ring(n: int) -> float:
    return (n - 1) / n


def comm_per_step(model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, *, micro_batch: int,
                  accumulation: int, activation_checkpointing: str, grad_sync: str = "last") -> dict[str, AxisComm]:
    """Per-axis traffic of one optimizer step; axes of size 1 are left out."""
    e, t, c, f, r = workload.compute_bytes, layout.tp, layout.cp, layout.fsdp_size, layout.dp_replicate
    b, m, L = micro_batch, accumulation, model.layers
    s = workload.seq_len // c
    recompute = activation_checkpointing != "none"
    reductions = 1 if grad_sync == "last" else m
    layer_t = model.layer_split_params() / t + model.layer_replicated_params()
    p_t = model.split_params() / t + model.replicated_params()
    trainable_t = lora_params(model, workload.lora_rank) / t if workload.lora_rank else p_t
    units = L + 1 + (0 if model.tied else 2)  # layers, root, and (untied) embedding + [norm, lm_head]
    cross = groups_cross_nodes(layout, cluster.gpus_per_node)
    out: dict[str, AxisComm] = {}

    def add(axis: str, nbytes: float, collectives: int, crosses: bool) -> None:
        bandwidth, latency = cluster.link(crosses)
        out[axis] = AxisComm(axis, nbytes, collectives, crosses, nbytes / bandwidth + collectives * latency)

    if f > 1:
        regather = (L - 1) * layer_t + (0 if model.tied else model.vocab * model.hidden / t)
        gather = m * e * (p_t + regather) * _ring(f)
        scatter = reductions * 4 * trainable_t * _ring(f)
        add("fsdp", gather + scatter, m * (units + L) + reductions * units, cross["fsdp"])
    if r > 1:
        add("dp_replicate", reductions * 4 * trainable_t / f * 2 * _ring(r), reductions * units, cross["dp_replicate"])
    if t > 1:
        per_collective = e * b * s * model.hidden * _ring(t)
        n = L * (8 + (4 if recompute else 0)) + 4
        loss = 3 * 4 * b * s * 2 * _ring(t)
        add("tp", m * (n * per_collective + loss), m * (n + 3), cross["tp"])
    if c > 1:
        kvb = e * 2 * model.kv_dim / t * b * s
        method = layout.cp_comm_strategy
        if method == "allgather":
            per_layer, calls = (c - 1) * kvb * (2 + recompute), 2 + recompute
        elif method == "ring":
            per_layer = (c - 1) * kvb * (2 + recompute) + c * kvb * 4 / e
            calls = (c - 1) * (2 + recompute) + c
        else:
            sizes = e * b * s * (2 * model.q_dim + 2 * kv_width_alltoall(model, layout)) / t
            per_layer, calls = sizes * _ring(c) * (2 + recompute), 4 * (2 + recompute)
        add("cp", m * L * per_layer, m * L * calls, cross["cp"])
    return out
