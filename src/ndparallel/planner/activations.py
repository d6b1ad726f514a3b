"""Bytes of activations one GPU keeps for backward, as this implementation saves them.

Every coefficient below was read off what autograd (and activation checkpointing) actually keeps on one
rank, counted storage by storage for tiny models with ``testing/memory_probe.py`` (world 1 and TP/CP
layouts); ``benchmarks/results/planner_validation.md`` has the measured-vs-predicted table. Notation: b rows per
micro-batch, s = seq/cp tokens held by the rank, S = seq, t = tp, e = bytes per compute element
(2 for bf16, 4 for fp32), h hidden, q = heads*head_dim, kv = kv_heads*head_dim, n = heads, i
intermediate, V vocab. Per token of the rank (multiply by b*s):

one decoder layer, no checkpointing
    RMSNorm (x2)     (4h + 4 + e*h) / t   fp32 copy of the input, 1/rms, normalized input in compute dtype;
                                          split over tp by sequence parallelism
    linear inputs    2 * e*h              the normed input, gathered over tp (the q/k/v and gate/up input)
    attention        (e*(2q + 2kv) + 4n) / t   rotated q and k, v, the output (also o_proj's input),
                                          and the fp32 log-sum-exp; rotary tables save nothing per layer
    MLP              4 * e*i / t          gate and up outputs, silu(gate), their product (down's input)
    q/k RMSNorm      ((4 + e)*(q + kv) + 4*(n + kv_heads)) / t   Qwen3 only: the same three per head

attention under CP (replaces the attention line; indices are int64 per layer)
    allgather   (2e*q + 4n)/t per token + 2e*kv'/t per token of the FULL row (K/V gathered; expanded to the
                query heads, kv' = q, when kv_heads < heads) + an additive mask of e*s*S bytes + 8*S
    ring        (e*(3q + 2kv) + 4n)/t     (the output is re-laid-out once more for o_proj)
    alltoall    (e*(3q + 2kv'') + 4n)/t + 16*S   (kv'' = q when kv_heads/t does not split over cp)

selective checkpointing keeps the outputs of matmuls and attention kernels and the layer input:
    e*h/t (input) + e*(q + 2kv)/t (q/k/v) + e*h (o_proj, before its reduce-scatter: full width)
    + 2e*i/t (gate, up) + e*h (down) + (e*q + 4n)/t (attention); ring attention keeps every block's
    output, (2cp + 1) blocks of s/2 tokens: (cp + 1/2) * (e*q + 4n)/t
full checkpointing keeps the layer input, e*h/t, and recomputes one layer at a time in backward.

outside the layers
    embedding   2e*d (rotary cos/sin) + 8 (input ids)
    head        final RMSNorm (4h + 4 + e*h)/t + lm_head input e*h + labels 8
    loss        the logits as the model made them, e*V/t (the chunked cross-entropy saves them, not a softmax),
                + 14: the fp32 log-sum-exp, the int64 local label and two boolean masks

LoRA (base weights frozen, adapters on all seven linears): a product with a frozen weight saves nothing
for that weight's gradient, so every RMSNorm drops its normalized compute-dtype copy (the input of
``weight * x``), e*h/t per norm (Qwen3's q/k norms e*(q + kv)/t), the head drops lm_head's input, e*h,
and the first layer's input norm saves nothing at all (the frozen embedding's output needs no
gradient): (4h + 4)/t once. The linears' inputs stay saved (each adapter's A reads the same tensor).
    none        + e*r*(5 + 2/t): each adapter's A output, kept for B's backward (the o/down adapters'
                A output is reduce-scattered over the sequence first)
    selective   + e*(7r + (q + 2kv + 2i + 2h)/t): every A output (the o/down ones as partial sums, full
                sequence) and every B output (o/down: sequence-split)
Measured on CPU (``tiny-gqa4-*-lora*`` rows, world 1 and tp 2) and on the H200 (1B LoRA rows).

fused loss (``Workload.fused_loss``, the trainer's default: ``loss/fused.py``; counted on CPU, H200 rows)
    head        lm_head's input is not saved; the loss's gradient of it is, e*h per token (made in forward
                whenever the hidden states need a gradient: under LoRA too)
    loss        no logits: lm_head's weight gradient, summed in float32 from forward to backward, 4*V*h/t
                once, not per token (none under LoRA)
    its forward (``fused_loss_peak``: the loss computes the gradients there), beyond the kept activations,
    per micro-batch of n tokens, w = V/t: lm_head's input e*n*h; that float32 weight gradient 4*w*h; one
    chunk of c = min(n, ~512 MiB / (e*w)) rows' logits, e*c*w (2,048 rows at w = 128,256 in bf16); the
    chunk's float32 temporaries (on CUDA the Triton kernels make none, eager or compiled; elsewhere 12*c*w in
    bf16, 8*c*w in fp32, as the chunked loss's); 18 bytes per token (the local and the clamped label, two
    masks) and 20 per chunk row. On CUDA the weight-gradient GEMM adds into the float32 sum in place
    (``torch.addmm(..., out_dtype=float32, out=sum)``); the CPU keeps each chunk's bf16 product, e*w*h (the
    CPU measurements count it: ``device='cpu'``). H200, the 1B's head at 8,192 tokens: 3.49 GiB (1 GiB
    chunks) and 2.51 GiB (512 MiB chunks) above its inputs, each this count with a second chunk, which the
    loop held then; 2.02 GiB once it freed it, this count (``fused_loss_peak``; ``tests/gpu/gpu_fused_loss.py``).
    lm_head's backward (``fused_head_backward``): the float32 gradient and autograd's cast of it to the
    weight's dtype at once, (4 + e)*w*h (fp32: 4*w*h, no cast).
tiled MLP (``Workload.tiled_mlp``: ``parallel/tiled_mlp.py``; no checkpointing or full)
    the MLP's four tensors are not kept; each tile's checkpoint keeps its input, a view of the post-attention
    norm's sequence-split output, e*h/t instead of the gathered e*h (LoRA: the gate, up and down adapters' A
    outputs go with the tiles). Under selective checkpointing nothing changes: its policy caches the tiles'
    matmul outputs too (counted on CPU). What one tile holds in backward: ``backward.py``.
activation offload (``Workload.activation_offload``: ``parallel/offload.py``; full checkpointing)
    the first K layers' inputs (e*h/t per token each) wait in host memory: ``layers`` counts the other L - K,
    ``offloaded`` those K. When they come back: ``backward.py``.

torch.compile (the trainer's ``compile``: each decoder layer compiled, and the loss's chunk functions)
changes what is kept, because the compiled layer's backward graph is partitioned from the forward by
need (the min-cut partitioner recomputes cheap elementwise results, and saves only what backward reads):
    RMSNorms        keep 1/rms and recompute their fp32 input copy: 4h fewer per token and norm
    MLP (none)      keeps gate and up and the product (down's input), recomputes silu(gate): 3e*i/t, not 4e*i/t
                    (full fine-tuning; under LoRA the compiled 8B's peak is 4% below the eager count, kept)
    selective       the policy's saved matmul outputs lose the one backward never reads: down_proj's output
                    (it only feeds the residual add; the next layer saves its own input), e*h fewer
    loss            each chunk's gradient in one kernel (no float32 chunk temporaries)
Measured on the H200 (compiled, one GPU, torch 2.11): without the MLP and selective terms the model was
e*i (none, 15-16 KB per token and layer: 1B at 4k x 2 and 32k x 1-2, 3B at 8k) and ~0.94 e*h (selective,
1B at 32k) above every compiled peak; full checkpointing (no such term) was within 0.5%. With them:
``benchmarks/results/planner_validation.md``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndparallel.loss.cross_entropy import CHUNK_ROWS
from ndparallel.loss.fused import CHUNK_BYTES
from ndparallel.mesh.layout import Layout
from ndparallel.planner.shapes import ModelShape


@dataclass(frozen=True)
class ActivationBytes:
    """Activation memory of one rank for one micro-batch, bytes."""

    per_layer: float
    """Kept for backward by one decoder layer in the chosen checkpointing mode."""
    layers: float
    """All decoder layers."""
    embedding: float
    head: float
    """Final norm, lm_head input (fused loss: its gradient) and labels."""
    loss_saved: float
    """What the loss keeps for backward: the logits (compute dtype) and 14 bytes per token; fused, lm_head's
    float32 weight gradient."""
    layer_recompute: float
    """Backward working set of the layer being processed: what checkpointing recomputes for it."""
    offloaded: float = 0.0
    """Layer inputs waiting in host memory (activation offload), not on the GPU: ``layers`` leaves them out."""

    @property
    def retained(self) -> float:
        """Everything kept at the end of the forward (with the loss computed)."""
        return self.layers + self.embedding + self.head + self.loss_saved

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "retained": self.retained}


def _norm(m: ModelShape, t: int, e: int, frozen: bool = False, compiled: bool = False) -> float:
    """One RMSNorm under sequence parallelism, per token: fp32 input copy (not when compiled), 1/rms,
    normalized (compute dtype).

    With a frozen weight (LoRA) ``weight * x`` saves nothing for the weight's gradient: no normalized copy.
    """
    return ((0 if compiled else 4 * m.hidden) + 4 + (0 if frozen else e * m.hidden)) / t


def kv_width_allgather(m: ModelShape) -> int:
    """Width of gathered K (or V) in allgather CP: expanded to the query heads under grouped-query attention."""
    return m.q_dim if m.kv_heads != m.heads else m.kv_dim


def kv_width_alltoall(m: ModelShape, layout: Layout) -> int:
    """Width of K (or V) after the alltoall: expanded to the query heads when kv_heads/tp does not split over cp."""
    return m.kv_dim if (m.kv_heads // layout.tp) % layout.cp == 0 else m.q_dim


def attention_none(m: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Bytes one layer's attention keeps without checkpointing (excluding its input), for b rows."""
    t, c, q, kv, n = layout.tp, layout.cp, m.q_dim, m.kv_dim, m.heads
    s = seq // c
    if c == 1:
        return b * s * (e * (2 * q + 2 * kv) + 4 * n) / t
    if layout.cp_comm_strategy == "allgather":
        local = b * s * (2 * e * q + 4 * n) / t
        gathered = b * seq * 2 * e * kv_width_allgather(m) / t
        return local + gathered + e * s * seq + 8 * seq
    if layout.cp_comm_strategy == "ring":
        return b * s * (e * (3 * q + 2 * kv) + 4 * n) / t
    return b * s * (e * (3 * q + 2 * kv_width_alltoall(m, layout)) + 4 * n) / t + 16 * seq


def mlp_tensors(m: ModelShape, t: int, e: int, *, frozen: bool = False, compiled: bool = False) -> float:
    """Per token: what the MLP's forward keeps for its backward: gate, up, silu(gate) and their product (down's
    input), 4 e*i/t; compiled, silu(gate) is recomputed (module docstring; not measured so under LoRA)."""
    return (3 if compiled and not frozen else 4) * e * m.intermediate / t


def _adapters(m: ModelShape, t: int, e: int, lora_rank: int | None, *, mlp: bool) -> float:
    """Per token: the LoRA A outputs kept for B's backward, of the attention's four linears (q, k, v whole, o's
    reduce-scattered) or the MLP's three (gate, up whole, down's reduce-scattered)."""
    if not lora_rank:
        return 0.0
    return e * lora_rank * ((2 if mlp else 3) + 1 / t)


def attention_side(
    m: ModelShape, layout: Layout, seq: int, b: int, e: int, lora_rank: int | None = None, compiled: bool = False
) -> float:
    """Bytes the attention half of a layer keeps without checkpointing: the input norm, q/k/v's input (gathered
    over tp), the attention (``attention_none``), Qwen3's q/k norms and the adapters' A outputs."""
    t, s, frozen = layout.tp, seq // layout.cp, bool(lora_rank)
    per_token = _norm(m, t, e, frozen, compiled) + e * m.hidden + _adapters(m, t, e, lora_rank, mlp=False)
    if m.qk_norm:
        per_token += ((4 + (0 if frozen else e)) * (m.q_dim + m.kv_dim) + 4 * (m.heads + m.kv_heads)) / t
    return b * s * per_token + attention_none(m, layout, seq, b, e)


def mlp_side(
    m: ModelShape,
    layout: Layout,
    seq: int,
    b: int,
    e: int,
    lora_rank: int | None = None,
    compiled: bool = False,
    tiled: bool = False,
) -> float:
    """Bytes the MLP half keeps without checkpointing: the post-attention norm, the MLP's input and its four
    tensors (``mlp_tensors``). Tiled, each tile's checkpoint keeps only its input, a view of the norm's
    sequence-split output (e*h/t; the MLP gathers it over tp inside the tile), and no MLP tensor."""
    t, s, frozen = layout.tp, seq // layout.cp, bool(lora_rank)
    if tiled:
        return b * s * (_norm(m, t, e, frozen, compiled) + e * m.hidden / t)
    mlp = mlp_tensors(m, t, e, frozen=frozen, compiled=compiled)
    return b * s * (_norm(m, t, e, frozen, compiled) + e * m.hidden + mlp + _adapters(m, t, e, lora_rank, mlp=True))


def layer_none(
    m: ModelShape,
    layout: Layout,
    seq: int,
    b: int,
    e: int,
    lora_rank: int | None = None,
    compiled: bool = False,
    tiled: bool = False,
) -> float:
    """Bytes one decoder layer keeps for backward without checkpointing (LoRA: frozen base, 7 adapters; tiled:
    the MLP over sequence tiles)."""
    return attention_side(m, layout, seq, b, e, lora_rank, compiled) + mlp_side(
        m, layout, seq, b, e, lora_rank, compiled, tiled
    )


def layer_selective(m: ModelShape, layout: Layout, seq: int, b: int, e: int, compiled: bool = False) -> float:
    """Bytes one decoder layer keeps under selective checkpointing (matmul and attention outputs + input;
    compiled: without down_proj's output, which backward never reads)."""
    t, c, h = layout.tp, layout.cp, m.hidden
    s = seq // c
    kernel = (e * m.q_dim + 4 * m.heads) / t
    if c > 1 and layout.cp_comm_strategy == "ring":
        kernel *= c + 0.5  # 2cp+1 cached blocks of s/2 tokens
    matmul_outputs = e * (m.q_dim + 2 * m.kv_dim) / t + (1 if compiled else 2) * e * h + 2 * e * m.intermediate / t
    per_token = e * h / t + matmul_outputs + kernel
    return b * s * per_token


def layer_full(m: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Bytes one decoder layer keeps under full checkpointing: its input, sequence-split over tp."""
    return b * (seq // layout.cp) * e * m.hidden / layout.tp


def activation_bytes(
    m: ModelShape,
    layout: Layout,
    seq: int,
    b: int,
    mode: str,
    e: int = 2,
    lora_rank: int | None = None,
    compiled: bool = False,
    *,
    fused_loss: bool = True,
    tiled: bool = False,
    offload_layers: int = 0,
) -> ActivationBytes:
    """Activation memory of one rank for a micro-batch of ``b`` rows of ``seq`` tokens (compiled layers:
    ``compiled``; the fused loss, the tiled MLP and the inputs of ``offload_layers`` first layers in host
    memory as the module docstring says)."""
    t, s = layout.tp, seq // layout.cp
    none = layer_none(m, layout, seq, b, e, lora_rank, compiled, tiled)
    if mode == "none":
        per_layer, recompute = none, 0.0
    elif mode == "selective":
        per_layer = layer_selective(m, layout, seq, b, e, compiled)
        if lora_rank:  # the adapters' A and B outputs are matmul outputs too
            widths = (m.q_dim + 2 * m.kv_dim + 2 * m.intermediate + 2 * m.hidden) / t
            per_layer += b * s * e * (7 * lora_rank + widths)
        recompute = max(none - per_layer, 0.0)
    else:
        per_layer, recompute = layer_full(m, layout, seq, b, e), none
    offloaded = min(offload_layers, m.layers - 1) if mode == "full" else 0
    embedding = b * s * (2 * e * m.head_dim + 8)
    # final norm, lm_head's input (not saved when lm_head is frozen) or, fused, the loss's gradient of it
    # (made whenever the hidden states need one), and the labels
    lm_input = e * m.hidden if fused_loss or not lora_rank else 0
    head = b * s * (_norm(m, t, e, bool(lora_rank)) + lm_input + 8)
    layers = (m.layers - offloaded) * per_layer
    if lora_rank and mode == "none":
        layers -= b * s * (4 * m.hidden + 4) / t  # the first layer's input norm: nothing needs a gradient
    return ActivationBytes(
        per_layer=per_layer,
        layers=layers,
        embedding=embedding,
        head=head,
        loss_saved=fused_weight_grad(m, layout, lora_rank) if fused_loss else b * s * (e * m.vocab / t + 14),
        layer_recompute=recompute,
        offloaded=offloaded * per_layer,
    )


def fused_weight_grad(m: ModelShape, layout: Layout, lora_rank: int | None = None) -> float:
    """lm_head's gradient the fused loss sums in float32 from forward to backward (V/t x h); none under LoRA."""
    return 0.0 if lora_rank else 4 * m.vocab * m.hidden / layout.tp


def loss_peak(m: ModelShape, layout: Layout, seq: int, b: int, e: int, compiled: bool = False) -> float:
    """Most bytes the logits and the loss hold at once, per micro-batch (``ndparallel.loss.cross_entropy``, eager).

    The chunked cross-entropy never makes a full float32 copy or softmax of the (N, V/t) logits (N = b*s
    tokens of the rank). Its peak is in backward, inside ``_chunk_grad`` for a chunk of c = min(N,
    ``CHUNK_ROWS``) rows: the logits (saved by the loss and still held by the trainer, e bytes per local
    logit element), their gradient (e bytes), and three float32 temporaries of the chunk at once, the
    upcast chunk (bf16 only: a no-op in fp32), ``x - lse`` and its ``exp`` (later the scaled and the
    scattered copies: never more than three at once): 12 bytes per chunk element in bf16, 8 in fp32. Per
    token: 22 bytes (the saved log-sum-exp, label and two masks, the float32 ``scale`` and
    ``target_scale``) and 4 per chunk row (the negated ``target_scale`` slice). Forward holds no
    gradient, so it peaks lower. With ``compiled`` the chunk temporaries are fused away.
    """
    n, w = b * (seq // layout.cp), m.vocab / layout.tp
    c = min(n, CHUNK_ROWS)
    temporaries = 0 if compiled else (12 if e < 4 else 8) * c * w
    return 2 * e * n * w + temporaries + 22 * n + 4 * c


def fused_chunk_rows(m: ModelShape, layout: Layout, e: int, device: str = "cuda") -> int:
    """Rows per chunk of the fused loss (``loss/fused.chunk_rows_for``): about ``CHUNK_BYTES`` of logits, a
    multiple of 256 rows, at least 256."""
    rows = CHUNK_BYTES.get(device, CHUNK_BYTES["cpu"]) // max(1, (m.vocab // layout.tp) * e)
    return max(256, rows // 256 * 256)


def fused_loss_peak(
    m: ModelShape,
    layout: Layout,
    seq: int,
    b: int,
    e: int,
    *,
    compiled: bool = False,
    lora_rank: int | None = None,
    device: str = "cuda",
    chunk_rows: int | None = None,
) -> float:
    """Most bytes the fused loss (``loss/fused.py``) adds to the kept activations, per micro-batch: in its
    forward, which computes the gradients chunk by chunk (module docstring, "fused loss"). ``device`` 'cpu'
    counts the CPU's own weight-gradient path (the measurements); ``chunk_rows`` overrides the chunk."""
    n, w, h = b * (seq // layout.cp), m.vocab / layout.tp, m.hidden
    c = min(n, chunk_rows or fused_chunk_rows(m, layout, e, device))
    grad_w = fused_weight_grad(m, layout, lora_rank)
    temporaries = 0 if device == "cuda" else (12 if e < 4 else 8) * c * w  # CUDA: Triton, compiled or not
    # the float32 sum of W's gradient: CUDA's torch.addmm(..., out_dtype=float32, out=sum) adds in place; the
    # CPU rounds each chunk's product to the compute dtype in a buffer kept across chunks. Two H200 measurements
    # fix the CUDA count: at 8,192 tokens the loss took 3.49 GiB (4,096-row chunks) and 2.51 (2,048-row chunks)
    # above its inputs and the previous call's gradients; both are x's gradient + the float32 sum + two chunks
    # of logits, nothing else. The second chunk was the loop's name holding the previous one while the next
    # was made; the loop frees it first now: 2.02 GiB measured at 2,048-row chunks, the 0.49 GiB predicted.
    product = e * w * h if grad_w and e < 4 and device != "cuda" else 0.0
    return e * n * h + grad_w + product + e * c * w + temporaries + 18 * n + 20 * c


def fused_head_backward(m: ModelShape, layout: Layout, e: int, lora_rank: int | None = None) -> float:
    """lm_head's gradient as the fused loss's backward hands it to autograd: the float32 sum and autograd's
    cast of it to the weight's compute dtype, both alive at once (bf16; in fp32 no cast)."""
    grad_w = fused_weight_grad(m, layout, lora_rank)
    return grad_w * (1 + e / 4) if e < 4 else grad_w
