"""Bytes of activations one GPU keeps for backward, as this implementation saves them.

Every coefficient below was read off what autograd (and activation checkpointing) actually keeps on one
rank, counted storage by storage for tiny models with ``ndparallel.planner.measure`` (world 1 and TP/CP
layouts); ``benchmarks/planner_validation.md`` has the measured-vs-predicted table. Notation: b rows per
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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndparallel.layout import Layout
from ndparallel.loss import CHUNK_ROWS
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
    """Final norm, lm_head input and labels."""
    loss_saved: float
    """What the loss keeps for backward: the logits (compute dtype) and 14 bytes per token."""
    layer_recompute: float
    """Backward working set of the layer being processed: what checkpointing recomputes for it."""

    @property
    def retained(self) -> float:
        """Everything kept at the end of the forward (with the loss computed)."""
        return self.layers + self.embedding + self.head + self.loss_saved

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "retained": self.retained}


def _norm(m: ModelShape, t: int, e: int) -> float:
    """One RMSNorm under sequence parallelism, per token: fp32 input copy, 1/rms, normalized (compute dtype)."""
    return (4 * m.hidden + 4 + e * m.hidden) / t


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


def layer_none(m: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Bytes one decoder layer keeps for backward without checkpointing."""
    t, s = layout.tp, seq // layout.cp
    dense = b * s * (2 * _norm(m, t, e) + 2 * e * m.hidden + 4 * e * m.intermediate / t)
    if m.qk_norm:
        dense += b * s * ((4 + e) * (m.q_dim + m.kv_dim) + 4 * (m.heads + m.kv_heads)) / t
    return dense + attention_none(m, layout, seq, b, e)


def layer_selective(m: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Bytes one decoder layer keeps under selective checkpointing (matmul and attention outputs + input)."""
    t, c, h = layout.tp, layout.cp, m.hidden
    s = seq // c
    kernel = (e * m.q_dim + 4 * m.heads) / t
    if c > 1 and layout.cp_comm_strategy == "ring":
        kernel *= c + 0.5  # 2cp+1 cached blocks of s/2 tokens
    per_token = (e * h / t + e * (m.q_dim + 2 * m.kv_dim) / t + 2 * e * h + 2 * e * m.intermediate / t + kernel)
    return b * s * per_token


def layer_full(m: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Bytes one decoder layer keeps under full checkpointing: its input, sequence-split over tp."""
    return b * (seq // layout.cp) * e * m.hidden / layout.tp


def activation_bytes(m: ModelShape, layout: Layout, seq: int, b: int, mode: str, e: int = 2,
                     lora_rank: int | None = None) -> ActivationBytes:
    """Activation memory of one rank for a micro-batch of ``b`` rows of ``seq`` tokens."""
    t, s = layout.tp, seq // layout.cp
    none = layer_none(m, layout, seq, b, e)
    if lora_rank:
        # Not measured (peft is not in the measurement runs). Each adapted linear keeps its A output (r wide)
        # for B's backward; selective checkpointing also caches B's output, as wide as the linear's.
        none += b * s * 7 * e * lora_rank
    if mode == "none":
        per_layer, recompute = none, 0.0
    elif mode == "selective":
        per_layer = layer_selective(m, layout, seq, b, e)
        if lora_rank:
            widths = (m.q_dim + 2 * m.kv_dim + 2 * m.intermediate) / t + 2 * m.hidden
            per_layer += b * s * e * (7 * lora_rank + widths)
        recompute = max(none - per_layer, 0.0)
    else:
        per_layer, recompute = layer_full(m, layout, seq, b, e), none
    embedding = b * s * (2 * e * m.head_dim + 8)
    head = b * s * (_norm(m, t, e) + e * m.hidden + 8)
    loss_saved = b * s * (e * m.vocab / t + 14)
    return ActivationBytes(per_layer=per_layer, layers=m.layers * per_layer, embedding=embedding, head=head,
                           loss_saved=loss_saved, layer_recompute=recompute)


def loss_peak(m: ModelShape, layout: Layout, seq: int, b: int, e: int) -> float:
    """Most bytes the logits and the loss hold at once, per micro-batch (``ndparallel.loss``).

    The chunked cross-entropy never makes a full float32 copy or softmax of the (N, V/t) logits (N = b*s
    tokens of the rank). Its peak is in backward: the logits (saved by the loss and still held by the
    trainer, e bytes per local logit element), their gradient (e bytes) and the float32 temporaries of
    the chunk being processed (``CHUNK_ROWS`` rows): the upcast chunk (bf16 only; a no-op in fp32) and the
    max-shifted one, 4 bytes each, and, from the second chunk on, the previous chunk's result, which its
    loop variable keeps alive until the next is made; and 18 bytes per token (the saved log-sum-exp,
    label and masks, and the per-token loss gradient). Forward holds no gradient, so it peaks lower.
    """
    n, w = b * (seq // layout.cp), m.vocab / layout.tp
    per_row = 4 * w * (2 if e < 4 else 1)
    first = min(n, CHUNK_ROWS)
    second = min(max(n - CHUNK_ROWS, 0), CHUNK_ROWS)
    temporaries = max(first * per_row, (4 * w * first + second * per_row) if second else 0.0)
    return 2 * e * n * w + temporaries + 18 * n
