"""The work one GPU does in a training step, part by part, in seconds (communication apart: comm.py).

Notation: b rows per micro-batch, S = seq_len, c = cp, t = tp, s = S/c tokens a rank holds, n = b*s the
tokens of its matmuls (tensor parallelism gathers the sequence before each column-parallel linear), e
bytes per compute element, h hidden, q = heads x head_dim, kv = kv_heads x head_dim, i intermediate, V
vocab, L layers, d head_dim, D the keys a query sees (the row, or the document of packed rows).

linear      the seven linears of each layer, (n x K) @ (K x N) with the tp-split widths, forward,
            input gradient and weight gradient (``Rates.gemm_s`` per product; fp8 in the layers with
            ``Workload.fp8``); lm_head (n x h) @ (h x V/t) the same; full checkpointing repeats the
            forward. LoRA: no weight gradient for the frozen base, plus each adapter's two thin products.
            The tiled MLP (``Workload.tiled_mlp``; no checkpointing or full) repeats the MLP's forward
            (gate, up, down) once more: each tile's own checkpoint recomputes it in backward, within the
            layer's recompute. The fused loss (``Workload.fused_loss``) runs the same lm_head products
            chunk by chunk (its weight gradient accumulated in float32: compute-bound all the same).
attention   flash attention, 4*d FLOPs per visible (query, key) pair and head in forward, backward
            counted as twice that; visible pairs per row S(S+1)/2, or S(D+1)/2 for packed documents of
            D tokens; a rank computes 1/c of them (every CP method balances the causal work: ``context.py``
            gives each rank two mirrored chunks; alltoall splits the heads). Query rows per kernel call:
            D without CP and with alltoall, min(D, S/(2c)) for ring and allgather blocks. Kernels, as
            ``parallel/context.py`` chooses them: rows of one document at cp 1 go through SDPA (cuDNN on
            Hopper, ``Efficiency.attention``); packed rows and every CP method run FlashAttention's
            variable-length kernel (``attention/varlen``, ``Efficiency.block_attention``), one sequence per
            document piece, so no work crosses documents. Full checkpointing repeats the forward; selective
            keeps the kernel's output.
pointwise   the eager elementwise ops of a layer, bytes per token of the rank (``layer_pointwise_bytes``),
            three passes (forward, and backward at twice the forward's traffic), a fourth when
            checkpointing recomputes the forward; torch.compile runs them in ``compiled_pointwise`` of the
            eager time. fp8 adds its casts; CP adds its merges and reorders (``cp_bytes``); the tiled MLP
            its SiLU and product once more (5e*i/t per token).
loss        the chunked cross-entropy over n x V/t logits: 78 bytes per logit eager (forward: upcast, max,
            subtract, exp, sum; backward: upcast, subtract, exp, scale, scatter, downcast, copy), 6 compiled
            (the Triton kernels of ``kernels/cross_entropy.py``: one read forward, one read and one write
            backward). The fused loss does the same passes over each chunk (its statistics, then the gradient
            in place): the same bytes (H200, 1B, 4096 x 2 tokens, compiled: 60,568 tokens/s fused, 61,018
            unfused).
dequantize  a quantized base's linears (``Workload.quantized_base``) dequantized in every pass that reads them:
            forward, the input gradient, and the forward again under full checkpointing; bytes per weight
            value at the streaming rate, measured on the H200 (8B LoRA, 4096 tokens, over a bf16 base's
            step): int8 eager 16, compiled 3.1 (forward fused into the layer, backward through the
            input-gradient operator's own compile). Held out: the 1B's eager rows (int8 -1.5% of the step) and
            full checkpointing's third pass (8B: int8 -17% of the term). NF4 2.2 eager or compiled: on CUDA
            both run one Triton kernel (``kernels/nf4_dequantize.py``); fitted to an H100 (2026-12-07, same
            machine, 8B, full checkpointing + offload, compiled): the NF4 step at 0.958 of the bf16 step's
            tokens/s (10,516 vs 10,977), predicted 0.957. (torchao's eager dequantization was 52, the
            compiled one 16, H200.) An FP8 base dequantizes nothing: its products are FP8 (``linear``) and
            this part holds its byte traffic: the codes transposed for each backward, every forward input and
            output gradient quantized. Not fitted; checked against one pair of 8B rows (H100, same machine,
            2026-12-07 session 15, full checkpointing + offload, compiled): the FP8 step at 1.067 of the
            bf16 step's tokens/s (11,973 vs 11,224), predicted 1.098 (10,686 vs 9,729: absolute H100
            predictions run ~11% low for both). Its peak memory is over-predicted as the bf16 base's is
            (12.1 vs 10.7 GiB; 18.6 vs 17.2).
fsdp_copies FSDP2 copies into and out of its collective buffers, even on one rank: per all-gather
            (6/f + 4) bytes per gathered parameter (fp32 shard cast into the bf16 input, output copied out),
            per reduction (6 + 8/f) per trainable one (bf16 gradient into the fp32 input, the output
            divided/accumulated); gathered once per micro-batch, twice when units are resharded after
            forward. With gradient_sync 'last_micro_batch' each micro-batch but the last adds its bf16
            gradient into the unsharded fp32 one instead of reducing it: 10 bytes per trainable parameter.
optimizer   fused AdamW (28 bytes per local trainable parameter: read p, g, m, v, write p, m, v) and the
            gradient clipping (12: a norm read, a scale read and write), once per step; 8-bit AdamW
            (``eight_bit_bytes``): 16 bytes with bf16 weights, 34 with fp32 masters (their refresh included).
one rank    the flat path (no FSDP, ``parallel/single_rank.py``) has no collective buffers: under
            ``fsdp_copies`` it moves the upcast of the bf16 gradients into the fp32 buffer (6 bytes per
            trainable parameter; 10 for each later micro-batch, added in fp32), and its optimizer is
            ``FlatAdamW``: 30 bytes (AdamW and the bf16 copy's refresh in one kernel, the clipping
            coefficient applied in it) plus the norm's read (4). The trainer's step (one micro-batch,
            ``Workload.master_grads`` False: ``build_optimizer(master_grads=False)``) makes no fp32 gradient:
            no upcast, and the norm (2) and the update (28) read the bf16 gradients. With accumulation the
            first micro-batch's gradients are upcast at the second's forward, as above.
            ``Workload.single_rank_fsdp`` models FSDP on a mesh of one instead (the H200 rows measured
            before the flat path existed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.mesh.layout import Layout
from ndparallel.planner.activations import kv_width_allgather, kv_width_alltoall
from ndparallel.planner.memory import local_params, lora_params
from ndparallel.planner.rates import Rates
from ndparallel.planner.shapes import ModelShape
from ndparallel.planner.workload import Workload
from ndparallel.step.flops import packed_row_pairs

KINDS = ("linear", "attention", "pointwise", "loss", "dequantize", "fsdp_copies", "optimizer")
DEQUANTIZE_BYTES_PER_VALUE = {("nf4", False): 2.2, ("int8", False): 16, ("nf4", True): 2.2, ("int8", True): 3.1}
LOSS_BYTES_PER_LOGIT = {False: 78, True: 6}  # eager, compiled (bf16 logits)
ADAMW_BYTES, CLIP_BYTES = 28, 12
FLAT_ADAMW_BYTES, FLAT_NORM_BYTES, UPCAST_BYTES, ACCUMULATE_BYTES = 30, 4, 6, 10  # the one-rank path
IN_PLACE_ADAMW_BYTES, IN_PLACE_NORM_BYTES = 28, 2  # ... when AdamW reads the bf16 gradients (master_grads False)
EIGHT_BIT_STATE_TRAFFIC, REFRESH_BYTES, MOVE_BYTES = 4, 6, 4
"""8-bit AdamW (torchao's, one kernel per tensor): its two 1-byte moments read and written; with fp32 masters the
one-rank path re-casts each changed master into its bf16 copy at the next forward; with bf16 weights each bf16
gradient is moved into the flat gradient buffer (read and write, 2 bytes each)."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's shape on one rank."""

    model: ModelShape
    layout: Layout
    workload: Workload
    rows: int
    activation_checkpointing: str
    tiled_mlp: bool = False
    offload_layers: int = 0

    @property
    def tokens(self) -> int:
        """n: tokens in the rank's matmuls."""
        return self.rows * (self.workload.seq_len // self.layout.cp)

    @property
    def recompute(self) -> bool:
        return self.activation_checkpointing != "none"

    @property
    def mlp_recompute(self) -> bool:
        """The tiled MLP's extra forward (under selective checkpointing the policy caches the tiles' matmul
        outputs: measured on CPU, tiling changes nothing there)."""
        return self.tiled_mlp and self.activation_checkpointing != "selective"


def _linear_shapes(m: ModelShape, t: int) -> list[tuple[float, float]]:
    """(K, N) of each linear of a layer on one tp rank: q, k, v, o, gate, up, down."""
    h, q, kv, i = m.hidden, m.q_dim, m.kv_dim, m.intermediate
    return [(h, q / t), (h, kv / t), (h, kv / t), (q / t, h), (h, i / t), (h, i / t), (i / t, h)]


def linear_s(mb: MicroBatch, rates: Rates) -> float:
    m, t, n, w = mb.model, mb.layout.tp, mb.tokens, mb.workload
    base = "fp32" if w.precision == "fp32" else "bf16"
    layer = "fp8" if w.fp8 else base
    frozen = "fp8" if w.quantized_base == "fp8" else layer  # an FP8 base: forward and input-gradient products
    forward = backward = mlp_forward = 0.0
    for index, (k, out) in enumerate(_linear_shapes(m, t)):
        this = rates.gemm_s(n, out, k, frozen)
        backward += rates.gemm_s(n, k, out, frozen)  # input gradient
        if w.lora_rank:
            r = w.lora_rank
            this += rates.gemm_s(n, r, k, base) + rates.gemm_s(n, out, r, base)
            backward += 2 * (rates.gemm_s(n, k, r, base) + rates.gemm_s(n, r, out, base))
        else:
            backward += rates.gemm_s(k, out, n, layer)  # weight gradient
        forward += this
        mlp_forward += this if index >= 4 else 0.0  # gate, up, down
    head_f = rates.gemm_s(n, m.vocab / t, m.hidden, base)
    head_b = head_f * (1 if w.lora_rank else 2)
    passes = 2 if mb.activation_checkpointing == "full" else 1
    tiles = mlp_forward if mb.mlp_recompute else 0.0
    return m.layers * (forward * passes + tiles + backward) + head_f + head_b


def attention_pairs(seq: int, keys: int) -> float:
    """Visible (query, key) pairs of one causal row of ``seq`` tokens made of documents of ``keys`` tokens
    (the last one shorter when they do not divide the row): the trainer's MFU count (``ndparallel.step.flops``)."""
    return float(packed_row_pairs(seq, keys))


def attention_s(mb: MicroBatch, rates: Rates) -> float:
    m, lay, w = mb.model, mb.layout, mb.workload
    c, t = lay.cp, lay.tp
    keys = w.attended_keys
    flops = 4 * m.head_dim * (m.heads / t) * mb.rows * attention_pairs(w.seq_len, keys) / c
    rows = keys if c == 1 or lay.cp_comm_strategy == "alltoall" else min(keys, w.seq_len // (2 * c))
    fp32 = w.precision == "fp32"
    blocks = c > 1 or keys < w.seq_len  # SDPA only for whole one-document rows at cp 1
    forward = rates.attention_s(flops, m.head_dim, rows, backward=False, fp32=fp32, blocks=blocks)
    backward = rates.attention_s(flops, m.head_dim, rows, backward=True, fp32=fp32, blocks=blocks)
    return m.layers * (forward * (2 if mb.activation_checkpointing == "full" else 1) + backward)


def layer_pointwise_bytes(m: ModelShape, t: int, e: int) -> float:
    """Bytes the eager elementwise ops of one layer's forward move per token of the rank.

    Counted from transformers' Llama layer: each RMSNorm (upcast, square, mean, scale, downcast, weight:
    24 + 4e bytes per element) and residual add (3e) on the sequence-parallel shard (1/t of the tokens);
    rotary on q and k (10e: two products, a negation, a concatenation, a sum); the attention output's
    transpose copy (2e per q element); SiLU and the gate-up product (5e per intermediate element).
    """
    h, q, kv, i = m.hidden, m.q_dim, m.kv_dim, m.intermediate
    norms_residuals = (2 * (24 + 4 * e) + 2 * 3 * e) * h / t
    qk_norm = (24 + 4 * e) * (q + kv) / t if m.qk_norm else 0.0
    return norms_residuals + qk_norm + (10 * e * (q + kv) + 2 * e * q + 5 * e * i) / t


def fp8_cast_bytes(mb: MicroBatch) -> float:
    """Per layer: the float8 casts of the linears' operands (tensorwise scales, torchao). Each distinct
    input is cast once (q/k/v share theirs, so do gate/up: the compiled layer computes the identical cast
    once), (2e + 1) bytes per element (amax read, scaled cast: read and write), and again as a transposed
    copy for the weight gradient (2 bytes); each output gradient (2e + 1 + 2); each weight every
    micro-batch, forward and transposed. Full checkpointing repeats the forward casts."""
    m, t, e, n = mb.model, mb.layout.tp, mb.workload.compute_bytes, mb.tokens
    inputs = n * (2 * m.hidden + (m.q_dim + m.intermediate) / t)  # attention input, o, MLP input, down
    grads = n * sum(out for _, out in _linear_shapes(m, t))
    weights = sum(k * out for k, out in _linear_shapes(m, t))
    forward = (2 * e + 1) * (inputs + weights) * (2 if mb.activation_checkpointing == "full" else 1)
    return forward + 2 * (inputs + weights) + (2 * e + 3) * grads


def cp_bytes(mb: MicroBatch) -> float:
    """Per layer: CP's own memory traffic. ring: (2c + 1) blocks per rank, each output and log-sum-exp
    merged into fp32 accumulators and the fp32 dQ/dK/dV sums, about 10 passes over 4*b*(q/t)*(s/2) bytes
    per block, plus each block's K/V expanded to the query heads under grouped-query attention (4 copies
    of e*b*(s/2)*q/t); allgather: the gathered K/V reordered and expanded (3 copies forward, 3 backward,
    6e*b*S*kv'/t each way) and two merges per query chunk; alltoall: reorders before and after each
    all-to-all, 4e*b*s*(2q + 2kv'')/t."""
    m, lay, e, b = mb.model, mb.layout, mb.workload.compute_bytes, mb.rows
    c, t, seq = lay.cp, lay.tp, mb.workload.seq_len
    if c == 1:
        return 0.0
    s = seq // c
    passes = 2 if mb.activation_checkpointing == "full" else 1  # forward parts are repeated
    if lay.cp_comm_strategy == "ring":
        block = 10 * 4 * b * m.q_dim / t * s / 2
        expand = 4 * e * b * s / 2 * m.q_dim / t if m.kv_heads != m.heads else 0.0
        return (2 * c + 1) * (block + expand) * (1 + passes) / 2
    if lay.cp_comm_strategy == "allgather":
        return 6 * e * b * seq * 2 * kv_width_allgather(m) / t * (1 + passes) / 2 + 2 * 10 * 4 * b * m.q_dim / t * s
    return 4 * e * b * s * (2 * m.q_dim + 2 * kv_width_alltoall(m, lay)) / t * (1 + passes) / 2


def pointwise_s(mb: MicroBatch, rates: Rates) -> float:
    m, t, e, n = mb.model, mb.layout.tp, mb.workload.compute_bytes, mb.tokens
    passes = 3 + (1 if mb.recompute else 0)
    eager = m.layers * layer_pointwise_bytes(m, t, e) * n * passes
    if mb.mlp_recompute:  # the tiles' SiLU and product, once more
        eager += m.layers * 5 * e * m.intermediate / t * n
    # embedding: gather forward, fp32 scatter-add of its gradient backward (a full fp32 gradient zeroed)
    eager += n * m.hidden * (2 * e + 8) / t + 4 * m.vocab * m.hidden / t
    if mb.workload.fp8:
        eager += m.layers * fp8_cast_bytes(mb)
    return rates.pointwise_s(eager, compiled=mb.workload.compile) + rates.stream_s(m.layers * cp_bytes(mb))


def loss_s(mb: MicroBatch, rates: Rates) -> float:
    logits = mb.tokens * mb.model.vocab / mb.layout.tp
    scale = mb.workload.compute_bytes / 2
    return rates.stream_s(logits * LOSS_BYTES_PER_LOGIT[mb.workload.compile] * scale)


def dequantize_s(mb: MicroBatch, rates: Rates) -> float:
    w = mb.workload
    if w.quantized_base is None:
        return 0.0
    full = mb.activation_checkpointing == "full"
    values = mb.model.layers * mb.model.layer_linear_weights() / mb.layout.tp
    if w.quantized_base == "fp8":
        # the backward's transpose of the codes (a byte read and written per value) and its output gradients
        # quantized; each forward pass quantizing every linear's input (q/k/v and gate/up each their own); a
        # quantization reads the compute dtype and writes a byte code
        shapes = _linear_shapes(mb.model, mb.layout.tp)
        inputs, outputs = (mb.tokens * sum(dims) for dims in zip(*shapes))
        quantize = mb.model.layers * ((2 if full else 1) * inputs + outputs) * (w.compute_bytes + 1)
        return rates.stream_s(2 * values + quantize)
    passes = 3 if full else 2
    return rates.stream_s(passes * values * DEQUANTIZE_BYTES_PER_VALUE[w.quantized_base, w.compile])


def micro_batch_parts(mb: MicroBatch, rates: Rates) -> dict[str, float]:
    """Seconds of one micro-batch's forward and backward on one GPU, by kind (no communication)."""
    return {
        "linear": linear_s(mb, rates),
        "attention": attention_s(mb, rates),
        "pointwise": pointwise_s(mb, rates),
        "loss": loss_s(mb, rates),
        "dequantize": dequantize_s(mb, rates),
    }


def fsdp_copy_s(
    model: ModelShape,
    layout: Layout,
    workload: Workload,
    rates: Rates,
    *,
    gathers: float,
    reductions: float,
    accumulations: float = 0,
) -> float:
    """FSDP2's copies into and out of its buffers for ``gathers`` all-gathers, ``reductions`` reductions and
    ``accumulations`` unsharded accumulations of every unit (module docstring)."""
    f, t = layout.fsdp_size, layout.tp
    gathered = model.split_params() / t + model.replicated_params() + lora_params(model, workload.lora_rank) / t
    trainable = lora_params(model, workload.lora_rank) / t if workload.lora_rank else gathered
    moved = gathers * gathered * (6 / f + 4) + reductions * trainable * (6 + 8 / f) + accumulations * trainable * 10
    return rates.stream_s(moved)


def flat_path(layout: Layout, workload: Workload) -> bool:
    """One rank without FSDP (the engine's default for a world of one)."""
    return layout.world_size == 1 and not workload.single_rank_fsdp


def _trainable_local(model: ModelShape, layout: Layout, workload: Workload) -> float:
    if workload.lora_rank:
        return lora_params(model, workload.lora_rank) / (layout.tp * layout.fsdp_size)
    return local_params(model, layout)


def grads_read_in_place(layout: Layout, workload: Workload, micro_batches: int) -> bool:
    """The one-rank step whose AdamW reads autograd's bf16 gradients (no fp32 gradient is made)."""
    bf16 = workload.precision == "bf16"  # in fp32 the gradients are the masters' own: nothing to read in place
    flat_adamw = not workload.eight_bit_optimizer  # only FlatAdamW reads them where autograd left them
    return flat_path(layout, workload) and bf16 and flat_adamw and not workload.master_grads and micro_batches == 1


def flat_upcast_s(model: ModelShape, layout: Layout, workload: Workload, rates: Rates, *, micro_batches: int) -> float:
    """The one-rank path's gradient upcast (first micro-batch) and fp32 accumulation (later ones)."""
    if grads_read_in_place(layout, workload, micro_batches):
        return 0.0
    trainable = _trainable_local(model, layout, workload)
    if workload.bf16_weights:  # moved into the bf16 buffer, later micro-batches added there
        return rates.stream_s(trainable * (MOVE_BYTES + 6 * (micro_batches - 1)))
    return rates.stream_s(trainable * (UPCAST_BYTES + ACCUMULATE_BYTES * (micro_batches - 1)))


def eight_bit_bytes(workload: Workload) -> float:
    """Bytes per trained parameter of an 8-bit AdamW step: the update reads the gradient and the weight and writes
    the weight (each ``master_bytes``), the moments' traffic; the clipping norm reads the gradients and its scale
    reads and writes them; with fp32 masters, the bf16 copies' refresh."""
    w = workload.master_bytes  # the gradients are in the weights' dtype here (fp32 after the upcast)
    refresh = 0 if workload.bf16_weights else REFRESH_BYTES
    return 3 * w + EIGHT_BIT_STATE_TRAFFIC + 3 * w + refresh


def optimizer_s(model: ModelShape, layout: Layout, workload: Workload, rates: Rates, *, micro_batches: int) -> float:
    if workload.eight_bit_optimizer:
        per_param = eight_bit_bytes(workload)
    elif grads_read_in_place(layout, workload, micro_batches):
        per_param = IN_PLACE_ADAMW_BYTES + IN_PLACE_NORM_BYTES
    elif flat_path(layout, workload):
        per_param = FLAT_ADAMW_BYTES + FLAT_NORM_BYTES
    else:
        per_param = ADAMW_BYTES + CLIP_BYTES
    return rates.stream_s(_trainable_local(model, layout, workload) * per_param)
