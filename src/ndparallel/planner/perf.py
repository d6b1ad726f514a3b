"""Step time of one optimizer step on one GPU: the parts (``parts.py``) and the communication that is not
hidden behind them (``comm.py``).

With m micro-batches, C the compute of one micro-batch (linear + attention + pointwise + loss + FSDP's
copies) and O the optimizer:

    step = m * C + O + exposed communication

What is exposed (the overlap is stated, not measured: no multi-GPU machine was lent):
- tp: every collective (sequence-parallel all-gathers and reduce-scatters; the next op needs the result).
- cp: allgather and alltoall collectives (exposed, the same reason); ring sends overlap each block's
  attention: max(0, ring traffic - attention time).
- fsdp and dp_replicate run on side streams while the micro-batch computes: per micro-batch,
  max(first gather + last reduction of one unit each, traffic issued in it - ``Cluster.overlap`` x C).
  Reductions deferred to the last micro-batch (gradient_sync 'last_micro_batch', and the replicas' all-reduce in
  both modes) are issued in the last micro-batch only, so they hide behind its compute alone.
- activation offload (``offload``): each offloaded layer's input crosses the host link twice per micro-batch,
  on a side stream: to the host while its layer computes forward, back while the layer above runs its
  recompute and backward (``parallel/offload.py``). Charged is what a copy takes beyond the compute it
  overlaps, one layer's forward and three times that: K x (max(0, copy - f) + max(0, copy - 3f)) per
  micro-batch, copy = its bytes at ``Efficiency.host_copy`` of ``GpuSpec.host_link_gbps``, f = the micro-batch's
  layer compute / (4 L) (forward, recompute and a backward of twice the forward). An assumption, not a
  measurement of the copies; on the H200 (1B, 131,072 tokens, compiled) the run with 15 layers offloaded and
  the tiled MLP was not slower than without (43,965 and 40,480 tokens/s), where a 0.5 GiB copy takes ~10 ms at
  PCIe Gen5 against ~45 ms of layer forward: nothing charged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndparallel.mesh.layout import Layout
from ndparallel.planner.comm import AxisComm
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.memory import lora_params, offloaded_layer_bytes
from ndparallel.planner.parts import (
    KINDS,
    MicroBatch,
    attention_pairs,
    flat_path,
    flat_upcast_s,
    fsdp_copy_s,
    micro_batch_parts,
    optimizer_s,
)
from ndparallel.planner.rates import Rates
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload

BACKGROUND_AXES = ("fsdp", "dp_replicate")


@dataclass(frozen=True)
class StepTime:
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of GPU work over the whole step by kind (``parts.KINDS``)."""
    exposed_comm_s: dict[str, float] = field(default_factory=dict)
    """Seconds of communication not hidden by compute, by axis."""

    @property
    def compute_s(self) -> float:
        return sum(self.parts.values())

    @property
    def attention_s(self) -> float:
        return self.parts.get("attention", 0.0)

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.exposed_comm_s.values())


def step_flops(
    model: ModelShape, layout: Layout, workload: Workload, activation_checkpointing: str
) -> tuple[float, float]:
    """(all matmul and attention FLOPs, attention FLOPs) of one optimizer step over all GPUs, recomputation
    included: 6 per weight per token (4 under LoRA, + 6 per adapter weight), 2 more with full checkpointing;
    attention 4*d per visible pair and head forward, twice that backward."""
    n = model.matmul_params()
    dense = 4 * n + 6 * lora_params(model, workload.lora_rank) if workload.lora_rank else 6 * n
    forward_attn = 4 * model.q_dim * model.layers * attention_pairs(workload.seq_len, workload.attended_keys)
    attn = 3 * forward_attn
    if activation_checkpointing == "full":
        dense += 2 * n
        attn += forward_attn
    return workload.tokens * dense + workload.rows * attn, workload.rows * attn


def _background(comm: dict[str, AxisComm], compute: float, m: int, units: int, overlap: float) -> float:
    """Exposed seconds of the FSDP / HSDP traffic over m micro-batches of ``compute`` seconds each."""
    axes = [comm[a] for a in BACKGROUND_AXES if a in comm]
    if not axes:
        return 0.0
    every = sum(a.seconds - a.last_only_s for a in axes) / m
    last = sum(a.last_only_s for a in axes)
    floor_every = 2 * every / units
    earlier = (m - 1) * max(floor_every, every - overlap * compute)
    return earlier + max(floor_every + last / units, every + last - overlap * compute)


def step_time(
    model: ModelShape,
    layout: Layout,
    workload: Workload,
    cluster: Cluster,
    comm: dict[str, AxisComm],
    *,
    micro_batch: int,
    accumulation: int,
    activation_checkpointing: str,
    gradient_sync: str = "every_micro_batch",
    tiled_mlp: bool = False,
    offload_layers: int = 0,
) -> StepTime:
    """One optimizer step of ``accumulation`` micro-batches of ``micro_batch`` rows on one GPU."""
    rates, m = cluster.rates, accumulation
    mb = MicroBatch(model, layout, workload, micro_batch, activation_checkpointing, tiled_mlp, offload_layers)
    per_mb = micro_batch_parts(mb, rates)
    resharded = layout.dp_replicate * layout.fsdp_size > 1  # parallel/fsdp.py: one rank keeps units gathered
    reductions = m if gradient_sync == "every_micro_batch" else 1
    parts = {kind: m * seconds for kind, seconds in per_mb.items()}
    if flat_path(layout, workload):
        parts["fsdp_copies"] = flat_upcast_s(model, layout, workload, rates, micro_batches=m)
    else:
        parts["fsdp_copies"] = fsdp_copy_s(
            model,
            layout,
            workload,
            rates,
            gathers=m * (2 if resharded else 1),
            reductions=reductions,
            accumulations=m - reductions,
        )
    parts["optimizer"] = optimizer_s(model, layout, workload, rates, micro_batches=m)
    parts = {kind: parts[kind] for kind in KINDS}

    exposed: dict[str, float] = {}
    if "tp" in comm:
        exposed["tp"] = comm["tp"].seconds
    if "cp" in comm:
        ring = layout.cp_comm_strategy == "ring"
        exposed["cp"] = max(0.0, comm["cp"].seconds - parts["attention"]) if ring else comm["cp"].seconds
    compute_mb = sum(parts[kind] for kind in ("linear", "attention", "pointwise", "loss", "dequantize")) / m
    units = model.layers + 1
    background = _background(comm, compute_mb, m, units, cluster.overlap)
    if background:
        exposed["fsdp+dp_replicate"] = background
    offload = m * offload_exposed_s(mb, rates, per_mb)
    if offload:
        exposed["offload"] = offload
    return StepTime(parts=parts, exposed_comm_s=exposed)


def offload_exposed_s(mb: MicroBatch, rates: Rates, per_mb: dict[str, float]) -> float:
    """Seconds of one micro-batch's offload copies not hidden behind its layers' compute (module docstring)."""
    if not mb.offload_layers or mb.activation_checkpointing != "full":
        return 0.0
    layer_compute = sum(per_mb[kind] for kind in ("linear", "attention", "pointwise", "dequantize"))
    forward = layer_compute / (4 * mb.model.layers)
    copy = rates.host_copy_s(offloaded_layer_bytes(mb.model, mb.layout, mb.workload, mb.rows))
    return mb.offload_layers * (max(0.0, copy - forward) + max(0.0, copy - 3 * forward))
