"""Peak memory of one GPU for a layout, itemized, in bytes, for the eager (not compiled) trainer step.

Memory is not one sum of everything: gradients appear only during backward, activations are gone by
the optimizer step. The peak is the largest of five moments of a step (``memory_moments``), each
itemized the same way. With P_split the parameters tensor parallelism splits and P_rep the ones it
replicates (norms), f = dp_shard x cp the FSDP shard group and t = tp, one GPU holds P_local =
P_split/(t*f) + P_rep/f of every parameter (dp_replicate copies the shards, dividing nothing); P_tp =
P_split/t + P_rep is a tp rank's unsharded share, e bytes per compute element, n = b*seq/cp tokens.

Always present (from the first optimizer step on):
    master_params     4 * P_local           fp32 master weights (2 * P_local: bf16 weights, ``bf16: full``).
                                            Under LoRA the frozen base is stored in the
                      compute dtype (``freeze.store_frozen_in``), e * P_local, + 4 * adapters; a quantized
                      base's linears at QUANTIZED_BYTES_PER_VALUE instead of e
    optimizer         8 * T_local           AdamW exp_avg and exp_avg_sq, fp32, of the trainable T (8-bit AdamW:
                                            EIGHT_BIT_STATE_BYTES * T_local) (fused
                      AdamW updates in place: no temporaries)
    workspace         64 MiB                cuBLAS/cuBLASLt workspaces, allocated through PyTorch's caching
                      allocator on the first matmul and kept (GPU_WORKSPACE_BYTES, measured)
Depending on the moment:
    working_params    the gathered compute-dtype copies. FSDP over one rank (dp_replicate x f = 1) keeps
                      every unit gathered from forward to backward (``parallel/fsdp.py``): e * P_tp until
                      each unit's post-backward frees its own. Otherwise the last layer and the vocabulary
                      unit stay gathered after forward, e * (P_layer/t + V*h/t), and backward holds the
                      layer running and the one prefetched (+ the tied embedding's root unit).
    grads             fp32 sharded gradients: none until backward reduces them (the previous step's were
                      freed by ``zero_grad(set_to_none=True)``), 4 * T_local at the optimizer step; with
                      accumulation and gradient_sync 'every_micro_batch' (the default: reduce-scatter every
                      micro-batch), all of them from the second micro-batch on
    accumulated_grads only with accumulation and gradient_sync 'last_micro_batch' (nothing reduced before the last
                      micro-batch): every FSDP unit keeps its unsharded fp32 gradient, 4 * T_tp
    activations       what forward kept (activations.py): all layers + embedding + head
    transient         what the moment adds on top
Each unit's gradient reduction (FSDP ``foreach_reduce``) allocates an fp32 reduce-scatter input of the
unit's unsharded gradient (x elements per tp rank) and an output of x/f; with one rank in the shard group
the "reduce-scatter" is ``output.copy_(input / divide_factor)``, one more fp32 temporary of x (torch 2.11
and 2.13 make it even for the factor 1.0 that ``_compat.set_gradient_sum`` sets; later releases may skip
it): reduce(x) = 4x * (1 + 1/f) (+ 4x when f = 1). The moments:
    loss              backward of the chunked cross-entropy: the logits, their gradient and the chunk's
                      float32 temporaries (activations.loss_peak; no full float32 copy is ever made); with the
                      fused loss (the trainer's default) its forward, which makes the gradients: lm_head's
                      input, its float32 weight gradient, one chunk's logits and temporaries
                      (activations.fused_loss_peak)
    head backward     the logits (the trainer holds them until ``loss.backward()`` returns) and their
                      gradient, 2e * n*V/t, + lm_head's unsharded gradient e * V*h/t (or, untied, its
                      unit's reduction once the gradient of the logits and the unit's copy are freed); fused:
                      the float32 weight gradient and its cast to the weight's dtype, (4 + e) * V*h/t
    layer backward    a layer's backward beyond the kept activations (``backward.py``): the larger of its MLP
                      and attention stages (what checkpointing recomputes, the gradients and the kernels'
                      buffers, CP's), at the layer of the backward where the kept inputs and finished
                      gradients add up to the most (with activation offload: the layer inputs prefetched
                      from the host); or the first layer's reduction once its activations and copy are freed;
                      + the logits the trainer holds (unfused), + the tied embedding's unsharded gradient from
                      lm_head (kept until the root unit reduces at the end). The head's activations are gone
                      by then (freed by its backward: counted on CPU); the labels stay.
    end of backward   every other unit's sharded gradient + the logits + the embedding unit's reduction
                      (its gathered copy is freed first), or the embedding backward just before it
    optimizer step    gradients, master weights and AdamW states only
    overhead          fixed: CUDA context, NCCL, fragmentation (Cluster.overhead_gib)
Activation offload puts the first K layers' inputs in pinned host memory: ``offload_host_bytes`` per node
(every GPU's, each layer's input in a block of the next power of two, as PyTorch's pinned allocator hands
them out), which must fit in ``offload.HOST_SHARE`` of ``Cluster.host_bytes`` (``evaluate.py``); K is the
run's, or as many as that holds (``offload_layers_for``, the trainer's rule).
A world of one on the engine's flat path (no FSDP; ``Workload.single_rank_fsdp`` False, bf16) differs where
its buffers do (``_flat_path_rows``): the compute copies stay at every moment, gradients are bf16 until the
end of backward, and with ``Workload.master_grads`` the fp32 ones are made while the bf16 ones still exist.

``allocated`` (everything but the overhead) is what ``torch.cuda.max_memory_allocated`` measures; on the
H200 it is within 0.01% of every measured world-1 eager case (1B and 3B on FSDP over one rank, three
checkpointing modes, sequences of 2k to 128k tokens; a Llama-2-7B layer shape on the flat path) and 0.3% of
the LoRA ones, see ``benchmarks/results/planner_validation.md``; with torch.compile
(``Workload.compile``) within 5% (activations.py says what compile changes). With the fused loss (1B,
compiled, 4096 x 2 and 131,072 tokens) within 0.01%; with the tiled MLP and offload 1.4-2.1% high (backward.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndparallel.mesh.layout import Layout
from ndparallel.parallel.offload import host_bytes_per_layer, layers_host_holds
from ndparallel.planner.activations import (
    ActivationBytes,
    activation_bytes,
    fused_head_backward,
    fused_loss_peak,
    kv_width_allgather,
    kv_width_alltoall,
    loss_peak,
)
from ndparallel.planner.backward import attention_stage, mlp_stage, position_extra
from ndparallel.planner.hardware import GIB, Cluster
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload

# cuBLAS and cuBLASLt workspaces (torch allocates them through the caching allocator at the first matmul
# and keeps them, so torch.cuda.max_memory_allocated counts them). Measured on the H200 (torch 2.11): the
# first sweep case's memory after init was exactly the fp32 parameters (4.604 GiB for the 1B), every
# later case's 4.666 GiB, 64 MiB more.
GPU_WORKSPACE_BYTES = 64 * 2**20

MOMENTS = ("loss", "head backward", "layer backward", "end of backward", "optimizer step")

# Bytes per value of a quantized frozen base weight (``ndparallel.quantized``). NF4: a 4-bit code, one int8
# scale per block of 64 values and one float32 factor per 256 scales (double quantization); int8: a one-byte
# code (plus one scale per output row in the compute dtype, counted per row). H200, 8B and 1B LoRA, eager and
# compiled, three checkpointing modes: the peaks drop from a bf16 base's by these bytes to within 0.01 GiB.
# fp8: int8's layout with e4m3 codes (not yet measured against a peak).
QUANTIZED_BYTES_PER_VALUE = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0, "fp8": 1.0}
ROW_SCALED = ("int8", "fp8")


def quantized_saving(model: ModelShape, workload: Workload) -> float:
    """Bytes one layer's quantized linears take less than in the compute dtype (0 without a quantized base),
    whole (before tp and FSDP split them)."""
    fmt = workload.quantized_base
    if fmt is None:
        return 0.0
    e, weights = workload.compute_bytes, model.layer_linear_weights()
    stored = QUANTIZED_BYTES_PER_VALUE[fmt] * weights + (e * model.layer_linear_rows() if fmt in ROW_SCALED else 0)
    return e * weights - stored


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory, bytes, by what holds it, at the moment of the step that peaks."""

    master_params: float
    working_params: float
    grads: float
    accumulated_grads: float
    optimizer: float
    activations: float
    transient: float
    transient_kind: str
    """Which moment sets the peak: one of ``MOMENTS``."""
    workspace: float
    overhead: float

    @property
    def allocated(self) -> float:
        """Peak of what PyTorch allocates (compare with torch.cuda.max_memory_allocated)."""
        return (
            self.master_params
            + self.working_params
            + self.grads
            + self.accumulated_grads
            + self.optimizer
            + self.activations
            + self.transient
            + self.workspace
        )

    @property
    def total(self) -> float:
        return self.allocated + self.overhead

    def items(self) -> dict[str, float]:
        out = {k: v for k, v in asdict(self).items() if k != "transient_kind"}
        return {**out, "allocated": self.allocated, "total": self.total}

    def summary(self) -> str:
        parts = [f"{k} {v / GIB:.1f}" for k, v in self.items().items() if v and k not in ("allocated", "total")]
        return f"{self.total / GIB:.1f} GiB at {self.transient_kind} = " + " + ".join(parts)


def local_params(model: ModelShape, layout: Layout) -> float:
    """Parameters of the model one GPU holds a shard of (tp split, then FSDP over dp_shard x cp)."""
    f = layout.fsdp_size
    return model.split_params() / (layout.tp * f) + model.replicated_params() / f


def lora_params(model: ModelShape, rank: int | None) -> int:
    return model.layers * model.lora_params_per_layer(rank) if rank else 0


def reduce_bytes(x: float, f: int) -> float:
    """FSDP's buffers to reduce a unit's gradient of ``x`` elements (per tp rank) over an f-rank shard group:
    the fp32 reduce-scatter input and output, and with f = 1 the temporary of ``input / divide_factor``."""
    return 4 * x * (1 + 1 / f + (1 if f == 1 else 0))


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


@dataclass(frozen=True)
class _Weights:
    """What the parameters hold on one GPU, and the per-unit sizes the moments need (module docstring)."""

    master: float
    optimizer: float
    grads_all: float
    """4 * T_local: every fp32 gradient shard (2 * T_local in bf16 with ``bf16_weights``)."""
    grad_bytes: int
    """Bytes of a sharded gradient value: 4, or 2 with ``bf16_weights``."""
    trainable_local: float
    trainable_tp: float
    unit_trainable: float
    """A decoder layer's trainable parameters per tp rank."""
    embed_trainable: float
    head_trainable: float
    vocab_tp: float
    layer_w: float
    """A gathered layer's compute copy, bytes."""
    vocab_w: float
    w_forward: float
    w_layer: float


def _weights(model: ModelShape, layout: Layout, workload: Workload) -> _Weights:
    e, t, f = workload.compute_bytes, layout.tp, layout.fsdp_size
    h, rank = model.hidden, workload.lora_rank
    single = layout.dp_replicate * f == 1  # parallel/fsdp.py: nothing is resharded after forward
    layer_tp = model.layer_split_params() / t + model.layer_replicated_params()
    adapter_layer_tp = model.lora_params_per_layer(rank) / t if rank else 0.0
    vocab_tp = model.vocab * h / t
    all_tp = model.split_params() / t + model.replicated_params() + lora_params(model, rank) / t
    p_local = local_params(model, layout)
    if rank:
        # The frozen base is stored in the compute dtype (freeze.store_frozen_in): e bytes, not 4.
        # ... and a quantized base's linears in their codes
        frozen = e * p_local - model.layers * quantized_saving(model, workload) / (t * f)
        if workload.embedding_offload and single and t == 1 and not model.tied:
            frozen -= e * vocab_tp  # the input embedding's table waits in host memory
        adapters = lora_params(model, rank) / (t * f)
        master, trainable_local, trainable_tp = frozen + 4 * adapters, adapters, lora_params(model, rank) / t
        unit_trainable, embed_trainable = adapter_layer_tp, 0.0
    else:
        master, trainable_local = workload.master_bytes * p_local, p_local
        trainable_tp = model.split_params() / t + model.replicated_params()
        unit_trainable = layer_tp
        # the unit the embedding is in: the root (with the final norm) when tied, its own unit otherwise
        embed_trainable = vocab_tp + (h if model.tied else 0)
    # a unit's gathered copy: a quantized base is gathered as its codes
    layer_w = e * (layer_tp + adapter_layer_tp) - quantized_saving(model, workload) / t
    vocab_w = e * (vocab_tp + h)
    if single and rank:  # the one-rank path computes with the stored frozen base: only adapters are cast
        w_forward = w_layer = e * lora_params(model, rank) / t
    elif single and workload.bf16_weights:  # bf16 weights are computed with as they are: no copies
        w_forward = w_layer = 0.0
    elif single:  # untied: lm_head's unit was freed after its backward
        w_forward = e * all_tp
        w_layer = w_forward - (0.0 if model.tied else vocab_w)
    else:
        w_forward = layer_w + vocab_w
        w_layer = 2 * layer_w + (vocab_w if model.tied else 0.0)
    return _Weights(
        master=master,
        optimizer=workload.optimizer_state_bytes * trainable_local,
        grads_all=workload.master_bytes * trainable_local,
        grad_bytes=workload.master_bytes,
        trainable_local=trainable_local,
        trainable_tp=trainable_tp,
        unit_trainable=unit_trainable,
        embed_trainable=embed_trainable,
        head_trainable=0.0 if rank or model.tied else vocab_tp + h,  # untied lm_head's unit (with the final norm)
        vocab_tp=vocab_tp,
        layer_w=layer_w,
        vocab_w=vocab_w,
        w_forward=w_forward,
        w_layer=w_layer,
    )


@dataclass(frozen=True)
class _Step:
    """One candidate's shape: the micro-batch, checkpointing, features and accumulation the moments follow."""

    micro_batch: int
    mode: str
    tiled: bool
    offloaded: int
    accumulating: bool
    flat: bool


def _loss_and_head(model: ModelShape, layout: Layout, workload: Workload, w: _Weights, step: _Step):
    """(the loss's transient, lm_head's backward on FSDP, on the flat path, the logits the trainer holds)."""
    e, t, f, b, rank = workload.compute_bytes, layout.tp, layout.fsdp_size, step.micro_batch, workload.lora_rank
    seq = workload.seq_len
    if workload.fused_loss:  # no logits: lm_head's gradient is made in the loss's forward (activations.py)
        loss = fused_loss_peak(model, layout, seq, b, e, compiled=workload.compile, lora_rank=rank)
        head = head_plain = fused_head_backward(model, layout, e, rank)
        logits = 0.0
        if w.head_trainable:  # untied lm_head's unit reduces once its gradient is cast, its copy freed first
            head = max(head, reduce_bytes(w.head_trainable, f) - w.vocab_w)
        return loss, head, head_plain, logits
    logits = e * b * (seq // layout.cp) * model.vocab / t
    loss = loss_peak(model, layout, seq, b, e, workload.compile)
    head = head_plain = 2 * logits + (0.0 if rank else e * w.vocab_tp)
    if w.head_trainable:  # untied lm_head's unit reduces once the logits' gradient is gone, its copy freed first
        head = max(head, logits + reduce_bytes(w.head_trainable, f) - w.vocab_w)
    return loss, head, head_plain, logits


def _layer_backward(
    model: ModelShape, layout: Layout, workload: Workload, w: _Weights, step: _Step, acts: ActivationBytes
) -> float:
    """The most a layer's backward adds to the kept activations, over its stages and over the layers of the
    backward (``backward.py``); without FSDP's reductions."""
    e, b, seq, rank = workload.compute_bytes, step.micro_batch, workload.seq_len, workload.lora_rank
    compiled, tiled = workload.compile, step.tiled and step.mode != "selective"
    selective = step.mode == "selective"
    tiles = workload.tiled_mlp_num_shards
    mlp = mlp_stage(
        model,
        layout,
        seq,
        b,
        e,
        acts,
        compiled=compiled,
        tiled=tiled,
        selective=selective,
        lora_rank=rank,
        num_tiles=tiles,
    )
    cp = cp_buffer_bytes(model, layout, seq, b, e)
    attention = attention_stage(
        model, layout, seq, b, e, acts, step.mode, compiled=compiled, lora_rank=rank, cp_buffers=cp
    )
    if step.accumulating:
        grad = 0.0  # added into the gradients the earlier micro-batches made
    elif step.flat and workload.bf16_weights:
        grad = 0.0  # the whole bf16 gradient buffer exists from the head's backward on (_flat_path_rows)
    elif step.flat:
        grad = e * w.unit_trainable  # bf16, until the end of backward
    else:
        grad = 4 * w.unit_trainable / layout.fsdp_size  # the reduced float32 shard
    # FSDP over one rank keeps every unit gathered from forward until the unit's own backward is done
    freed_copy = w.layer_w if not step.flat and layout.dp_replicate * layout.fsdp_size == 1 else 0.0
    return max(mlp, attention) + position_extra(model.layers, step.offloaded, acts.per_layer, grad - freed_copy)


def memory_moments(
    model: ModelShape,
    layout: Layout,
    workload: Workload,
    *,
    micro_batch: int = 1,
    activation_checkpointing: str | None = None,
    accumulation: int = 1,
    gradient_sync: str = "every_micro_batch",
    cluster: Cluster | None = None,
    tiled_mlp: bool | None = None,
    offload_layers: int | None = None,
) -> dict[str, MemoryEstimate]:
    """Memory of one GPU at each moment of a step that can peak (``MOMENTS``; module docstring).

    ``tiled_mlp`` / ``offload_layers`` default to the workload's settings ('auto': off; an offload of None
    layers: as many as ``cluster``'s host memory holds, ``offload_layers_for``)."""
    mode = activation_checkpointing or workload.ac_modes[0]
    cluster = cluster or Cluster()
    tiled = workload.tiled_mlp is True if tiled_mlp is None else tiled_mlp
    if offload_layers is None:
        on = workload.activation_offload is True
        offload_layers = offload_layers_for(model, layout, workload, cluster, micro_batch) if on else 0
    flat = layout.world_size == 1 and not workload.single_rank_fsdp and workload.precision == "bf16"
    step = _Step(micro_batch, mode, tiled, offload_layers if mode == "full" else 0, accumulation > 1, flat)
    w = _weights(model, layout, workload)
    rows = _moment_rows(model, layout, workload, w, step, gradient_sync)
    return {
        kind: MemoryEstimate(
            master_params=w.master,
            working_params=wp,
            grads=g,
            accumulated_grads=a,
            optimizer=w.optimizer,
            activations=k,
            transient=x,
            transient_kind=kind,
            workspace=GPU_WORKSPACE_BYTES,
            overhead=cluster.overhead_gib * GIB,
        )
        for kind, (wp, g, a, k, x) in rows.items()
    }


def _moment_rows(
    model: ModelShape, layout: Layout, workload: Workload, w: _Weights, step: _Step, gradient_sync: str
) -> dict[str, tuple]:
    """moment: (working params, grads, accumulated grads, activations, transient), bytes."""
    e, b, f = workload.compute_bytes, step.micro_batch, layout.fsdp_size
    features = dict(
        fused_loss=workload.fused_loss, tiled=step.tiled and step.mode != "selective", offload_layers=step.offloaded
    )
    seq, rank = workload.seq_len, workload.lora_rank
    acts = activation_bytes(model, layout, seq, b, step.mode, e, rank, workload.compile, **features)
    acc = 4 * w.trainable_tp if step.accumulating and gradient_sync == "last_micro_batch" else 0.0
    earlier = w.grads_all if step.accumulating and gradient_sync == "every_micro_batch" else 0.0
    kept = acts.layers + acts.embedding + acts.head
    # the head's activations are released by its backward; the labels stay with the batch
    kept_in_layers = acts.layers + acts.embedding + 8 * b * (workload.seq_len // layout.cp)
    loss, head, head_plain, logits = _loss_and_head(model, layout, workload, w, step)
    held_head_grad = e * w.vocab_tp if model.tied and not workload.lora_rank else 0.0  # lm_head's share of the tie
    layer = logits + held_head_grad + _layer_backward(model, layout, workload, w, step, acts)
    layer_reduce = reduce_bytes(w.unit_trainable, f) - acts.per_layer - w.layer_w  # its activations, copy freed
    rows = {
        "loss": (w.w_forward, earlier, acc, kept, loss),
        "head backward": (w.w_forward, earlier, acc, kept, head),
        "layer backward": (
            w.w_layer,
            earlier + w.grad_bytes * w.head_trainable / f,
            acc,
            kept_in_layers,
            max(layer, logits + held_head_grad + layer_reduce),
        ),
        "end of backward": _end_of_backward(model, w, logits, earlier, f, e),
        "optimizer step": (0.0, w.grads_all, 0.0, 0.0, 0.0),
    }
    if step.flat:  # parallel/single_rank.py: the engine's path for a world of one (fp32 runs keep FSDP's moments)
        flat_rows = _flat_path_rows(
            rows,
            workload,
            e=e,
            trainable=w.trainable_local,
            head_trainable=w.head_trainable,
            copies=w.w_forward,
            head_transient=head_plain,  # lm_head's bf16 gradient stays until the end: no reduction
            layer_transient=layer,  # no reduce-scatter temporaries
            logits=logits,
            accumulating=step.accumulating,
        )
        rows.update(flat_rows)
    return rows


def _end_of_backward(model: ModelShape, w: _Weights, logits: float, earlier: float, f: int, e: int) -> tuple:
    """The last reductions: the embedding's unit (its gathered copy freed first) or the first layer's adapters."""
    if w.embed_trainable:
        copies = 3 if model.tied else 2  # gathered weight + lm_head's gradient (tied) + the embedding's own
        end = logits + max(e * w.vocab_tp * copies, reduce_bytes(w.embed_trainable, f))
    else:
        end = logits + reduce_bytes(w.unit_trainable, f)  # the first layer's adapters are the last reduced
    grads = w.grads_all if earlier else w.grads_all - w.grad_bytes * w.embed_trainable / f
    return (0.0, grads, 0.0, 0.0, end)


def offload_layers_for(
    model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, micro_batch: int = 1
) -> int:
    """Layers whose inputs activation offload moves to the host: the workload's count (at most all layers but the
    last, as ``offload.apply_offloaded_checkpointing`` caps it), else as many as ``offload.HOST_SHARE`` of a
    node's host memory holds for all its GPUs (``offload.layers_host_holds``, the trainer's rule)."""
    if workload.activation_offload_layers is not None:
        return min(workload.activation_offload_layers, model.layers - 1)
    return layers_host_holds(
        num_layers=model.layers,
        layer_bytes=offloaded_layer_bytes(model, layout, workload, micro_batch),
        ranks_on_node=cluster.gpus_per_node,
        host_bytes=cluster.host_bytes,
    )


def offloaded_layer_bytes(model: ModelShape, layout: Layout, workload: Workload, micro_batch: int = 1) -> int:
    """One offloaded layer's input on one rank: b x ceil(ceil(S/cp)/tp) tokens x h, compute dtype
    (``train/model.offload_layers``)."""
    tokens = micro_batch * -(-(-(-workload.seq_len // layout.cp)) // layout.tp)
    return tokens * model.hidden * workload.compute_bytes


def offload_host_bytes(
    model: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, micro_batch: int, layers: int
) -> float:
    """Host memory ``layers`` offloaded layers take on one node (every GPU's inputs, pinned blocks)."""
    per_layer = host_bytes_per_layer(offloaded_layer_bytes(model, layout, workload, micro_batch), cluster.gpus_per_node)
    return layers * per_layer


def _flat_path_rows(
    rows: dict,
    workload: Workload,
    *,
    e: int,
    trainable: float,
    head_trainable: float,
    copies: float,
    head_transient: float,
    layer_transient: float,
    logits: float,
    accumulating: bool,
) -> dict:
    """The moments on the one-rank flat path (``parallel/single_rank.py``), where they differ from FSDP's.

    Its bf16 compute copies live in a flat buffer for the whole run (FSDP frees its gathered copies after
    backward); autograd's bf16 gradients stay until the backward ends (FSDP reduces each unit's into fp32 as
    it goes, through reduce-scatter temporaries); then, with ``master_grads`` (``build_optimizer``'s
    default), ``finish_backward`` allocates the fp32 gradient buffer and upcasts into it while the bf16
    ones still exist: 4 + e bytes per trainable parameter at once; without it (the trainer's one
    micro-batch) AdamW reads the bf16 ones. From a second micro-batch on the fp32 gradients exist and each
    bf16 one is added in as autograd finishes it. The logits are still held at the end of backward (the
    trainer keeps them until ``loss.backward()`` returns). H200, a Llama-2-7B layer shape with 8 and 16
    layers, full checkpointing, ``master_grads``: 36.08 / 66.24 GiB measured; FSDP's moments gave 31.80 /
    54.17, these 36.08 / 66.24 (``benchmarks/results/planner_validation.md``)."""
    loss, head, layer = rows["loss"], rows["head backward"], rows["layer backward"]
    if workload.bf16_weights:
        # no compute copies; each bf16 gradient moves into one flat bf16 buffer, made whole at the first one
        # (lm_head's, at the end of the head's backward) and kept to the optimizer step
        grads = e * trainable
        before = grads if accumulating else 0.0
        return {
            "loss": (0.0, before, 0.0, loss[3], loss[4]),
            "head backward": (0.0, before, 0.0, head[3], head_transient),
            "layer backward": (0.0, grads, 0.0, layer[3], layer_transient),
            "end of backward": (0.0, grads, 0.0, 0.0, logits),
            "optimizer step": (0.0, grads, 0.0, 0.0, 0.0),
        }
    bf16, fp32 = e * trainable, 4 * trainable
    earlier = fp32 if accumulating else 0.0
    grads_end = fp32 if accumulating else bf16 + (fp32 if workload.master_grads else 0.0)
    grads_step = fp32 if accumulating or workload.master_grads else bf16
    return {
        "loss": (copies, earlier, 0.0, loss[3], loss[4]),
        "head backward": (copies, earlier, 0.0, head[3], head_transient),
        "layer backward": (copies, earlier + e * head_trainable, 0.0, layer[3], layer_transient),
        "end of backward": (copies, grads_end, 0.0, 0.0, logits),
        "optimizer step": (copies, grads_step, 0.0, 0.0, 0.0),
    }


def estimate_memory(
    model: ModelShape,
    layout: Layout,
    workload: Workload,
    *,
    micro_batch: int = 1,
    activation_checkpointing: str | None = None,
    accumulation: int = 1,
    gradient_sync: str = "every_micro_batch",
    cluster: Cluster | None = None,
    tiled_mlp: bool | None = None,
    offload_layers: int | None = None,
) -> MemoryEstimate:
    """Peak memory of one GPU training ``model`` on ``layout``: the largest of ``memory_moments``.

    ``activation_checkpointing`` defaults to the workload's mode ('none' when the workload says 'auto');
    ``accumulation`` micro-batches per step with ``gradient_sync`` 'last_micro_batch' keep unsharded fp32 gradients.
    """
    moments = memory_moments(
        model,
        layout,
        workload,
        micro_batch=micro_batch,
        activation_checkpointing=activation_checkpointing,
        accumulation=accumulation,
        gradient_sync=gradient_sync,
        cluster=cluster,
        tiled_mlp=tiled_mlp,
        offload_layers=offload_layers,
    )
    return max(moments.values(), key=lambda m: m.allocated)
