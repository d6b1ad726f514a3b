"""FLOPs of a training step as the model computes them, for MFU: the trainer, the benchmarks and the planner.

Two parts, counted per optimizer step (forward and backward, recomputation not counted: MFU's convention):

- dense: 6 FLOPs per weight per token (``flops_per_token``: the matmul weights a token passes through, the
  output head included, the active experts only for mixture-of-experts models);
- attention: per (query, key) pair that attention computes, per layer, ``4 * heads * head_dim`` forward
  (QK^T and PV) and twice that backward. Only pairs a query actually attends to count: causal, inside its
  own document (packed rows), inside the layer's sliding window; padding attends to nothing.

Counting a packed row as one causal document of L tokens would charge L^2/2 pairs where its documents cost
n * d^2/2: at 131,072 tokens of 4,096-token documents that is 32x the attention, and MFU above 100%.

The pair count of one document of n tokens under a window W (a query sees at most W keys, itself
included) is ``visible_pairs(n, W)`` = sum_{i<n} min(i + 1, W); a range of its queries [a, b) sees
visible_pairs(b) - visible_pairs(a) (context parallelism: each rank's chunks).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from ndparallel.models.moe import moe_shape
from ndparallel.parallel.attention.plan import cached_plan
from ndparallel.parallel.sequence import PAD_SEGMENT, chunk_ids

if TYPE_CHECKING:
    from ndparallel.step.batching import Batch

TRAIN_FLOPS_PER_PAIR_PER_DIM = 12
"""Forward 4 (QK^T and PV, 2 each), backward 8, per pair per query dimension (heads x head_dim)."""


def visible_pairs(n, window: int | None = None):
    """(query, key) pairs a causal document of ``n`` tokens attends (ints or an int64 tensor of lengths)."""
    causal = n * (n + 1) // 2
    if window is None:
        return causal
    banded = window * (window + 1) // 2 + (n - window) * window
    if isinstance(n, torch.Tensor):
        return torch.where(n <= window, causal, banded)
    return causal if n <= window else banded


def packed_row_pairs(seq_len: int, doc_len: int | None = None, window: int | None = None) -> int:
    """Pairs of one row of ``seq_len`` tokens packed with documents of ``doc_len`` (None: one document)."""
    doc = min(doc_len or seq_len, seq_len)
    whole, rest = divmod(seq_len, doc)
    return whole * visible_pairs(doc, window) + visible_pairs(rest, window)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """The sliding window of each decoder layer (None: full causal attention), as transformers' models read
    it: ``layer_types`` marks the sliding layers; without it ``sliding_window`` applies to every layer."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * layers
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * layers


def query_dim(config: Any) -> int:
    """heads x head_dim: the width of a query, over which every pair is a dot product."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads * head_dim


def flops_per_token(config: Any, *, frozen_base: bool = False, adapter_params: int = 0) -> float:
    """Training FLOPs per token (model FLOPs: recomputation not counted) over the N matmul weights a token uses
    (the decoder's linears and the output head): 6 N (forward 2, input gradients 2, weight gradients 2). With a
    ``frozen_base`` (LoRA, QLoRA) those weights get no weight-gradient GEMM: 4 N, plus 6 per trainable adapter
    weight (``adapter_params``: LoRA's A and B, r x (in + out) per adapted linear). Base weights unfrozen beside
    adapters (``lora_modules_to_save``) are counted as frozen: the figure errs low, never high."""
    return (4.0 if frozen_base else 6.0) * _matmul_weights_per_token(config) + 6.0 * adapter_params


def _matmul_weights_per_token(config: Any) -> float:
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    moe = moe_shape(config)  # a MoE model: the experts a token passes through, not all of them
    mlp = moe.active_mlp_params_per_layer if moe is not None else 3 * h * config.intermediate_size
    return layers * (attn + mlp) + h * config.vocab_size


class AttentionFlops:
    """Training FLOPs of attention for a model's shape: per row (benchmarks) or per prepared batch (trainer)."""

    def __init__(self, config: Any) -> None:
        self.per_pair = TRAIN_FLOPS_PER_PAIR_PER_DIM * query_dim(config)
        self.windows = Counter(layer_windows(config))
        """Layers per distinct window."""

    def of_row(self, seq_len: int, doc_len: int | None = None) -> float:
        """One row of ``seq_len`` tokens, documents of ``doc_len`` (None: the row is one document)."""
        return self.per_pair * sum(n * packed_row_pairs(seq_len, doc_len, w) for w, n in self.windows.items())

    def of_batch(self, batch: "Batch", *, cp: int = 1, cp_rank: int = 0) -> float:
        """This rank's share of a prepared batch: the pairs whose queries it holds (its cp chunks), all heads.
        Host work only (the batch's host segment ids; the documents are found once and shared with the
        attention plan). Summed over the loss group (dp x cp) it is the global count."""
        if batch.segments_host is None:  # whole one-document rows at cp 1
            rows, seq = batch.input_ids.shape
            return rows * self.of_row(seq)
        segments = batch.segments_host
        pairs = {
            w: cached_plan(segments, ("visible_pairs", w, cp, cp_rank), _pair_counter(segments, w, cp, cp_rank))
            for w in self.windows
        }
        return self.per_pair * sum(n * pairs[w] for w, n in self.windows.items())


def _pair_counter(segments: torch.Tensor, window: int | None, cp: int, cp_rank: int):
    def count(docs) -> int:
        real = segments[docs.row, docs.start] != PAD_SEGMENT
        start, end = docs.start[real], docs.end[real]
        total = 0
        for lo, hi in _query_ranges(segments.shape[1], cp, cp_rank):
            first = (start.clamp(min=lo) - start).clamp(min=0)
            last = (end.clamp(max=hi) - start).clamp(min=0)
            seen = last > first
            total += int((visible_pairs(last[seen], window) - visible_pairs(first[seen], window)).sum())
        return total

    return count


def _query_ranges(seq: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """Row positions whose queries this cp rank computes: its two load-balanced chunks (parallel/sequence.py)."""
    if cp == 1:
        return [(0, seq)]
    chunk = seq // (2 * cp)
    return [(c * chunk, (c + 1) * chunk) for c in chunk_ids(cp_rank, cp)]


def mfu(*, flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilization: ``flops`` (dense + attention) done in ``seconds`` over what ``peak`` FLOP/s
    (all devices together) could do in that time."""
    return flops / (seconds * peak)
