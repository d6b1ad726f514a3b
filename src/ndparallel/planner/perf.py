"""Compute time and step time of one optimizer step.

FLOPs per token (6 per parameter: 2 forward, 4 backward) over the matmul weights N (layer linears and
the output projection; the embedding lookup is not a product), plus attention's scores and weighted sums:
4 * seq * q FLOPs per token and layer forward (q = heads x head_dim), 12 * seq * q with backward. A
causal kernel skips the masked half: plain attention, ring and alltoall CP. Allgather CP passes an
explicit mask, so its kernel computes every score (no halving). Full checkpointing repeats the forward
(+2N and +4*seq*q per layer); LoRA computes no weight gradients for the frozen base: 4N per token, plus 6
per adapter parameter.

Memory-bound work is timed at the HBM bandwidth (``memory_bound_bytes``): recomputed elementwise ops
read and write what checkpointing did not keep, 2 * (recomputed bytes) (selective: norms, activations,
rotary; full: the whole layer, on top of its FLOPs); and CP's own data movement per layer and
micro-batch (estimates from the code in cp_attention.py, not measured):
- ring: every block's output and log-sum-exp merged into fp32 accumulators and the fp32 dQ/dK/dV sums,
  about 10 passes over 4*b*(q/t)*(s/2) bytes for each of the 2cp+1 blocks;
- allgather: the gathered K/V reordered and expanded to the query heads (3 copies forward, 3 backward),
  6*e*b*S*2kv'/t, and the s x S additive mask written, e*s*S;
- alltoall: reorders before and after each all-to-all, 4*e*b*s*(2q + 2kv'')/t.

Step time = compute + exposed communication, where (Cluster.overlap = fraction of compute that can hide
traffic):
- tp and allgather/alltoall cp collectives are exposed: the next op needs their result;
- ring cp hides behind the attention of the block in flight: exposed max(0, ring - attention time);
- fsdp and dp_replicate are prefetched / reduced on side streams: exposed max(first and last unit,
  fsdp + dp_replicate - overlap * compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.layout import Layout
from ndparallel.planner.activations import kv_width_allgather, kv_width_alltoall
from ndparallel.planner.comm import AxisComm
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import lora_params
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload

# torch leaves TF32 off for matmuls by default: fp32 runs on the plain fp32 units, 67 of the 989 TFLOP/s
# an H100/H200 SXM has for bf16.
FP32_RATE = 67.0 / 989.0


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    """Matmul and attention FLOPs at the achievable rate, recomputation included."""
    attention_s: float
    memory_bound_s: float
    """HBM-bound time: recomputed elementwise ops, CP merges and reorders."""
    exposed_comm_s: dict[str, float]

    @property
    def step_s(self) -> float:
        return self.compute_s + self.memory_bound_s + sum(self.exposed_comm_s.values())


def step_flops(model: ModelShape, layout: Layout, workload: Workload,
               activation_checkpointing: str) -> tuple[float, float]:
    """(all FLOPs, attention FLOPs) of one optimizer step over all GPUs."""
    tokens, seq, L, q = workload.tokens, workload.seq_len, model.layers, model.q_dim
    n = model.matmul_params()
    causal = 1.0 if (layout.cp > 1 and layout.cp_comm_strategy == "allgather") else 0.5
    attn_fwd = 4 * seq * q * L * causal
    if workload.lora_rank:
        dense = 4 * n + 6 * lora_params(model, workload.lora_rank)
    else:
        dense = 6 * n
    attn = 3 * attn_fwd
    if activation_checkpointing == "full":
        dense += 2 * n
        attn += attn_fwd
    return tokens * (dense + attn), tokens * attn


def step_time(model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster,
              comm: dict[str, AxisComm], activation_checkpointing: str, memory_bound: float = 0.0) -> StepTime:
    """``memory_bound``: bytes of memory-bound traffic per step on one GPU (``memory_bound_bytes``)."""
    total, attn = step_flops(model, layout, workload, activation_checkpointing)
    rate = cluster.peak_tflops * 1e12 * cluster.efficiency * (FP32_RATE if workload.precision == "fp32" else 1.0)
    compute = total / layout.world_size / rate
    attention = attn / layout.world_size / rate
    exposed: dict[str, float] = {}
    for axis in ("tp", "cp"):
        if axis in comm:
            exposed[axis] = comm[axis].seconds
    if "cp" in comm and layout.cp_comm_strategy == "ring":
        exposed["cp"] = max(0.0, comm["cp"].seconds - attention)
    background = sum(comm[a].seconds for a in ("fsdp", "dp_replicate") if a in comm)
    if background:
        units = model.layers + 1
        floor = 2 * background / units  # the first all-gather and the last reduction have nothing to hide behind
        exposed["fsdp+dp_replicate"] = max(floor, background - cluster.overlap * compute)
    return StepTime(compute_s=compute, attention_s=attention, memory_bound_s=memory_bound / (cluster.hbm_gbps * 1e9),
                    exposed_comm_s=exposed)


def memory_bound_bytes(model: ModelShape, layout: Layout, workload: Workload, *, micro_batch: int, accumulation: int,
                       layer_recompute: float) -> float:
    """HBM traffic per step on one GPU that no matmul hides: recomputation and CP data movement."""
    t, c, e, b, seq = layout.tp, layout.cp, workload.compute_bytes, micro_batch, workload.seq_len
    s = seq // c
    per_layer = 2 * layer_recompute
    if c > 1:
        method = layout.cp_comm_strategy
        if method == "ring":
            per_layer += (2 * c + 1) * 10 * 4 * b * model.q_dim / t * s / 2
        elif method == "allgather":
            per_layer += 6 * e * b * seq * 2 * kv_width_allgather(model) / t + e * s * seq
        else:
            per_layer += 4 * e * b * s * (2 * model.q_dim + 2 * kv_width_alltoall(model, layout)) / t
    return accumulation * model.layers * per_layer
