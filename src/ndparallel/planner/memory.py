"""Peak memory of one GPU for a layout, itemized, in bytes.

With P_split the parameters tensor parallelism splits and P_rep the ones it replicates (norms),
f = dp_shard x cp the FSDP shard group and t = tp, one GPU holds P_local = P_split/(t*f) + P_rep/f of
every parameter (dp_replicate copies the shards, dividing nothing). With e bytes per compute element:

    master_params     4 * P_local           fp32 master weights (LoRA: frozen base in e bytes, adapters fp32)
    grads             4 * P_local           fp32 sharded gradients (trainable parameters only)
    optimizer         8 * P_local           AdamW exp_avg and exp_avg_sq, fp32
    working_params    e * (2*P_layer/t + V*h/t)   gathered weights in flight: the layer running and the
                      one prefetched (or kept: the last layer is not resharded after forward), and the
                      vocabulary matrix FSDP keeps gathered from forward to backward (lm_head, or the
                      tied embedding in the root unit)
    accumulated_grads 4 * P_trainable/t     only with gradient accumulation that reduces on the last
                      micro-batch: FSDP keeps every unsharded gradient in fp32 between micro-batches
    activations       see activations.py: all layers + embedding + head, for one micro-batch
    transient         the largest of three moments beyond the retained activations:
                      loss (backward of the chunked cross-entropy): the logits and their gradient,
                      2e * b*s*V/t, + float32 temporaries of one or two CHUNK_ROWS-row chunks
                      (activations.loss_peak; no full float32 copy of the logits is ever made);
                      head backward: the logits (the trainer holds them through backward) and their
                      gradient, 2e * b*s*V/t, + lm_head's unsharded gradient and its fp32 reduce-scatter
                      input (e + 4) * V*h/t;
                      layer backward: what checkpointing recomputes + activation gradients
                      e*b*s*(2h + 3i/t) + the unit's gradient buffers (e + 4) * P_layer/t + CP buffers
                      + the logits the trainer still holds, e * b*s*V/t
    overhead          fixed: CUDA context, NCCL, fragmentation (Cluster.overhead_gib)

``allocated`` (everything but the overhead) is what ``torch.cuda.max_memory_allocated`` measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndparallel.layout import Layout
from ndparallel.planner.activations import activation_bytes, kv_width_allgather, kv_width_alltoall, loss_peak
from ndparallel.planner.hardware import GIB, Cluster
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU peak memory, bytes, by what holds it."""

    master_params: float
    working_params: float
    grads: float
    accumulated_grads: float
    optimizer: float
    activations: float
    transient: float
    transient_kind: str
    """Which moment sets the peak: 'loss', 'head backward' or 'layer backward'."""
    overhead: float

    @property
    def allocated(self) -> float:
        """Peak of what PyTorch allocates (compare with torch.cuda.max_memory_allocated)."""
        return (self.master_params + self.working_params + self.grads + self.accumulated_grads + self.optimizer
                + self.activations + self.transient)

    @property
    def total(self) -> float:
        return self.allocated + self.overhead

    def items(self) -> dict[str, float]:
        out = {k: v for k, v in asdict(self).items() if k != "transient_kind"}
        return {**out, "allocated": self.allocated, "total": self.total}

    def summary(self) -> str:
        parts = [f"{k} {v / GIB:.1f}" for k, v in self.items().items() if v and k not in ("allocated", "total")]
        return f"{self.total / GIB:.1f} GiB = " + " + ".join(parts)


def local_params(model: ModelShape, layout: Layout) -> float:
    """Parameters of the model one GPU holds a shard of (tp split, then FSDP over dp_shard x cp)."""
    f = layout.fsdp_size
    return model.split_params() / (layout.tp * f) + model.replicated_params() / f


def lora_params(model: ModelShape, rank: int | None) -> int:
    return model.layers * model.lora_params_per_layer(rank) if rank else 0


def cp_buffer_bytes(model: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Transient CP exchange buffers of one layer (beyond what attention saves).

    allgather: the gathered K/V and its reordered copy, then in backward the gradients of the (expanded)
    K/V and the reduce-scatter input: b*S*e*(2kv' + 2kv)/t. ring: two K/V blocks in flight, two fp32
    dK/dV accumulators, the fp32 dQ and output accumulators: b*s*(4e*kv + 16*kv + 8q)/t. alltoall: the
    all-to-all inputs and outputs of q, k, v: 2e*b*s*(q + 2kv'')/t.
    """
    t, c = layout.tp, layout.cp
    if c == 1:
        return 0.0
    s, kv, q = seq // c, model.kv_dim, model.q_dim
    if layout.cp_comm_strategy == "allgather":
        return b * seq * e * (2 * kv_width_allgather(model) + 2 * kv) / t
    if layout.cp_comm_strategy == "ring":
        return b * s * (4 * e * kv + 16 * kv + 8 * q) / t
    return 2 * e * b * s * (q + 2 * kv_width_alltoall(model, layout)) / t


def estimate_memory(model: ModelShape, layout: Layout, workload: Workload, *, micro_batch: int = 1,
                    activation_checkpointing: str | None = None, accumulation: int = 1, grad_sync: str = "last",
                    cluster: Cluster | None = None) -> MemoryEstimate:
    """Peak memory of one GPU training ``model`` on ``layout`` (see the module docstring for each term).

    ``activation_checkpointing`` defaults to the workload's mode ('none' when the workload says 'auto');
    ``accumulation`` micro-batches per step with ``grad_sync`` 'last' keep unsharded fp32 gradients.
    """
    mode = activation_checkpointing or workload.ac_modes[0]
    cluster = cluster or Cluster()
    e, t, seq, b = workload.compute_bytes, layout.tp, workload.seq_len, micro_batch
    s = seq // layout.cp
    h, v = model.hidden, model.vocab

    p_local = local_params(model, layout)
    if workload.lora_rank:
        adapters = lora_params(model, workload.lora_rank) / (t * layout.fsdp_size)
        master = e * p_local + 4 * adapters
        trainable_local, trainable_tp = adapters, lora_params(model, workload.lora_rank) / t
        unit_grad = model.lora_params_per_layer(workload.lora_rank) / t
        head_grad = 0.0
    else:
        master = 4 * p_local
        trainable_local, trainable_tp = p_local, model.split_params() / t + model.replicated_params()
        unit_grad = model.layer_split_params() / t + model.layer_replicated_params()
        head_grad = v * h / t
    layer_tp = model.layer_split_params() / t + model.layer_replicated_params()
    working = e * (2 * layer_tp + v * h / t)
    reduce_bytes = e + (4 if e != 4 else 0)  # unsharded grad in compute dtype + its fp32 reduce-scatter input

    acts = activation_bytes(model, layout, seq, b, mode, e, workload.lora_rank)
    kept = acts.layers + acts.embedding + acts.head
    moments = {
        "loss": loss_peak(model, layout, seq, b, e),
        # train.forward_backward keeps ``logits`` referenced until loss.backward() returns.
        "head backward": 2 * e * b * s * v / t + reduce_bytes * head_grad,
        "layer backward": (acts.layer_recompute + e * b * s * (2 * h + 3 * model.intermediate / t)
                           + reduce_bytes * unit_grad + cp_buffer_bytes(model, layout, seq, b, e)
                           + e * b * s * v / t),
    }
    kind = max(moments, key=moments.get)
    return MemoryEstimate(
        master_params=master,
        working_params=working,
        grads=4 * trainable_local,
        accumulated_grads=4 * trainable_tp if accumulation > 1 and grad_sync == "last" else 0.0,
        optimizer=8 * trainable_local,
        activations=kept,
        transient=moments[kind],
        transient_kind=kind,
        overhead=cluster.overhead_gib * GIB,
    )
